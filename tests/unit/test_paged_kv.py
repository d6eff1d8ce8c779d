"""Paged KV (``mlx_backend/caches/paged.py``): page accounting under random joins,
shares and leaves; a pass's layout; copies in and out of mlx-lm's caches; kept
states that hold pages, shared by the sequences that start from them; and
attention over pages, the CPU kernel's primitive against attention over each
sequence's gathered pages, on each instruction set."""

import copy
import gc
import random
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from mlx_backend.caches.paged import (
    HOLE,
    PAGE_TOKENS,
    LayerShape,
    PagedKeys,
    PagedKV,
    Segment,
    Table,
    make_layout,
    pages_for,
    route_calls,
)
from mlx_backend.caches.paged_attention import (
    gathered_attention,
    install_paged_ops,
    quantized_arenas,
)
from mlx_backend.caches.quantized_kv import QuantizedKVCache
from mlx_backend.cpu.kernels import fast_ops
from tests.support import FUSED_ISAS, each_fused_isa

SHAPE = LayerShape(kv_heads=2, key_dims=16, value_dims=16, dtype=mx.float32)


def test_pages_come_back_after_ten_thousand_random_joins_and_leaves():
    kv = PagedKV([SHAPE], arena_pages=4)
    rng = random.Random(68)
    live: list[list[int]] = []
    most = 0
    for _ in range(10_000):
        roll = rng.random()
        if roll < 0.45 or not live:
            live.append(kv.allocate(rng.randint(1, 6)))
        elif roll < 0.6:
            # A sequence that shares another's prefix pages and grows its own.
            shared = rng.choice(live)[: rng.randint(1, 3)]
            kv.retain(shared)
            live.append(shared + kv.allocate(rng.randint(0, 2)))
        else:
            kv.release(live.pop(rng.randrange(len(live))))
        held = {p for table in live for p in table}
        assert kv.pages_held == len(held)
        most = max(most, kv.pages_held)
    for table in live:
        kv.release(table)
    assert kv.pages_held == 0 and kv.nbytes() == 0
    # The store grew an arena at a time, to what the most held pages needed.
    assert most <= kv.pages < most + 4
    assert len(kv.keys[0]) == kv.pages // 4


def test_a_shared_page_is_freed_by_its_last_holder():
    kv = PagedKV([SHAPE], arena_pages=2)
    (page,) = kv.allocate(1)
    kv.retain([page])
    kv.release([page])
    assert kv.refs(page) == 1 and kv.pages_held == 1
    kv.release([page])
    assert kv.pages_held == 0
    with pytest.raises(AssertionError):
        kv.release([page])


def test_the_byte_count_is_every_layers_keys_and_values():
    kv = PagedKV([SHAPE, LayerShape(1, 8, 4, mx.float16)], arena_pages=2)
    assert kv.page_nbytes == PAGE_TOKENS * (2 * 32 * 4 + 1 * 12 * 2)
    kv.allocate(3)
    assert kv.nbytes() == 3 * kv.page_nbytes


def test_a_layout_places_each_token_in_its_page():
    segments = [Segment(0, 1, 40, (3, 5)), Segment(1, 3, 35, (1, 0))]
    layout = make_layout(segments, arena_pages=8)
    assert layout.positions.tolist() == [39, 32, 33, 34]
    (write,) = layout.writes
    assert write.arena == 0 and write.tokens is None
    assert write.rows.tolist() == [
        5 * PAGE_TOKENS + 7,
        0 * PAGE_TOKENS + 0,
        0 * PAGE_TOKENS + 1,
        0 * PAGE_TOKENS + 2,
    ]
    assert layout.segment_array.tolist() == [[0, 1, 40], [1, 3, 35]]
    assert layout.tables.tolist() == [[3, 5], [1, 0]]
    # Arenas of 2 pages: pages 5 and 0 (and 1) land in arenas 2 and 0.
    writes = make_layout(segments, arena_pages=2).writes
    assert [(w.arena, w.rows.tolist(), w.tokens.tolist()) for w in writes] == [
        (0, [0, 1, 2], [1, 2, 3]),
        (2, [PAGE_TOKENS + 7], [0]),
    ]


