"""Paged KV: per layer, a pool of fixed-size pages of keys and values.

Each sequence holds a table of pages; its token ``i`` lives in page
``table[i // PAGE_TOKENS]`` at row ``i % PAGE_TOKENS``. A step writes only its new
tokens (one scatter per layer, in place), so a sequence that joins the running
ones or grows copies nothing. Pages are counted by reference: a page shared by
several tables is freed when its last holder lets it go.

A forward pass over pages hands each layer a ``PagedLayer`` in place of mlx-lm's
cache: its ``offset`` carries every token's position (``TokenPositions``) and its
``update_and_fetch`` returns the pools with the step's layout (``PagedKeys``),
which ``caches/paged_attention.py`` turns into attention per sequence.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

# Tokens a page holds: the CPU attention kernel's key block, so that a block of
# keys never straddles two pages.
PAGE_TOKENS = 32
# Pages a pool starts with; it doubles when a step needs more.
FIRST_PAGES = 64


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's KV rows: heads, key and value dims, dtype."""

    kv_heads: int
    key_dims: int
    value_dims: int
    dtype: mx.Dtype


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a step: where they start on the step's token axis,
    how many, the context they see (those tokens included), and its pages."""

    start: int
    tokens: int
    context: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class StepLayout:
    """A forward pass's tokens, flattened into one axis: each token's position and
    pool slot, and per sequence its segment, also as arrays for the kernel
    (``segments``: first token, tokens, context; ``tables``: pages, padded)."""

    positions: mx.array
    slots: mx.array
    segments: tuple[Segment, ...]
    segment_array: mx.array
    tables: mx.array

    @property
    def tokens(self) -> int:
        return int(self.positions.size)


def make_layout(segments: Sequence[Segment]) -> StepLayout:
    """The layout of a pass over ``segments``, in the order given."""
    positions, slots = [], []
    for s in segments:
        first = s.context - s.tokens
        at = np.arange(first, s.context, dtype=np.int32)
        positions.append(at)
        pages = np.asarray(s.pages, dtype=np.int32)
        slots.append(pages[at // PAGE_TOKENS] * PAGE_TOKENS + at % PAGE_TOKENS)
    widest = max(len(s.pages) for s in segments)
    tables = np.zeros((len(segments), widest), dtype=np.int32)
    for i, s in enumerate(segments):
        tables[i, : len(s.pages)] = s.pages
    rows = np.array([(s.start, s.tokens, s.context) for s in segments], np.int32)
    return StepLayout(
        mx.array(np.concatenate(positions)),
        mx.array(np.concatenate(slots)),
        tuple(segments),
        mx.array(rows),
        mx.array(tables),
    )


class PagedKV:
    """Every attention layer's pools of pages, and which pages are held."""

    def __init__(self, shapes: Sequence[LayerShape], pages: int = FIRST_PAGES):
        self.shapes = tuple(shapes)
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self._refs: list[int] = []
        self._free: list[int] = []
        self._grow(pages)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every layer, keys and values."""
        return PAGE_TOKENS * sum(
            s.kv_heads * (s.key_dims + s.value_dims) * s.dtype.size for s in self.shapes
        )

    @property
    def pages(self) -> int:
        return len(self._refs)

    @property
    def pages_held(self) -> int:
        return len(self._refs) - len(self._free)

    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return self.pages_held * self.page_nbytes

    def allocate(self, count: int) -> list[int]:
        """``count`` free pages, held once each; the pools grow when short."""
        if count > len(self._free):
            self._grow(max(self.pages, count - len(self._free)))
        taken = [self._free.pop() for _ in range(count)]
        for page in taken:
            self._refs[page] = 1
        return taken

    def retain(self, pages: Sequence[int]) -> None:
        """One more holder for each of ``pages``."""
        for page in pages:
            assert self._refs[page] > 0, "retaining a free page"
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer for each of ``pages``; those left with none are free."""
        for page in pages:
            assert self._refs[page] > 0, "releasing a free page"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array):
        """Keys and values ``[1, heads, tokens, dims]`` into the pool slots."""
        self.keys[layer][slots] = keys[0].swapaxes(0, 1)
        self.values[layer][slots] = values[0].swapaxes(0, 1)

    def read(self, layer: int, pages: Sequence[int], length: int):
        """The first ``length`` tokens' keys and values of a table of ``pages``,
        each ``[1, heads, length, dims]``."""
        index = mx.array(pages, dtype=mx.int32)
        return tuple(
            _rows(pool, index, length)
            for pool in (self.keys[layer], self.values[layer])
        )

    def export(self, pages: Sequence[int], length: int) -> list[KVCache]:
        """A copy of the first ``length`` tokens as mlx-lm caches (evaluated: the
        pools are written in place by the next step)."""
        caches = []
        for layer in range(len(self.shapes)):
            cache = KVCache()
            keys, values = self.read(layer, pages, length)
            cache.state = (mx.contiguous(keys), mx.contiguous(values), length)
            caches.append(cache)
        mx.eval([c.state for c in caches])
        return caches

    def load(self, pages: Sequence[int], cache: Sequence[KVCache], length: int):
        """The first ``length`` tokens of mlx-lm caches into ``pages``."""
        slots = mx.array(_slots(pages, 0, length))
        for layer, c in enumerate(cache):
            self.write(
                layer,
                slots,
                c.keys[..., :length, :],
                c.values[..., :length, :],
            )

    def _grow(self, more: int) -> None:
        for layer, s in enumerate(self.shapes):
            for pools, dims in ((self.keys, s.key_dims), (self.values, s.value_dims)):
                added = mx.zeros((more * PAGE_TOKENS, s.kv_heads, dims), s.dtype)
                if layer < len(pools):
                    pools[layer] = mx.concatenate([pools[layer], added])
                else:
                    pools.append(added)
        mx.eval(self.keys, self.values)
        first = len(self._refs)
        self._refs += [0] * more
        # Lowest pages first out of the list's end.
        self._free = list(range(first + more - 1, first - 1, -1)) + self._free


