"""Unit tests for the prompt cache, with a fake KV layer and with mlx-lm's own."""

import random
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    KVCache,
    PromptTrie,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from mlx_backend.caches.kinds import copy_prefix
from mlx_cache import LinearPromptTrie, ThreadSafeLRUPromptCache, cache_nbytes

pytestmark = pytest.mark.unit


class FakeLayer:
    """One layer's KV cache: remembers the tokens it holds, 10 bytes a token."""

    def __init__(self, tokens, trimmable=True):
        self.tokens = list(tokens)
        self.trimmable = trimmable

    @property
    def nbytes(self):
        return 10 * len(self.tokens)

    def trim(self, n):
        del self.tokens[len(self.tokens) - n :]


def fake(tokens, layers=2, trimmable=True):
    return [FakeLayer(tokens, trimmable) for _ in range(layers)]


def can_trim(cache):
    return all(layer.trimmable for layer in cache)


def trim(cache, n):
    for layer in cache:
        layer.trim(n)


def make_cache(**kwargs):
    return ThreadSafeLRUPromptCache(can_trim_fn=can_trim, trim_fn=trim, **kwargs)


def test_miss_returns_the_tokens():
    cache = make_cache()
    assert cache.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])
    cache.insert_cache("m", [1, 2, 3], fake([1, 2, 3]))
    assert cache.fetch_nearest_cache("m", [7, 8]) == (None, [7, 8])


def test_exact_hit_extracts_the_entry():
    cache = make_cache()
    entry = fake([1, 2, 3])
    cache.insert_cache("m", [1, 2, 3], entry)
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 3])
    assert found is entry and rest == []
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])


def test_shorter_prefix_returns_the_longest_one_and_the_suffix():
    cache = make_cache()
    short, longer = fake([1, 2], trimmable=False), fake([1, 2, 3], trimmable=False)
    cache.insert_cache("m", [1, 2], short)
    cache.insert_cache("m", [1, 2, 3], longer)
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 3, 4, 5])
    assert found[0].tokens == [1, 2, 3] and rest == [4, 5]
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 9])
    assert found[0].tokens == [1, 2] and rest == [9]
    # Entries that can't be trimmed are copies: no longer entry can give them back.
    assert found is not short and len(cache) == 2


def test_a_prompt_repeat_of_an_untrimmable_entry_takes_the_boundary_before_it():
    cache = make_cache()
    cache.insert_cache("m", [1, 2, 3], fake([1, 2, 3], trimmable=False))
    cache.insert_cache("m", [1, 2, 3, 4, 5], fake([1, 2, 3, 4, 5], trimmable=False))
    found, rest = cache.fetch_for_prompt("m", [1, 2, 3, 4, 5])
    assert found[0].tokens == [1, 2, 3] and rest == [4, 5]
    found, rest = cache.fetch_for_prompt("m", [1, 2, 3, 4])
    assert found[0].tokens == [1, 2, 3] and rest == [4]
    assert len(cache) == 2


def test_single_token_prefix_is_not_a_match():
    cache = make_cache()
    cache.insert_cache("m", [1], fake([1]))
    assert cache.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])
    assert len(cache) == 1


def test_longer_entry_is_copied_and_trimmed_and_stays():
    cache = make_cache()
    entry = fake([1, 2, 3, 4, 5])
    cache.insert_cache("m", [1, 2, 3, 4, 5], entry)
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 3, 9])
    assert [layer.tokens for layer in found] == [[1, 2, 3], [1, 2, 3]]
    assert rest == [9]
    assert found is not entry and entry[0].tokens == [1, 2, 3, 4, 5]
    assert len(cache) == 1
    # A prompt that the entry covers whole leaves nothing to process.
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 3, 4])
    assert found[0].tokens == [1, 2, 3, 4] and rest == []


def test_longer_entry_is_not_used_when_it_cannot_be_trimmed():
    cache = make_cache()
    cache.insert_cache("m", [1, 2, 3, 4], fake([1, 2, 3, 4], trimmable=False))
    assert cache.fetch_nearest_cache("m", [1, 2, 3, 9]) == (None, [1, 2, 3, 9])
    # Nor without trim functions at all.
    plain = ThreadSafeLRUPromptCache()
    plain.insert_cache("m", [1, 2, 3, 4], fake([1, 2, 3, 4]))
    assert plain.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])


def test_a_trimmable_entry_replaces_its_prefixes():
    cache = make_cache()
    cache.insert_cache("m", [1, 2], fake([1, 2]))
    cache.insert_cache("m", [1, 2, 3, 4], fake([1, 2, 3, 4]))
    assert len(cache) == 1 and cache.nbytes == 80
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 7])
    assert found[0].tokens == [1, 2] and rest == [7]


