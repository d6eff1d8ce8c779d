"""What a model's KV cache layers are, and how the prompt cache reuses them.

mlx-lm gives each family its own cache classes. Growing KV caches (``KVCache``
and its quantized kinds) can be trimmed to any length, so one prompt cache entry
serves every prefix of its tokens. A sliding window (``RotatingKVCache``) forgets
what slid out, and recurrent state (``ArraysCache``: SSM and convolution state)
holds no positions at all: neither can go back, so their entries serve only the
exact token boundaries at which they were kept, and prefill keeps copies
(snapshots) at chosen boundaries. A layer of any other class is not reused.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

# How the prompt cache reuses a model's KV state.
REUSE_BY_TRIM = "trim"
REUSE_BY_SNAPSHOT = "snapshot"
NO_REUSE = "none"

_GROWING = (KVCache, QuantizedKVCache, ConcatenateKVCache)
_WINDOW = (RotatingKVCache, ChunkedKVCache)


def layer_kind(layer) -> str:
    """``growing``, ``window``, ``state`` or ``other`` for one cache layer."""
    if isinstance(layer, CacheList):
        kinds = {layer_kind(c) for c in layer.caches}
        for kind in ("other", "state", "window"):
            if kind in kinds:
                return kind
        return "growing"
    if isinstance(layer, _GROWING):
        return "growing"
    if isinstance(layer, _WINDOW):
        return "window"
    if isinstance(layer, ArraysCache):
        return "state"
    return "other"


def copy_prefix(cache: Sequence, n: int) -> list | None:
    """A copy of a per-layer cache of plain ``KVCache`` layers holding only their
    first ``n`` tokens; None for any other cache."""
    if any(type(layer) is not KVCache for layer in cache):
        return None
    copies = []
    for layer in cache:
        copy = KVCache()
        copy.state = (
            mx.contiguous(layer.keys[..., :n, :]),
            mx.contiguous(layer.values[..., :n, :]),
            n,
        )
        copies.append(copy)
    return copies


def cache_length(cache: Sequence) -> int | None:
    """The tokens a per-layer cache holds, read off its first layer with an
    offset; None when no layer counts positions (recurrent state only)."""
    for layer in cache:
        if isinstance(layer, CacheList):
            layer = layer.caches[0]
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


@dataclass(frozen=True)
class CacheKinds:
    """A loaded model's cache layers and how its KV state is reused."""

    # (class name, number of layers), in the order the layers first use them.
    layers: tuple[tuple[str, int], ...] = ()
    reuse: str = REUSE_BY_TRIM
    # Why a model's state is not reused (reuse "none").
    why: str = ""

    @property
    def snapshots(self) -> bool:
        return self.reuse == REUSE_BY_SNAPSHOT

    def describe(self) -> str:
        layers = ", ".join(f"{n} {name}" for name, n in self.layers)
        how = {
            REUSE_BY_TRIM: "reused by trimming",
            REUSE_BY_SNAPSHOT: "reused from snapshots at token boundaries",
            NO_REUSE: f"not reused ({self.why})",
        }[self.reuse]
        return f"KV cache layers {layers}: prompt state {how}"

    def breakdown(self) -> dict[str, int]:
        """Status figures: layers per class, and which reuse is on."""
        figures = {f"kv_cache_layers.{name}": n for name, n in self.layers}
        figures[f"prompt_reuse_by.{self.reuse}"] = 1
        return figures


def make_cache_kinds(cache: Sequence) -> CacheKinds:
    """The kinds of a new (empty) per-layer cache of the model."""
    counts = Counter(type(layer).__name__ for layer in cache)
    kinds = {layer_kind(layer) for layer in cache}
    if "other" in kinds:
        names = sorted({type(c).__name__ for c in cache if layer_kind(c) == "other"})
        why = f"the prompt cache can't copy or trim {', '.join(names)} layers"
        return CacheKinds(tuple(counts.items()), NO_REUSE, why)
    reuse = REUSE_BY_TRIM if kinds <= {"growing"} else REUSE_BY_SNAPSHOT
    return CacheKinds(tuple(counts.items()), reuse)