def pages_for(tokens: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // PAGE_TOKENS)


def _slots(pages: Sequence[int], first: int, end: int) -> np.ndarray:
    at = np.arange(first, end, dtype=np.int32)
    table = np.asarray(pages, dtype=np.int32)
    return table[at // PAGE_TOKENS] * PAGE_TOKENS + at % PAGE_TOKENS


def _rows(pool: mx.array, pages: mx.array, length: int) -> mx.array:
    heads, dims = pool.shape[1:]
    paged = pool.reshape(-1, PAGE_TOKENS, heads, dims)[pages]
    return paged.reshape(-1, heads, dims)[:length].swapaxes(0, 1)[None]


@dataclass(frozen=True)
class TokenPositions:
    """A pass's ``offset``: each token's own position, which RoPE reads."""

    layout: StepLayout


@dataclass(frozen=True)
class PagedKeys:
    """What a ``PagedLayer`` hands attention for its keys or values: the layer's
    pools (written this step) and the step's layout."""

    kv: PagedKV
    layer: int
    layout: StepLayout


class PagedLayer:
    """One layer's cache in a forward pass over pages: mlx-lm's attention calls
    ``offset``, ``update_and_fetch`` and (through ``create_attention_mask``)
    ``make_mask``; attention per sequence is causal by itself."""

    def __init__(self, kv: PagedKV, layer: int, layout: StepLayout):
        self._kv, self._layer, self._layout = kv, layer, layout
        self.offset = TokenPositions(layout)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._kv.write(self._layer, self._layout.slots, keys, values)
        view = PagedKeys(self._kv, self._layer, self._layout)
        return view, view

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("sliding windows do not run on pages yet")
        return None