def test_model_keys_are_namespaces():
    cache = make_cache()
    cache.insert_cache("a", [1, 2, 3], fake([1, 2, 3]))
    assert cache.fetch_nearest_cache("b", [1, 2, 3]) == (None, [1, 2, 3])
    cache.insert_cache("b", [1, 2, 3], fake([1, 2, 3]))
    assert len(cache) == 2
    found, _ = cache.fetch_nearest_cache("a", [1, 2, 3])
    assert found is not None and len(cache) == 1


def test_reference_counts_and_deep_copies():
    cache = make_cache()
    first, second = fake([1, 2, 3]), fake([1, 2, 3])
    cache.insert_cache("m", [1, 2, 3], first)
    cache.insert_cache("m", [1, 2, 3], second)
    assert len(cache) == 1 and cache.nbytes == 60
    copied, rest = cache.fetch_nearest_cache("m", [1, 2, 3])
    assert rest == [] and copied is not first and copied[0] is not first[0]
    copied[0].tokens.append(99)
    assert first[0].tokens == [1, 2, 3]
    assert len(cache) == 1
    last, _ = cache.fetch_nearest_cache("m", [1, 2, 3])
    assert last is first
    assert len(cache) == 0


def test_lru_eviction_by_count():
    cache = make_cache(max_size=2)
    cache.insert_cache("m", [1, 1], fake([1, 1]))
    cache.insert_cache("m", [2, 2], fake([2, 2]))
    # Touch [1, 1] (a shared entry stays in place when fetched).
    cache.insert_cache("m", [1, 1], fake([1, 1]))
    cache.fetch_nearest_cache("m", [1, 1])
    cache.insert_cache("m", [3, 3], fake([3, 3]))
    assert len(cache) == 2
    assert cache.fetch_nearest_cache("m", [2, 2]) == (None, [2, 2])
    assert cache.fetch_nearest_cache("m", [1, 1])[0] is not None
    assert cache.fetch_nearest_cache("m", [3, 3])[0] is not None


def test_lru_eviction_by_bytes():
    cache = make_cache(max_bytes=100)  # 2 layers x 10 bytes x tokens
    cache.insert_cache("m", [1, 1], fake([1, 1]))  # 40 bytes
    cache.insert_cache("m", [2, 2], fake([2, 2]))  # 80
    cache.insert_cache("m", [3, 3, 3], fake([3, 3, 3]))  # 140: [1, 1] goes
    assert cache.nbytes == 100 and len(cache) == 2
    assert cache.fetch_nearest_cache("m", [1, 1]) == (None, [1, 1])


def test_one_huge_entry_never_exceeds_the_byte_limit():
    cache = make_cache(max_bytes=100)
    cache.insert_cache("m", [1, 1], fake([1, 1]))
    cache.insert_cache("m", list(range(10)), fake(range(10)))  # 200 bytes
    assert cache.nbytes == 40 and len(cache) == 1
    assert cache.fetch_nearest_cache("m", [1, 1])[0] is not None


def test_evict_to_drops_the_least_recently_used_first():
    cache = make_cache()
    cache.insert_cache("m", [1, 1], fake([1, 1]))  # 40 bytes
    cache.insert_cache("m", [2, 2], fake([2, 2]))  # 40
    cache.insert_cache("m", [3, 3, 3], fake([3, 3, 3]))  # 60
    cache.insert_cache("m", [1, 1], fake([1, 1]))  # touched: [2, 2] is oldest
    assert cache.evict_to(100) == 40
    assert cache.nbytes == 100 and len(cache) == 2
    assert cache.fetch_nearest_cache("m", [2, 2]) == (None, [2, 2])
    assert cache.evict_to(100) == 0
    assert cache.evict_to(0) == 100 and len(cache) == 0


def test_zero_entries_disables_the_cache():
    cache = make_cache(max_size=0)
    cache.insert_cache("m", [1, 2], fake([1, 2]))
    assert len(cache) == 0 and cache.nbytes == 0


def test_clear():
    cache = make_cache()
    cache.insert_cache("m", [1, 2], fake([1, 2]))
    cache.insert_cache("n", [1, 2], fake([1, 2]))
    cache.clear()
    assert len(cache) == cache.len() == 0 and cache.nbytes == 0
    assert cache.fetch_nearest_cache("m", [1, 2]) == (None, [1, 2])