def test_a_cache_goes_into_pages_and_comes_back_the_same():
    rng = np.random.default_rng(0)
    caches = []
    for _ in range(2):
        cache = KVCache()
        keys = mx.array(rng.normal(size=(1, 2, 45, 16)).astype(np.float32))
        values = mx.array(rng.normal(size=(1, 2, 45, 16)).astype(np.float32))
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    kv = PagedKV([SHAPE, SHAPE], arena_pages=1)
    pages = kv.allocate(pages_for(40))
    # Pages out of order and in two arenas, as a store that served others hands
    # them out.
    pages.reverse()
    kv.load(pages, caches, 40)
    back = [layer.to_kv_cache() for layer in kv.prefix(Table(pages), 40)]
    for mine, theirs in zip(back, caches):
        assert mine.offset == 40
        assert mx.array_equal(mine.keys[..., :40, :], theirs.keys[..., :40, :])
        assert mx.array_equal(mine.values[..., :40, :], theirs.values[..., :40, :])


def test_a_kept_state_holds_its_pages_until_the_last_copy_goes():
    kv = PagedKV([SHAPE, SHAPE], arena_pages=2)
    pages = kv.allocate(pages_for(70))
    kept = kv.prefix(Table(pages), 70)
    # The sequence leaves: the kept state alone holds its three pages.
    kv.release(pages)
    assert kv.pages_held == 3
    assert sum(layer.nbytes for layer in kept) == 3 * kv.page_nbytes
    copied = copy.deepcopy(kept)
    trim_prompt_cache(copied, 40)
    assert [layer.offset for layer in copied] == [30, 30]
    assert sum(layer.nbytes for layer in copied) == kv.page_nbytes
    del kept
    gc.collect()
    # The trimmed copy shares the pages it was copied from: none is freed yet.
    assert kv.pages_held == 3
    # Dropped from another thread (a prompt cache cleared off the engine thread).
    dropper = threading.Thread(target=copied.clear)
    dropper.start()
    dropper.join()
    gc.collect()
    assert kv.pages_held == 0


def test_a_sequence_shares_a_kept_states_full_pages_and_copies_the_page_it_writes():
    kv = PagedKV([SHAPE], arena_pages=2)
    random_pools(kv, 3)
    pages = kv.allocate(pages_for(70))
    kept = kv.prefix(Table(pages), 70)
    kv.release(pages)
    before = [layer.to_kv_cache() for layer in kept]
    mx.eval([(c.keys, c.values) for c in before])
    # 45 tokens: the first page is shared, the second (rows 32-44) copied.
    taken = kv.take(kept, 45).pages
    assert taken[0] == pages[0] and taken[1] not in pages
    assert kv.refs(pages[0]) == 2 and kv.refs(pages[1]) == 1
    mine = kv.read(0, taken, 45)
    assert mx.array_equal(mine[0], before[0].keys[..., :45, :])
    assert mx.array_equal(mine[1], before[0].values[..., :45, :])
    # Its writes past the shared tokens leave the kept state as it was.
    writes = make_layout([Segment(0, 19, 64, tuple(taken))], kv.arena_pages).writes
    ones = mx.ones((1, 2, 19, 16))
    kv.write(0, writes, ones, ones)
    after = kept[0].to_kv_cache()
    assert mx.array_equal(after.keys, before[0].keys)
    assert mx.array_equal(kv.read(0, taken, 64)[0][..., 45:, :], ones)
    # A page-aligned length copies nothing; another store's state is loaded.
    assert kv.take(kept, 64) == Table(list(pages[:2]))
    other = PagedKV([SHAPE], arena_pages=2)
    loaded = other.take(kept, 45).pages
    assert mx.array_equal(other.read(0, loaded, 45)[0], before[0].keys[..., :45, :])


def random_pools(kv: PagedKV, seed: int) -> None:
    key = mx.random.key(seed)
    for layer, shape in enumerate(kv.shapes):
        planes = kv.planes[layer]
        if shape.bits is None:
            for arenas in planes:
                for i, arena in enumerate(arenas):
                    key, draw = mx.random.split(key)
                    arenas[i] = mx.random.normal(arena.shape, key=draw).astype(
                        arena.dtype
                    )
            continue
        # Quantized: random keys and values, quantized as a pass writes them.
        for half, dims in (
            (planes[:3], shape.key_dims),
            (planes[3:], shape.value_dims),
        ):
            for i in range(len(half[0])):
                key, draw = mx.random.split(key)
                rows = half[0][i].shape[0]
                x = mx.random.normal((rows, shape.kv_heads, dims), key=draw)
                parts = mx.quantize(x, group_size=shape.group_size, bits=shape.bits)
                for arenas, part in zip(half, parts):
                    arenas[i] = part


