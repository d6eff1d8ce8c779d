"""Pages in groups (``mlx_backend/caches/page_tables.py``): a sliding window's
pages behind it are freed while the full layers keep theirs; a kept state with
freed pages trims no deeper than its floor, in the prompt cache too, and leaves
as mlx-lm's ring past its window; a ring that went round loads its last tokens
at their places; attention over a table with holes is attention over the
whole (``tests/unit/test_paged_kv.py``)."""

import copy
import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache

from mlx_backend.caches.page_tables import WINDOW_SLACK, PagedStore
from mlx_backend.caches.paged import (
    HOLE,
    PAGE_TOKENS,
    LayerShape,
    MissingKeys,
    Segment,
    pages_for,
    trim_floor,
)
from mlx_backend.caches.prompt_files import _fit
from mlx_cache import ThreadSafeLRUPromptCache

WINDOW = 40
FULL = LayerShape(kv_heads=2, key_dims=16, value_dims=16, dtype=mx.float32)
SLIDING = LayerShape(2, 16, 16, mx.float32, window=WINDOW)


def filled(store: PagedStore, tables, tokens: int, chunk: int, seed: int = 0):
    """``tokens`` tokens through ``tables`` in chunks, random keys and values
    (each layer's, as a whole, for checks)."""
    rng = np.random.default_rng(seed)
    written = {}
    for first in range(0, tokens, chunk):
        context = min(first + chunk, tokens)
        pages = store.extend(tables, context, first)
        layouts = store.layout([Segment(0, context - first, context, pages)])
        for layer in range(len(store.shapes)):
            keys, values = (
                mx.array(rng.normal(size=(1, 2, context - first, 16)), mx.float32)
                for _ in range(2)
            )
            view = store.layer(layer, layouts)
            view.update_and_fetch(keys, values)
            old = written.get(layer)
            written[layer] = (
                (keys, values)
                if old is None
                else tuple(
                    mx.concatenate([a, b], axis=2) for a, b in zip(old, (keys, values))
                )
            )
    return written


def test_a_window_frees_the_pages_behind_it_and_the_full_layers_keep_theirs():
    store = PagedStore([SLIDING, FULL, SLIDING], arena_pages=2)
    assert store.windows == (0, WINDOW) and store.places == [(1, 0), (0, 0), (1, 1)]
    tables = store.tables()
    filled(store, tables, 300, 25)
    full, window = tables
    assert HOLE not in full.pages and len(full.pages) == pages_for(300)
    # The last pass started at 275: it saw keys from 236, and the slack before.
    freed = (275 - WINDOW - WINDOW_SLACK) // PAGE_TOKENS
    assert window.pages[:freed] == [HOLE] * freed
    assert HOLE not in window.pages[freed:]
    assert window.start == freed * PAGE_TOKENS
    assert store.groups[1].pages_held == len(window.pages) - freed
    assert store.held_nbytes([tables]) == store.nbytes()
    store.release(tables)
    assert store.pages_held == 0


def test_a_kept_window_state_trims_no_deeper_than_its_floor():
    store = PagedStore([SLIDING, FULL], arena_pages=2)
    tables = store.tables()
    written = filled(store, tables, 200, 30, seed=1)
    kept = store.prefix(tables, 200)
    store.release(tables)
    sliding, full = kept
    start = tables[1].start
    assert start > 0 and sliding.floor == start + WINDOW and full.floor == 0
    assert trim_floor(kept) == sliding.floor
    # Left as mlx-lm's ring, full and in order: its last WINDOW tokens.
    ring = sliding.to_kv_cache()
    assert isinstance(ring, RotatingKVCache)
    assert (ring.offset, ring.max_size, ring.keys.shape[2]) == (200, WINDOW, WINDOW)
    assert mx.array_equal(ring.keys, written[0][0][..., -WINDOW:, :])
    assert mx.array_equal(full.to_kv_cache().keys, written[1][0])
    # Another store takes the ring: its last tokens at their places.
    other = PagedStore([SLIDING, FULL], arena_pages=2)
    taken = other.take([ring, full.to_kv_cache()], 200)
    assert taken[1].start == 200 - WINDOW
    assert taken[1].pages[: (200 - WINDOW) // PAGE_TOKENS] == [HOLE] * 5
    keys, _ = other.groups[1].read(0, taken[1].pages, 200, 200 - WINDOW)
    assert mx.array_equal(keys, ring.keys)
    # A length its ring holds too few keys for is refused, no page kept.
    with pytest.raises(MissingKeys, match="start at token 160 of 150"):
        other.take([ring, full.to_kv_cache()], 150)
    other.release(taken)
    assert other.pages_held == 0
    # A prompt file at fewer tokens than the floor is not written.
    assert _fit(kept, range(sliding.floor - 1)) is None
    layers, _ = _fit(kept, range(sliding.floor))
    assert [layer.offset for layer in layers] == [sliding.floor] * 2
    del layers
    # A trim stops at the floor.
    trimmed = copy.deepcopy(kept)
    assert trimmed[0].trim(1000) == 200 - sliding.floor
    assert not trimmed[0].is_trimmable() and not can_trim_prompt_cache(trimmed)
    del kept, sliding, full, trimmed
    gc.collect()
    assert store.pages_held == 0


def test_the_prompt_cache_trims_an_entry_to_its_floor_and_no_deeper():
    """An exact prompt sent again gives back its last token; a prompt that
    parts from the entry before its floor is not served from it."""

    class Floored(KVCache):
        floor = 0

    def entry(n: int, floor: int) -> list:
        layer = Floored()
        layer.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        layer.floor = floor
        return [layer]

    cache = ThreadSafeLRUPromptCache(
        can_trim_fn=can_trim_prompt_cache,
        trim_fn=lambda c, n: [layer.trim(n) for layer in c],
        floor_fn=lambda c: c[0].floor,
    )
    tokens = list(range(100))
    cache.insert_cache("m", tokens, entry(100, 60))
    cache.insert_cache("m", tokens[:30], entry(30, 0))
    # Its prefixes stay: it can't serve them.
    assert len(cache) == 2
    assert cache.cached_length("m", [*tokens[:70], 7]) == 70
    assert cache.cached_length("m", [*tokens[:50], 7]) == 30
    got, rest = cache.fetch_for_prompt("m", tokens)
    assert rest == [99] and got[0].offset == 99
    got, rest = cache.fetch_for_prompt("m", [*tokens[:50], 7])
    assert got[0].offset == 30 and rest == [*tokens[30:50], 7]