def test_opaque_entries_are_kept_as_they_are():
    # LocalAI's backends and tests keep any objects as caches: they count 0 bytes.
    cache = ThreadSafeLRUPromptCache(max_size=2)
    entry = ["layer-0", {"layer": 1}, object()]
    cache.insert_cache("m", [1, 2, 3], entry)
    assert len(cache) == 1 and cache.nbytes == 0 and cache_nbytes(entry) == 0
    assert cache.fetch_nearest_cache("m", [1, 2, 3, 4]) == (entry, [4])
    cache.insert_cache("m", [1, 2], ["a"])
    cache.insert_cache("m", [5, 6], ["b"])
    cache.insert_cache("m", [7, 8], ["c"])
    assert len(cache) == 2
    assert cache.fetch_nearest_cache("m", [1, 2]) == (None, [1, 2])
    assert cache.fetch_nearest_cache("m", [7, 8]) == (["c"], [])


def test_with_mlx_lm_kv_caches():
    def kv(n, offset=0):
        layer = KVCache()
        keys = mx.arange(offset, offset + n, dtype=mx.float32).reshape(1, 1, n, 1)
        layer.update_and_fetch(keys, keys)
        return layer

    cache = ThreadSafeLRUPromptCache(
        can_trim_fn=can_trim_prompt_cache, trim_fn=trim_prompt_cache
    )
    entry = [kv(5), kv(5)]
    cache.insert_cache("m", [1, 2, 3, 4, 5], entry)
    assert cache.nbytes == cache_nbytes(entry) > 0
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 3, 7])
    assert rest == [7] and [layer.offset for layer in found] == [3, 3]
    keys, _ = found[0].update_and_fetch(
        mx.full((1, 1, 1, 1), 70.0), mx.full((1, 1, 1, 1), 70.0)
    )
    assert keys.flatten().tolist() == [0, 1, 2, 70]
    # The entry in the cache is untouched by the copy's update.
    assert entry[0].offset == 5
    assert entry[0].state[0].flatten().tolist()[:5] == [0, 1, 2, 3, 4]


def test_a_long_entry_serves_a_short_prefix_with_a_copy_of_the_prefix_only():
    entry = []
    for layer in range(2):
        kv = KVCache()
        keys = mx.arange(layer, layer + 300, dtype=mx.float32).reshape(1, 1, 300, 1)
        kv.update_and_fetch(keys, keys * 2)
        entry.append(kv)
    cache = ThreadSafeLRUPromptCache(
        can_trim_fn=can_trim_prompt_cache,
        trim_fn=trim_prompt_cache,
        copy_prefix_fn=copy_prefix,
    )
    cache.insert_cache("m", list(range(300)), entry)
    found, rest = cache.fetch_nearest_cache("m", [0, 1, 2, 99])
    assert rest == [99] and [layer.offset for layer in found] == [3, 3]
    # Three tokens' keys and values, not the entry's 300 (and its spare room).
    assert cache_nbytes(found) == 2 * 2 * 3 * 4
    assert found[1].state[0].flatten().tolist() == [1, 2, 3]
    assert found[1].state[1].flatten().tolist() == [2, 4, 6]
    keys, _ = found[0].update_and_fetch(
        mx.full((1, 1, 1, 1), 70.0), mx.full((1, 1, 1, 1), 7.0)
    )
    assert keys.flatten().tolist() == [0, 1, 2, 70]
    assert entry[0].offset == 300
    assert entry[0].state[0].flatten().tolist()[:4] == [0, 1, 2, 3]


def test_threads_fetch_and_insert_without_losing_data():
    cache = make_cache(max_size=16, max_bytes=4000)
    errors: list[str] = []
    over: list[tuple[int, int]] = []
    done = threading.Event()

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(400):
            tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
            found, rest = cache.fetch_nearest_cache(seed % 3, tokens)
            if found is not None:
                used = len(tokens) - len(rest)
                for layer in found:
                    # Every layer holds exactly the prefix it was returned for.
                    if layer.tokens != tokens[:used]:
                        errors.append(f"{layer.tokens} for {tokens} with {rest}")
            cache.insert_cache(seed % 3, tokens, fake(tokens))

    def monitor():
        while not done.is_set():
            size, nbytes = len(cache), cache.nbytes
            if size > 16 or nbytes > 4000 or nbytes < 0:
                over.append((size, nbytes))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    watcher = threading.Thread(target=monitor)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert errors == [] and over == []
    # Draining every entry by exact hits brings the byte counter back to zero.
    while len(cache):
        model_key, tokens = next(iter(cache._lru))
        found, rest = cache.fetch_nearest_cache(model_key, list(tokens))
        assert rest == [] and found[0].tokens == list(tokens)
    assert cache.nbytes == 0