# Decode rows, a chunk deep in its context that splits pages, a first chunk, and
# one token at a page's edge; queries per kv head 1 and 4.
SEGMENTS = (
    Segment(0, 1, 40, (3, 5)),
    Segment(1, 20, 70, (0, 2, 7)),
    Segment(21, 1, 7, (1,)),
    Segment(22, 3, 3, (4,)),
    Segment(25, 1, 33, (6, 8)),
)


@pytest.fixture(params=FUSED_ISAS)
def isa(qmm, request):
    """Each test on every instruction set this CPU runs, down to the portable C++."""
    yield from each_fused_isa(qmm, request.param)


def kernel_error(qmm, q, kv: PagedKV, layout, sink, window: int = 0) -> float:
    """The kernel's largest difference from attention over gathered pages."""
    keys = PagedKeys(kv, 0, layout)
    expected = gathered_attention(q, keys, 0.25, sink, window=window)
    got = qmm.paged_attention(
        q,
        kv.keys[0],
        kv.values[0],
        layout.segment_array,
        layout.tables,
        scale=0.25,
        arena_pages=kv.arena_pages,
        window=window,
        sinks=sink,
        value_dims=kv.shapes[0].latent,
        **quantized_arenas(kv, 0),
    )
    assert got.shape == expected.shape
    return mx.max(mx.abs(got - expected)).item()


# One query head a KV head (a chunk's rows in threes at its end, each seeing its
# own keys), three (a decode row's three heads together), four (in pairs).
@pytest.mark.parametrize("heads", [2, 6, 8])
@pytest.mark.parametrize("sinks", [False, True])
# A sliding window of 13 keys starts inside a block, and in another page.
@pytest.mark.parametrize("window", [0, 13])
def test_the_kernel_attends_as_gathered_pages_do(qmm, isa, heads, sinks, window):
    install_paged_ops()
    # Pages in three arenas, a sequence's table across them.
    kv = PagedKV([SHAPE], arena_pages=4)
    kv.allocate(9)
    random_pools(kv, heads)
    layout = kv.layout(SEGMENTS)
    q = mx.random.normal((1, heads, layout.tokens, 16), key=mx.random.key(1))
    # Queries as mlx-lm hands them over: a transposed view.
    q = q.swapaxes(1, 2).reshape(1, layout.tokens, heads, 16).swapaxes(1, 2)
    sink = mx.random.normal((heads,), key=mx.random.key(2)) if sinks else None
    assert kernel_error(qmm, q, kv, layout, sink, window) < 2e-6


@pytest.mark.parametrize("heads", [6, 8])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window", [0, 100])
def test_deep_sequences_attend_as_gathered_pages_do(
    qmm, isa, heads, sinks, dtype, window
):
    """Decode rows and chunks thousands of keys deep, their tables shuffled across
    arenas, in float32 pages and in float16 ones (widened a block at a time), with
    and without a sliding window (whose blocks before it are not read); and a
    chunk long enough that its tasks take 64 positions each."""
    install_paged_ops()
    kv = PagedKV([LayerShape(2, 16, 16, dtype)], arena_pages=64)
    order = kv.allocate(300)
    random.Random(7).shuffle(order)
    random_pools(kv, 11)
    tables, at = [], 0
    for context in (1100, 1700, 4200, 600, 900):
        tables.append(tuple(order[at : at + pages_for(context)]))
        at += pages_for(context)
    segments = (
        Segment(0, 1, 1100, tables[0]),
        Segment(1, 5, 1700, tables[1]),
        Segment(6, 1, 4200, tables[2]),
        Segment(7, 40, 600, tables[3]),
        Segment(47, 260, 900, tables[4]),
    )
    layout = kv.layout(segments)
    q = mx.random.normal((1, heads, layout.tokens, 16), key=mx.random.key(5))
    sink = mx.random.normal((heads,), key=mx.random.key(6)) if sinks else None
    assert kernel_error(qmm, q, kv, layout, sink, window) < 1e-5


