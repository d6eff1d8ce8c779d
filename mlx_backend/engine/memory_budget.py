"""One memory budget per loaded model, and what the scheduler admits under it.

The budget covers the weights, the KV cache of every running sequence at its full
requested length (prompt plus ``Tokens``), the prompt cache with its snapshots,
and the peak of one prefill step. A request starts only while the running
sequences' KV, its own and the prompt cache fit together; the prompt cache
shrinks first, and a request that can never fit is refused at once.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache

from mlx_backend.caches.page_tables import WINDOW_SLACK
from mlx_backend.caches.paged import PAGE_TOKENS, LayerShape, layer_page_nbytes
from mlx_backend.caches.recurrent import RecurrentShape
from mlx_backend.cpu.blas import physical_memory
from mlx_backend.errors import InvalidArgument, ResourceExhausted
from mlx_utils import make_kv_cache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# The source of a budget LoadModel's option set.
OPTION_SOURCE = "memory_budget"
# The default budget's share of the device's memory: of Metal's recommended working
# set (already a limit), or of the RAM or GPU memory, which others share.
WORKING_SET_FRACTION = 0.9
DEVICE_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class LayerBytes:
    """What one layer's KV cache holds for a sequence of n tokens."""

    # Bytes whatever the length (a recurrent state), and bytes per token held.
    fixed: int = 0
    per_token: int = 0
    # The most tokens a sliding-window layer holds, a prefill chunk included
    # (None: all of them).
    window: int | None = None
    # Tokens the layer allocates room for at a time (mlx-lm's KVCache: 256).
    step: int = 1

    def bytes_for(self, tokens: int) -> int:
        held = -(-tokens // self.step) * self.step
        if self.window is not None:
            held = min(held, self.window)
        return self.fixed + self.per_token * held


@dataclass(frozen=True)
class KVSizer:
    """The bytes a sequence's KV cache takes, layer by layer."""

    layers: tuple[LayerBytes, ...] = ()

    def bytes_for(self, tokens: int) -> int:
        return sum(layer.bytes_for(tokens) for layer in self.layers)


def _state_bytes(layer) -> int:
    leaves = tree_flatten(layer.state)
    return sum(a.nbytes for _, a in leaves if isinstance(a, mx.array))


def measure_kv_sizer(model: nn.Module, options: LoadOptions) -> KVSizer:
    """Each layer's bytes, read from the model's own cache after one token: a
    layer of keys and values holds room for ``step`` tokens at a time, and its
    bytes over that room are a token's share; any other state is fixed."""
    cache = make_kv_cache(model, options)
    model(mx.array([[1]]), cache=cache)
    mx.eval([layer.state for layer in cache])
    layers = []
    for layer in cache:
        held = _state_bytes(layer)
        keys = [a for _, a in tree_flatten(getattr(layer, "keys", None))]
        if not keys or not isinstance(keys[0], mx.array):
            layers.append(LayerBytes(fixed=held))
            continue
        room = keys[0].shape[-2]
        window = None
        if isinstance(layer, RotatingKVCache):
            # A prefill chunk attends over the window and itself, held together.
            window = layer.max_size + (options.prefill_step_size or 1) - 1
        layers.append(
            LayerBytes(0, -(-held // room), window, getattr(layer, "step", 1))
        )
    return KVSizer(tuple(layers))


def paged_kv_sizer(
    shapes: Sequence[LayerShape | RecurrentShape], chunk: int
) -> KVSizer:
    """A sequence's bytes on pages: whole pages of every layer, in the pages'
    types (float16, quantized); a sliding window's at most its window, the
    slack its table keeps and a prefill ``chunk``, with a page at either end
    (``caches/page_tables.py``); a recurrent layer's state, whatever the length."""
    return KVSizer(
        tuple(
            (
                LayerBytes(fixed=s.nbytes)
                if isinstance(s, RecurrentShape)
                else LayerBytes(
                    per_token=layer_page_nbytes(s) // PAGE_TOKENS,
                    window=(
                        s.window + WINDOW_SLACK + chunk + 2 * PAGE_TOKENS
                        if s.window
                        else None
                    ),
                    step=PAGE_TOKENS,
                )
            )
            for s in shapes
        )
    )


def device_memory() -> tuple[int, str]:
    """The default budget, and what it is a share of."""
    info = mx.device_info()
    working_set = info.get("max_recommended_working_set_size")
    if working_set:
        share = int(working_set * WORKING_SET_FRACTION)
        return share, f"{WORKING_SET_FRACTION:.0%} of the recommended working set"
    # Metal's and the CPU's memory_size, CUDA's total_memory.
    memory = info.get("memory_size") or info.get("total_memory") or physical_memory()
    share = int(memory * DEVICE_MEMORY_FRACTION)
    return share, f"{DEVICE_MEMORY_FRACTION:.0%} of the device's memory"


def weights_bytes(model: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def check_budget_option(model: nn.Module, options: LoadOptions) -> None:
    """Refuse a ``memory_budget`` that can't hold the weights as read, before the
    running model is unloaded (the full check follows the load)."""
    if options.memory_budget is None:
        return
    weights = weights_bytes(model)
    if options.memory_budget <= weights:
        raise InvalidArgument(
            f"Options: memory_budget: {options.memory_budget} bytes don't hold "
            f"the weights' {weights} bytes"
        )


@dataclass(frozen=True)
class MemoryBudget:
    """The byte budget of one loaded model and its fixed parts."""

    total: int
    weights: int
    # One prefill step's peak beyond the KV it adds.
    prefill: int
    sizer: KVSizer
    # Batched KV caches keep every row as long as the longest (mlx-lm pads rows).
    rectangular: bool
    # Where the total came from: the option, or the device's memory.
    source: str = ""

    @property
    def room(self) -> int:
        """Bytes for running sequences' KV and the prompt cache together."""
        return self.total - self.weights - self.prefill

    def room_beside(self, lent: int) -> int:
        """The room while ``lent`` bytes of the device's memory serve other work
        (a fine-tuning job): a share of the device's memory shrinks by them, a
        budget the option set stays as set."""
        return self.room - (0 if self.source == OPTION_SOURCE else lent)

    def kv_bytes(self, lengths: Sequence[int]) -> int:
        """The KV of sequences of these full lengths, decoding together."""
        if not lengths:
            return 0
        if self.rectangular:
            return len(lengths) * self.sizer.bytes_for(max(lengths))
        return sum(self.sizer.bytes_for(n) for n in lengths)

    def check_alone(self, tokens: int) -> None:
        """Refuse a request whose KV alone can't fit, whatever else runs."""
        need = self.kv_bytes([tokens])
        if need > self.room:
            raise ResourceExhausted(
                f"Tokens: the prompt and reply ({tokens} tokens) need {need} bytes "
                f"of KV cache, more than the memory budget leaves for it: "
                f"{self.room} bytes ({self.total} less the weights' {self.weights} "
                f"and a prefill step's {self.prefill}); send fewer tokens or raise "
                f"memory_budget"
            )

    def breakdown(self) -> dict[str, int]:
        return {
            "memory_budget_bytes": self.total,
            "budget_weights_bytes": self.weights,
            "budget_prefill_bytes": self.prefill,
        }


def make_memory_budget(
    model: nn.Module,
    options: LoadOptions,
    prefill_bytes: int,
    rectangular: bool,
    pages: Sequence[LayerShape] = (),
) -> MemoryBudget:
    """The loaded model's budget: ``memory_budget`` bytes, or a share of the
    device's memory; an explicit budget too small for the weights and one
    prefill step fails the load. Where the paged decoder serves, its layers'
    ``pages`` size a sequence (no rows padded to the longest)."""
    weights = weights_bytes(model)
    if pages:
        # A chunk's most tokens: a step's size, or the step token budget's.
        chunk = max(options.prefill_step_size or 1, options.step_token_budget or 0)
        sizer, rectangular = paged_kv_sizer(pages, chunk), False
    else:
        sizer = measure_kv_sizer(model, options)
    if options.memory_budget is not None:
        total, source = options.memory_budget, OPTION_SOURCE
    else:
        total, source = device_memory()
    budget = MemoryBudget(total, weights, prefill_bytes, sizer, rectangular, source)
    if budget.room <= 0:
        message = (
            f"the memory budget of {total} bytes ({source}) does not hold the "
            f"weights' {weights} bytes and a prefill step's {prefill_bytes}"
        )
        if options.memory_budget is not None:
            raise InvalidArgument(f"Options: memory_budget: {message}")
        logger.warning("%s: every request will be refused", message)
    logger.info(
        "memory budget %.1f MiB (%s): weights %.1f MiB, a prefill step %.1f MiB, "
        "KV %d bytes per token",
        total / 2**20,
        source,
        weights / 2**20,
        prefill_bytes / 2**20,
        sum(layer.per_token for layer in sizer.layers),
    )
    return budget