@pytest.mark.parametrize("bad", [-1, 0])
def test_bounds_are_kept_with_any_limits(bad):
    cache = make_cache(max_size=3, max_bytes=max(bad, 0))
    cache.insert_cache("m", [1, 2], fake([1, 2]))
    assert len(cache) == 0 and cache.nbytes == 0


def test_an_entry_with_holders_serves_that_many_fetches():
    cache = make_cache()
    entry = fake([1, 2, 3])
    cache.insert_cache("m", [1, 2, 3], entry, holders=3)
    copies = [cache.fetch_nearest_cache("m", [1, 2, 3, 9 + i]) for i in range(3)]
    assert [rest for _, rest in copies] == [[9], [10], [11]]
    # The first two are copies; the last holder takes the entry itself.
    assert copies[0][0] is not entry and copies[0][0][0].tokens == [1, 2, 3]
    assert copies[2][0] is entry and len(cache) == 0
    assert cache.fetch_nearest_cache("m", [1, 2, 3, 4]) == (None, [1, 2, 3, 4])


def test_cached_length_peeks_without_taking():
    cache = make_cache()
    assert cache.cached_length("m", [1, 2, 3]) == 0
    cache.insert_cache("m", [1, 2, 3, 4], fake([1, 2, 3, 4]))
    assert cache.cached_length("m", [1, 2, 3, 4]) == 4  # exact
    assert cache.cached_length("m", [1, 2, 3, 4, 5]) == 4  # shorter entry
    assert cache.cached_length("m", [1, 2, 7]) == 2  # a longer entry, trimmed
    assert cache.cached_length("m", [1, 9]) == 0  # one token is no match
    assert cache.cached_length("other", [1, 2, 3, 4]) == 0
    assert len(cache) == 1
    found, rest = cache.fetch_nearest_cache("m", [1, 2, 7])
    assert found[0].tokens == [1, 2] and rest == [7]
    untrimmable = make_cache()
    untrimmable.insert_cache("m", [1, 2, 3, 4], fake([1, 2, 3, 4], trimmable=False))
    assert untrimmable.cached_length("m", [1, 2, 7]) == 0


def test_a_prompt_fetch_leaves_one_token_to_run():
    cache = make_cache()
    entry = fake([1, 2, 3])
    cache.insert_cache("m", [1, 2, 3], entry)
    found, rest = cache.fetch_for_prompt("m", [1, 2, 3])
    assert found is entry and rest == [3]
    assert entry[0].tokens == [1, 2]
    # An exact hit that can't be trimmed, with no boundary before it, is a miss
    # (and stays).
    cache.insert_cache("m", [4, 5, 6], fake([4, 5, 6], trimmable=False))
    assert cache.fetch_for_prompt("m", [4, 5, 6]) == (None, [4, 5, 6])
    assert len(cache) == 1


def test_entries_count_the_bytes_size_fn_says():
    # Rank sizes of a pipeline: 1 layer here stands for 4.
    cache = make_cache(max_bytes=200, size_fn=lambda c: 4 * sum(l.nbytes for l in c))
    cache.insert_cache("m", [1, 2, 3], fake([1, 2, 3], layers=1))
    assert cache.nbytes == 120
    cache.insert_cache("m", [7, 8, 9], fake([7, 8, 9], layers=1))
    assert len(cache) == 1 and cache.nbytes == 120


def test_the_linear_trie_finds_what_mlx_lm_s_trie_finds():
    rng = random.Random(7)
    for _ in range(200):
        ours, theirs = LinearPromptTrie(), PromptTrie()
        entries = [
            [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            for _ in range(rng.randrange(1, 6))
        ]
        for tokens in entries:
            ours.add("m", tokens, tuple(tokens))
            theirs.add("m", tokens, tuple(tokens))
        for _ in range(10):
            prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
            found, expected = ours.search("m", prompt), theirs.search("m", prompt)
            assert (found.exact, found.shorter) == (expected.exact, expected.shorter)
            assert found.common_prefix == expected.common_prefix
            # Of equally short longer entries, either serves.
            assert (found.longer is None) == (expected.longer is None)
            if found.longer is not None:
                assert len(found.longer) == len(expected.longer)
                assert (
                    found.longer[: found.common_prefix] == prompt[: found.common_prefix]
                )
                assert tuple(found.longer) in map(tuple, entries)
        assert ours.search("other", [1]) == theirs.search("other", [1])