@pytest.mark.parametrize(
    "bits, group_size", [(8, 32), (8, 64), (4, 32), (6, 64), (3, 32)]
)
@pytest.mark.parametrize("window", [0, 45])
def test_quantized_pages_attend_as_their_gathered_dequantized_keys_do(
    qmm, isa, bits, group_size, window
):
    """Pages of MLX's affine codes (8 and 4 bits a byte apart, 6 and 3 across
    bytes) with float32 scales and biases per group: the kernel dequantizes a
    block at a time, as ``mx.dequantize`` does the gathered pages."""
    install_paged_ops()
    shape = LayerShape(2, 64, 64, mx.float32, bits=bits, group_size=group_size)
    kv = PagedKV([shape], arena_pages=4)
    kv.allocate(9)
    random_pools(kv, 12)
    layout = kv.layout(SEGMENTS)
    q = mx.random.normal((1, 6, layout.tokens, 64), key=mx.random.key(13))
    sink = mx.random.normal((6,), key=mx.random.key(14))
    assert kernel_error(qmm, q, kv, layout, sink, window) < 2e-5


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_pass_quantizes_what_it_writes_and_a_kept_state_leaves_as_mlx_lm_quantizes(
    dtype,
):
    """A quantized layer's pages hold ``mx.quantize``'s triple of what was written;
    a kept state copied out is the project's ``QuantizedKVCache`` with the same
    codes (scales in the model's dtype); another store takes it from the pages
    exactly, and a state in other groups is requantized from its values."""
    shape = LayerShape(2, 64, 64, dtype, bits=8, group_size=32)
    kv = PagedKV([shape], arena_pages=2)
    pages = kv.allocate(2)
    keys = mx.random.normal((1, 2, 45, 64), key=mx.random.key(21))
    values = mx.random.normal((1, 2, 45, 64), key=mx.random.key(22))
    layout = kv.layout([Segment(0, 45, 45, tuple(pages))])
    kv.write(0, layout.writes, keys, values)
    got_keys, got_values = kv.read(0, pages, 45)
    for got, x in ((got_keys, keys), (got_values, values)):
        for mine, theirs in zip(got, mx.quantize(x, group_size=32, bits=8)):
            assert mx.array_equal(mine, theirs)
    (prefix,) = kv.prefix(Table(pages), 45)
    cache = prefix.to_kv_cache()
    assert (cache.bits, cache.group_size, cache.offset) == (8, 32, 45)
    assert mx.array_equal(cache.keys[0], got_keys[0])
    assert cache.keys[1].dtype == dtype
    expected = kv.read_float(0, pages, 45)
    other = PagedKV([shape], arena_pages=2)
    for source in ([prefix], [cache]):
        loaded = other.take(source, 45).pages
        exact = source[0] is prefix or dtype == mx.float32
        for a, b in zip(other.read_float(0, loaded, 45), expected):
            assert mx.array_equal(a, b) or not exact
            assert mx.allclose(a, b, atol=0.05).item()
    # A state quantized in groups of 64 goes in dequantized, then in groups of 32.
    coarse = QuantizedKVCache(group_size=64, bits=8)
    coarse.update_and_fetch(keys, values)
    loaded = other.take([coarse], 45).pages
    for a, x in zip(other.read_float(0, loaded, 45), (keys, values)):
        assert mx.allclose(a, x, atol=0.05).item()
    # 64 one-byte codes, and two groups' float32 scale and bias, per token and head.
    assert kv.page_nbytes == PAGE_TOKENS * 2 * 2 * (64 + 2 * 2 * 4)


def test_an_mla_layer_holds_its_latent_once(qmm, isa):
    """MLA's pages keep each token's latent and rotary key side by side, and its
    values are the latent: the keys' first dims, read through the key arenas
    (``value_dims``), on the kernel as over gathered pages."""
    install_paged_ops()
    shape = LayerShape(1, 40, 32, mx.float32, latent=32)
    kv = PagedKV([shape], arena_pages=4)
    assert kv.page_nbytes == PAGE_TOKENS * 40 * 4
    assert kv.values[0] is kv.keys[0]
    kv.allocate(9)
    random_pools(kv, 15)
    keys, values = kv.read(0, list(range(3)), 70)
    assert mx.array_equal(values, keys[..., :32])
    layout = kv.layout(SEGMENTS)
    q = mx.random.normal((1, 4, layout.tokens, 40), key=mx.random.key(16))
    assert kernel_error(qmm, q, kv, layout, None) < 2e-5


