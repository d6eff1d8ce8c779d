"""Paged KV: per layer, a pool of fixed-size pages of keys and values.

Each sequence holds a table of pages; its token ``i`` lives in page
``table[i // PAGE_TOKENS]`` at row ``i % PAGE_TOKENS``. A step writes only its new
tokens (a scatter per layer, in place), so a sequence that joins the running ones
or grows copies nothing. The pages live in arenas of about ``ARENA_BYTES`` across
the layers; the store grows by an arena, never copying the ones it has (doubling
one array per layer stalled a step for 0.65 s at 8,000 tokens of the embedded
model). Pages are counted by reference: a page shared by several tables is freed
when its last holder lets it go.

A sequence's KV state leaves the store as a ``PagedPrefix`` per layer, which holds
its pages (``PageLease``) instead of copying them out, and the prompt cache keeps
that. A sequence that starts from it shares its full pages and copies only the
page it writes next, so a prefix that many requests share is stored once.

A forward pass over pages hands each layer a ``PagedLayer`` in place of mlx-lm's
cache: its ``offset`` carries every token's position (``TokenPositions``) and its
``update_and_fetch`` returns the arenas with the step's layout (``PagedKeys``),
which ``caches/paged_attention.py`` turns into attention per sequence.
"""

import inspect
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_backend.caches.quantized_kv import QuantizedKVCache

# Tokens a page holds: the CPU attention kernel's key block, so that a block of
# keys never straddles two pages.
PAGE_TOKENS = 32
# A table's entry for a page freed behind a sliding window (or never loaded).
HOLE = -1
# An arena's bytes across every layer's keys and values (at least MIN_ARENA_PAGES
# pages): a new arena's first use fills it, about 25 ms for these 64 MB here.
ARENA_BYTES = 64 << 20
MIN_ARENA_PAGES = 8


class MissingKeys(Exception):
    """A cached state lacks keys its next token sees (a sliding window's whose
    first tokens held start too late); the message says which."""


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's KV rows: heads, key and value dims, the model's KV
    dtype, and the dtype its pages store them in (None: the model's), or
    (``bits``) MLX's affine quantization in groups of ``group_size`` dims.
    ``latent``: an MLA layer's latent dims (its pages' keys are the latent and
    the rotary key, its values the keys' latent dims, held once; mlx-lm's cache
    keeps the latent as keys and the rotary key as values). ``window``: a sliding window's keys (0:
    the layer sees every key); such a layer's pages behind its window are freed
    (``caches/page_tables.py``)."""

    kv_heads: int
    key_dims: int
    value_dims: int
    dtype: mx.Dtype
    page_dtype: mx.Dtype | None = None
    bits: int | None = None
    group_size: int = 64
    latent: int = 0
    window: int = 0

    @property
    def stored(self) -> mx.Dtype:
        return self.page_dtype or self.dtype

    @property
    def planes(self) -> tuple[tuple[int, mx.Dtype], ...]:
        """Each array a page keeps per token and head, as (width, dtype): keys'
        then values' (an MLA layer's keys alone: its values are their latent).
        Quantized: codes packed in words (as ``mx.quantize`` packs them), then
        float32 scales and biases, for keys and for values."""
        if self.latent:
            # MLA: the values are the keys' first dims (the latent), held once.
            return ((self.key_dims, self.stored),)
        if self.bits is None:
            return ((self.key_dims, self.stored), (self.value_dims, self.stored))
        return tuple(
            plane
            for dims in (self.key_dims, self.value_dims)
            for plane in (
                (dims * self.bits // 32, mx.uint32),
                (dims // self.group_size, mx.float32),
                (dims // self.group_size, mx.float32),
            )
        )


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a step: where they start on the step's token axis,
    how many, the context they see (those tokens included), and its pages (a
    ``PagedStore``'s: a table per group of layers)."""

    start: int
    tokens: int
    context: int
    pages: tuple[int, ...] | tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Write:
    """A step's tokens that land in one arena: its index, their rows in it (a
    slice where they are consecutive: one update in place of a scatter's chain of
    nodes, every layer), and where they sit on the step's token axis (None: all
    of them, in order)."""

    arena: int
    rows: mx.array | slice
    tokens: mx.array | None


@dataclass(frozen=True)
class StepLayout:
    """A forward pass's tokens, flattened into one axis: each token's position
    and where its keys and values are written (``writes``, per arena), and per
    sequence its segment, also as arrays for the kernel (``segments``: first
    token, tokens, context; ``tables``: pages, padded)."""

    positions: mx.array
    writes: tuple[Write, ...]
    segments: tuple[Segment, ...]
    segment_array: mx.array
    tables: mx.array

    @property
    def tokens(self) -> int:
        return int(self.positions.size)


def make_layout(
    segments: Sequence[Segment], arena_pages: int, like: StepLayout | None = None
) -> StepLayout:
    """The layout of a pass over ``segments``, in the order given, for a store of
    ``arena_pages`` pages an arena; ``like``: another group's layout of the same
    pass, whose positions and segment rows it shares."""
    positions, slots = [], []
    for s in segments:
        at = np.arange(s.context - s.tokens, s.context, dtype=np.int32)
        positions.append(at)
        slots.append(_slots(s.pages, at))
    widest = max(len(s.pages) for s in segments)
    tables = np.zeros((len(segments), widest), dtype=np.int32)
    for i, s in enumerate(segments):
        tables[i, : len(s.pages)] = s.pages
    # A hole is never read (attention starts at its window): any page will do.
    np.maximum(tables, 0, out=tables)
    if like is None:
        rows = np.array([(s.start, s.tokens, s.context) for s in segments], np.int32)
        shared = mx.array(np.concatenate(positions)), mx.array(rows)
    else:
        shared = like.positions, like.segment_array
    return StepLayout(
        shared[0],
        _writes(np.concatenate(slots), arena_pages),
        tuple(segments),
        shared[1],
        mx.array(tables),
    )


def _writes(slots: np.ndarray, arena_pages: int) -> tuple[Write, ...]:
    arena_rows = arena_pages * PAGE_TOKENS
    arenas = slots // arena_rows
    if (arenas == arenas[0]).all():
        rows = slots % arena_rows
        if (np.diff(rows) == 1).all():
            return (
                Write(int(arenas[0]), slice(int(rows[0]), int(rows[-1]) + 1), None),
            )
        return (Write(int(arenas[0]), mx.array(rows), None),)
    return tuple(
        Write(
            int(a),
            mx.array(slots[arenas == a] % arena_rows),
            mx.array(np.nonzero(arenas == a)[0].astype(np.int32)),
        )
        for a in np.unique(arenas)
    )