def test_a_table_with_holes_attends_as_the_whole_table(qmm, isa):
    """Keys before every query's window are never read: a table whose pages
    there are holes (freed behind a sliding window) attends as the whole table
    does, on the kernel and over gathered pages."""
    install_paged_ops()
    shape = LayerShape(2, 16, 16, mx.float32, window=40)
    kv = PagedKV([shape], arena_pages=4)
    # Page 0, where a hole points, is NaN: a read of it would show.
    hole, *pages = kv.allocate(7)
    assert hole == 0
    rng = np.random.default_rng(3)
    for arenas in kv.planes[0]:
        for i, a in enumerate(arenas):
            x = rng.normal(size=a.shape).astype(np.float32)
            if i == 0:
                x[:PAGE_TOKENS] = np.nan
            arenas[i] = mx.array(x)
    # Queries 150-169 see keys from 111: pages 0-2 are never read.
    q = mx.array(rng.normal(size=(1, 4, 20, 16)), mx.float32)
    whole, holed = (
        kv.layout([Segment(0, 20, 170, table)])
        for table in (tuple(pages), (HOLE, HOLE, HOLE, *pages[3:]))
    )
    expected = gathered_attention(q, PagedKeys(kv, 0, whole), 0.25, window=40)
    got = gathered_attention(q, PagedKeys(kv, 0, holed), 0.25, window=40)
    assert not mx.isnan(expected).any().item()
    assert mx.array_equal(got, expected)
    assert kernel_error(qmm, q, kv, holed, None, window=40) < 1e-5


def test_the_kernel_refuses_a_segment_beyond_its_table(qmm):
    kv = PagedKV([SHAPE], arena_pages=2)
    layout = kv.layout([Segment(0, 1, 40, (0, 1))])
    q = mx.zeros((1, 2, 1, 16))
    for segments, tables in (
        (mx.array([[0, 1, 70]], mx.int32), layout.tables),
        (layout.segment_array, mx.array([[0, 2]], mx.int32)),
    ):
        with pytest.raises(RuntimeError, match="out of range"):
            mx.eval(
                qmm.paged_attention(
                    q,
                    kv.keys[0],
                    kv.values[0],
                    segments,
                    tables,
                    scale=1.0,
                    arena_pages=kv.arena_pages,
                )
            )


def test_the_kernel_rotates_each_token_at_its_own_position(qmm, isa):
    """A batch of one with a position per token (a paged pass's queries and keys)
    as MLX rotates each token alone at its position."""
    x = mx.random.normal((1, 4, 5, 64), key=mx.random.key(3))
    positions = mx.array([39, 32, 33, 34, 0], mx.int32)
    got = qmm.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=positions)
    expected = mx.concatenate(
        [
            fast_ops._MLX["rope"](
                x[:, :, t : t + 1],
                64,
                traditional=False,
                base=10000.0,
                scale=1.0,
                offset=int(p),
            )
            for t, p in enumerate(positions.tolist())
        ],
        axis=2,
    )
    assert mx.max(mx.abs(got - expected)).item() < 1e-5


class _Over:
    """A cache type calls are routed over."""


def test_calls_are_routed_only_over_their_cache_and_only_as_x_mask_cache():
    """A routed class's call over the cache type runs the route, given its
    arguments positionally or by name; over any other cache it runs as it was;
    a class whose call takes other arguments (Mamba 1's ``(x, cache)``,
    Mistral 4's ``(x, attn_scale, mask, cache)``) is left alone."""

    class Mixer:
        def __call__(self, x, mask=None, cache=None):
            return ("own", x, mask, cache)

    class Mamba1:
        def __call__(self, x, cache):
            return ("own", x, cache)

    class Scaled:
        def __call__(self, x, attn_scale, mask=None, cache=None):
            return ("own", x, attn_scale, mask, cache)

    route_calls(
        [Mixer, Mamba1, Scaled],
        _Over,
        lambda module, call, x, mask, cache: ("routed", x, mask, cache),
    )
    over = _Over()
    assert Mixer()(1, 2, over) == ("routed", 1, 2, over)
    assert Mixer()(x=1, cache=over) == ("routed", 1, None, over)
    assert Mixer()(1, mask=2, cache=over) == ("routed", 1, 2, over)
    assert Mixer()(1, 2, "other") == ("own", 1, 2, "other")
    assert Mixer()(1) == ("own", 1, None, None)
    assert Mamba1()(1, over) == ("own", 1, over)
    assert Scaled()(1, 0.5, 2, over) == ("own", 1, 0.5, 2, over)
    # Routing twice routes once.
    call = Mixer.__call__
    route_calls([Mixer], _Over, lambda *args: "again")
    assert Mixer.__call__ is call