class PagedKV:
    """Every attention layer's arenas of pages, and which pages are held."""

    def __init__(self, shapes: Sequence[LayerShape], arena_pages: int | None = None):
        self.shapes = tuple(shapes)
        # A model of recurrent layers alone has pages of no bytes.
        self.arena_pages = arena_pages or max(
            MIN_ARENA_PAGES, ARENA_BYTES // (self.page_nbytes or ARENA_BYTES)
        )
        # Per layer, per plane (LayerShape.planes), its arenas.
        self.planes: list[list[list[mx.array]]] = [
            [[] for _ in s.planes] for s in self.shapes
        ]
        # Per layer, the arenas of its keys and of its values (the codes where
        # quantized): the planes' own lists.
        self.keys = [p[0] for p in self.planes]
        self.values = [p[len(p) // 2] for p in self.planes]
        self._refs: list[int] = []
        self._free: list[int] = []
        # Pages that dropped kept states let go, from whichever thread dropped them
        # (or a garbage collection inside this store's own calls): released on the
        # engine thread when the store is next used.
        self._dropped: deque[tuple[int, ...]] = deque()
        # Set when the decoder that wrote it was reset: its pages may hold a failed
        # step's writes, so its kept states are not used.
        self.closed = False
        self._grow()

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every layer, keys and values."""
        return sum(map(layer_page_nbytes, self.shapes))

    @property
    def pages(self) -> int:
        return len(self._refs)

    @property
    def pages_held(self) -> int:
        self._release_dropped()
        return len(self._refs) - len(self._free)

    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return self.pages_held * self.page_nbytes

    def layout(
        self, segments: Sequence[Segment], like: StepLayout | None = None
    ) -> StepLayout:
        return make_layout(segments, self.arena_pages, like)

    def allocate(self, count: int) -> list[int]:
        """``count`` free pages, held once each; arenas are added when short."""
        self._release_dropped()
        while count > len(self._free):
            self._grow()
        taken = [self._free.pop() for _ in range(count)]
        for page in taken:
            self._refs[page] = 1
        return taken

    def retain(self, pages: Sequence[int]) -> None:
        """One more holder for each of ``pages`` (holes skipped)."""
        for page in pages:
            if page == HOLE:
                continue
            assert self._refs[page] > 0, "retaining a free page"
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer for each of ``pages`` (holes skipped); those left
        with none are free."""
        for page in pages:
            if page == HOLE:
                continue
            assert self._refs[page] > 0, "releasing a free page"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refs(self, page: int) -> int:
        self._release_dropped()
        return self._refs[page]

    def _release_dropped(self) -> None:
        while self._dropped:
            self.release(self._dropped.popleft())

    def write(
        self, layer: int, writes: Sequence[Write], keys: mx.array, values: mx.array
    ):
        """Keys and values ``[1, heads, tokens, dims]`` into their rows (quantized
        where the layer's pages are)."""
        shape = self.shapes[layer]
        if shape.bits is not None:
            keys, values = (
                _quantize(x, shape.group_size, shape.bits) for x in (keys, values)
            )
            self._write_planes(layer, writes, (*keys, *values))
        else:
            self._write_planes(layer, writes, (keys, values))

    def _write_planes(
        self, layer: int, writes: Sequence[Write], parts: Sequence[mx.array]
    ):
        for arenas, new in zip(self.planes[layer], parts):
            # A view (new[0] would be a gather, a copy).
            rows = new.squeeze(0).swapaxes(0, 1)
            for w in writes:
                arenas[w.arena][w.rows] = rows if w.tokens is None else rows[w.tokens]

    def read(self, layer: int, pages: Sequence[int], length: int, start: int = 0):
        """Tokens ``start`` to ``length`` of a table of ``pages``: their keys and
        values, each ``[1, heads, tokens, dims]``; where the layer is quantized,
        each the triple of codes, scales and biases that ``mx.quantize``
        returns."""
        first = start // PAGE_TOKENS
        pages = np.asarray(pages[first : pages_for(length)], dtype=np.int32)
        # A hole would read another sequence's page without a word.
        assert (pages >= 0).all(), "reading a page freed behind a window"
        skip = start - first * PAGE_TOKENS
        parts = [
            _rows(arenas, pages, self.arena_pages, length - first * PAGE_TOKENS)[
                ..., skip:, :
            ]
            for arenas in self.planes[layer]
        ]
        shape = self.shapes[layer]
        if shape.latent:
            return parts[0], parts[0][..., : shape.latent]
        if shape.bits is None:
            return tuple(parts)
        return tuple(parts[:3]), tuple(parts[3:])

    def read_float(self, layer: int, pages: Sequence[int], length: int, start=0):
        """``read``'s keys and values, dequantized where the layer is quantized."""
        shape = self.shapes[layer]
        keys, values = self.read(layer, pages, length, start)
        if shape.bits is None:
            return keys, values
        return _dequantized(keys, values, shape.group_size, shape.bits)

    def prefix(self, table: "Table", length: int) -> list["PagedPrefix"]:
        """The first ``length`` tokens of ``table`` as a KV state of their own,
        per layer: it holds the pages, copying nothing."""
        lease = PageLease(self, table.pages[: pages_for(length)], table.start)
        return [PagedPrefix(lease, layer, length) for layer in range(len(self.shapes))]

    def take(self, cache: Sequence, length: int) -> "Table":
        """A new table holding the first ``length`` tokens of ``cache``. A
        ``PagedPrefix`` of this store lends its full pages, and the page the
        table's owner writes next is copied; mlx-lm caches (or another store's
        pages) are loaded into new pages: a sliding window's state that went
        round, its last tokens at their places (the pages before them holes).
        Raises ``MissingKeys`` where those lack a key the next token sees."""
        first = cache[0]
        if isinstance(first, PagedPrefix) and first.lease.kv is self:
            pages = list(first.lease.pages[: pages_for(length)])
            full = length // PAGE_TOKENS
            if full < len(pages):
                (own,) = self.allocate(1)
                self._copy_page(pages[full], own)
                pages[full] = own
            self.retain(pages[:full])
            return Table(pages, first.lease.start)
        if isinstance(first, PagedPrefix):
            cache = [layer.to_kv_cache(exact=True) for layer in cache]
        start = max(map(first_held, cache))
        # The first key the next token sees.
        sees = max(length - min(s.window or length for s in self.shapes), 0)
        if start > sees:
            raise MissingKeys(f"its keys start at token {start} of {length}")
        skipped = start // PAGE_TOKENS
        pages = [HOLE] * skipped + self.allocate(pages_for(length) - skipped)
        try:
            self.load(pages, cache, length, start)
        except Exception:
            self.release(pages)
            raise
        return Table(pages, start)

    def load(
        self, pages: Sequence[int], cache: Sequence[KVCache], length: int, start=0
    ):
        """Tokens ``start`` to ``length`` of mlx-lm caches into ``pages``."""
        at = np.arange(start, length, dtype=np.int32)
        writes = _writes(_slots(pages, at), self.arena_pages)
        for layer, c in enumerate(cache):
            shape, bits = self.shapes[layer], getattr(c, "bits", None)
            keys, values = in_order(c, start, length)
            if bits is not None and (bits, c.group_size) == (
                shape.bits,
                shape.group_size,
            ):
                # Quantized alike: its codes as they are, scales and biases
                # in float32 (every third part from the first is codes).
                parts = [
                    x if i % 3 == 0 else x.astype(mx.float32)
                    for i, x in enumerate((*keys, *values))
                ]
                self._write_planes(layer, writes, parts)
                continue
            if bits is not None:
                keys, values = _dequantized(keys, values, c.group_size, bits)
            if shape.latent:
                keys, values = mx.concatenate([keys, values], axis=-1), keys
            self.write(layer, writes, keys, values)

    def _copy_page(self, source: int, target: int) -> None:
        (sa, s), (ta, t) = divmod(source, self.arena_pages), divmod(
            target, self.arena_pages
        )
        s, t = s * PAGE_TOKENS, t * PAGE_TOKENS
        for arenas in self._all_planes():
            arenas[ta][t : t + PAGE_TOKENS] = arenas[sa][s : s + PAGE_TOKENS]

    def _all_planes(self) -> list[list[mx.array]]:
        return [arenas for planes in self.planes for arenas in planes]

    def _grow(self) -> None:
        rows = self.arena_pages * PAGE_TOKENS
        for planes, s in zip(self.planes, self.shapes):
            for arenas, (width, dtype) in zip(planes, s.planes):
                arenas.append(mx.zeros((rows, s.kv_heads, width), dtype))
        # Filled now, not by the step that first writes it: the memory is taken
        # when the store says so (the first arena at load).
        mx.eval([arenas[-1] for arenas in self._all_planes()])
        first, more = len(self._refs), self.arena_pages
        self._refs += [0] * more
        # Lowest pages first out of the list's end.
        self._free = list(range(first + more - 1, first - 1, -1)) + self._free


def first_held(cache: KVCache) -> int:
    """The first position whose keys and values a layer of mlx-lm's cache holds:
    a sliding window's, past its window, only its last tokens'."""
    if isinstance(cache, RotatingKVCache):
        return cache.offset - min(cache.offset, cache.keys.shape[2])
    return 0


def in_order(cache: KVCache, start: int, length: int) -> tuple:
    """Keys and values of positions ``start`` to ``length`` of a layer of
    mlx-lm's cache (quantized: ``mx.quantize`` triples); a sliding window's
    ring read in the order its tokens came."""
    keys, values = cache.keys, cache.values
    if isinstance(cache, RotatingKVCache):
        # Its state: keys, values, offset, keep (0 here), size, next slot.
        at, since = cache.state[5], first_held(cache)
        keys, values = (
            (
                mx.concatenate([x[..., at:, :], x[..., :at, :]], axis=2)
                if at < min(cache.offset, x.shape[2])
                else x
            )
            for x in (keys, values)
        )
        start, length = start - since, length - since
    if isinstance(keys, (tuple, list)):
        # Quantized: codes, scales and biases.
        return tuple(tuple(p[..., start:length, :] for p in x) for x in (keys, values))
    return keys[..., start:length, :], values[..., start:length, :]


def layer_page_nbytes(shape: LayerShape) -> int:
    """Bytes of one page of one layer, keys and values."""
    row = sum(width * dtype.size for width, dtype in shape.planes)
    return PAGE_TOKENS * shape.kv_heads * row


def _dequantized(keys, values, group_size: int, bits: int) -> tuple[mx.array, ...]:
    """Keys and values given as ``mx.quantize`` triples, as floats."""
    return tuple(
        mx.dequantize(*x, group_size=group_size, bits=bits) for x in (keys, values)
    )


def _quantize(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, ...]:
    # Scales and biases in float32 whatever the model's dtype: what the kernel reads.
    return tuple(mx.quantize(x.astype(mx.float32), group_size=group_size, bits=bits))


@dataclass
class Table:
    """A sequence's pages in a store: page ``i`` holds its tokens from
    ``i * PAGE_TOKENS`` on. ``start``: the first token it holds (mid-page where
    a ring that went round was loaded); the pages before it are holes (behind a
    sliding window, or never loaded)."""

    pages: list[int] = field(default_factory=list)
    start: int = 0


class PageLease:
    """Pages of a store held for as long as this object lives (``start``: the
    first token they hold)."""

    def __init__(self, kv: PagedKV, pages: Sequence[int], start: int = 0):
        self.kv, self.pages, self.start = kv, tuple(pages), start
        kv.retain(self.pages)
        weakref.finalize(self, kv._dropped.append, self.pages)


class PagedPrefix:
    """One layer of a KV state whose tokens live in pages: a paged decoder's
    sequence that left, kept by the prompt cache. The prompt cache trims and
    copies it as any growing cache (a copy shares the pages, a trim shortens it;
    a sliding window's whose first pages were freed, to no fewer tokens than
    ``floor``), and a paged decoder that starts a sequence from it shares them
    (``PagedKV.take``)."""

    def __init__(self, lease: PageLease, layer: int, offset: int):
        self.lease, self.layer, self.offset = lease, layer, offset

    @property
    def state(self) -> tuple:
        # Nothing of its own to evaluate: queued steps write its pages.
        return ()

    @property
    def nbytes(self) -> int:
        shape = self.lease.kv.shapes[self.layer]
        held = pages_for(self.offset) - self.lease.start // PAGE_TOKENS
        return held * layer_page_nbytes(shape)

    @property
    def floor(self) -> int:
        """The fewest tokens it may be trimmed to: where its window holds
        every key the next token sees."""
        start = self.lease.start
        return start + self.lease.kv.shapes[self.layer].window if start else 0

    def is_trimmable(self) -> bool:
        return self.offset > self.floor

    def trim(self, n: int) -> int:
        n = min(self.offset - self.floor, n)
        self.offset -= n
        return n

    def __deepcopy__(self, memo) -> "PagedPrefix":
        return PagedPrefix(self.lease, self.layer, self.offset)

    def to_kv_cache(self, exact: bool = False) -> KVCache:
        """A copy of its tokens as mlx-lm's cache (a prompt file, a Score job):
        a quantized layer's as the project's ``QuantizedKVCache``, a sliding
        window's whose first pages were freed as a ``RotatingKVCache`` past its
        window. In the model's dtype, or (``exact``, for another store's pages)
        in the pages' own."""
        shape = self.lease.kv.shapes[self.layer]
        pages = self.lease.pages[: pages_for(self.offset)]
        start = max(self.offset - shape.window, 0) if self.lease.start else 0
        keys, values = self.lease.kv.read(self.layer, pages, self.offset, start)
        dtype = None if exact else shape.dtype
        if shape.latent:
            keys, values = keys[..., : shape.latent], keys[..., shape.latent :]
        if shape.bits is None:
            if dtype is not None:
                keys, values = keys.astype(dtype), values.astype(dtype)
            if start:
                # Its ring full, in order: the next token goes in its first slot.
                cache = RotatingKVCache(shape.window)
                cache.state = (keys, values, self.offset, 0, shape.window, shape.window)
                return cache
            cache = KVCache()
            cache.state = (keys, values, self.offset)
            return cache
        cache = QuantizedKVCache(group_size=shape.group_size, bits=shape.bits)
        cache.keys, cache.values = (
            (x[0], *(p if dtype is None else p.astype(dtype) for p in x[1:]))
            for x in (keys, values)
        )
        cache.offset = self.offset
        return cache


def trim_floor(cache: Sequence) -> int:
    """The fewest tokens a per-layer cache may be trimmed to: its paged sliding
    windows' ``floor`` (0 for any other)."""
    return max(
        (layer.floor for layer in cache if isinstance(layer, PagedPrefix)), default=0
    )


def pages_for(tokens: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // PAGE_TOKENS)


def _slots(pages: Sequence[int], at: np.ndarray) -> np.ndarray:
    """The rows, store-wide, of consecutive positions ``at`` through a table of
    ``pages``; only the pages they fall in are read (a decode row: one, however
    long its table)."""
    first = int(at[0]) // PAGE_TOKENS
    table = np.asarray(pages[first : int(at[-1]) // PAGE_TOKENS + 1], dtype=np.int32)
    return table[at // PAGE_TOKENS - first] * PAGE_TOKENS + at % PAGE_TOKENS


def _rows(
    arenas: list[mx.array], pages: np.ndarray, arena_pages: int, length: int
) -> mx.array:
    heads, dims = arenas[0].shape[1:]
    which, local = pages // arena_pages, pages % arena_pages
    parts, order = [], []
    for a in np.unique(which):
        at = np.nonzero(which == a)[0]
        paged = arenas[a].reshape(-1, PAGE_TOKENS, heads, dims)
        parts.append(paged[mx.array(local[at])])
        order.append(at)
    gathered = parts[0]
    if len(parts) > 1:
        # Back in the table's order.
        back = np.argsort(np.concatenate(order)).astype(np.int32)
        gathered = mx.concatenate(parts)[mx.array(back)]
    return gathered.reshape(-1, heads, dims)[:length].swapaxes(0, 1)[None]


@dataclass(frozen=True)
class TokenPositions:
    """A pass's ``offset``: each token's own position, which RoPE reads. As an
    array (``mx.array(cache.offset)``, as Gemma 4's attention takes it) it is
    those positions, one per token."""

    layout: StepLayout

    def __mlx_array__(self) -> mx.array:
        return self.layout.positions


@dataclass(frozen=True)
class PagedWindow:
    """A sliding-window layer's mask in a paged pass: each token sees the last
    ``size`` keys of its sequence, itself included."""

    size: int


@dataclass(frozen=True)
class PagedKeys:
    """What a ``PagedLayer`` hands attention for its keys or values: the layer's
    arenas (written this step) and the step's layout."""

    kv: PagedKV
    layer: int
    layout: StepLayout


class PagedLayer:
    """One layer's cache in a forward pass over pages: mlx-lm's attention calls
    ``offset``, ``update_and_fetch`` and (through ``create_attention_mask``)
    ``make_mask``; attention per sequence is causal by itself, and a sliding
    window's mask says how far back it sees."""

    def __init__(self, kv: PagedKV, layer: int, layout: StepLayout):
        self._kv, self._layer, self._layout = kv, layer, layout
        self.offset = TokenPositions(layout)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._kv.write(self._layer, self._layout.writes, keys, values)
        view = PagedKeys(self._kv, self._layer, self._layout)
        return view, view

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return PagedWindow(window_size) if window_size else None


def route_calls(classes: Iterable[type], cache_type: type, run: Callable) -> None:
    """Route the calls ``module(x, mask, cache)`` of ``classes`` whose cache is
    a ``cache_type`` to ``run(module, call, x, mask, cache)`` (``call``: the
    class's own); calls over any other cache, and every call of a class whose
    call takes other arguments (Mamba 1's ``(x, cache)``, Mistral 4's
    ``(x, attn_scale, mask, cache)``), go on as they were."""
    for cls in classes:
        call = cls.__call__
        if not hasattr(call, "unrouted") and takes_x_mask_cache(call):
            x = list(inspect.signature(call).parameters)[1]
            cls.__call__ = _routed(call, cache_type, run, x)


def takes_x_mask_cache(call: Callable) -> bool:
    """Whether ``call(self, x, mask, cache)`` is how a module's call goes."""
    params = list(inspect.signature(call).parameters.values())[1:]
    names = [p.name for p in params[:3]]
    required = [p for p in params[3:] if p.default is inspect.Parameter.empty]
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    return (
        len(names) == 3
        and names[1:] == ["mask", "cache"]
        and all(p.kind in kinds for p in params[:3])
        and not required
    )


def _routed(call: Callable, cache_type: type, run: Callable, name: str) -> Callable:
    def routed(self, *args, **kwargs):
        cache = kwargs["cache"] if "cache" in kwargs else (args[2:3] or [None])[0]
        if not isinstance(cache, cache_type):
            return call(self, *args, **kwargs)
        x = args[0] if args else kwargs[name]
        mask = kwargs["mask"] if "mask" in kwargs else (args[1:2] or [None])[0]
        return run(self, call, x, mask, cache)

    routed.unrouted = call
    return routed
