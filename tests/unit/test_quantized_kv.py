"""Quantized KV caches in the batch, without a model: the cache operations
against mlx-lm's unquantized batch cache, staged caches that quantize once they
hold enough tokens, and LocalAI's cache types mapped to MLX quantization."""

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_backend.caches.quantized_kv import (
    BatchQuantizedKVCache,
    BatchStagedKVCache,
    QuantizedKVCache,
    StagedKVCache,
)
from mlx_backend.errors import InvalidArgument
from python_utils import apply_cache_types, parse_options

HEADS = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    bits: int = 8
    dim: int = 64
    group_size: int = 32

    def kv(self, rows: int, length: int, seed: int) -> tuple[mx.array, mx.array]:
        mx.random.seed(seed)
        shape = (rows, HEADS, length, self.dim)
        return mx.random.normal(shape), mx.random.normal(shape) * 3

    def dequantized(self, part) -> mx.array:
        return mx.dequantize(*part, group_size=self.group_size, bits=self.bits)

    def round_trip(self, x: mx.array) -> mx.array:
        return self.dequantized(
            mx.quantize(x, group_size=self.group_size, bits=self.bits)
        )

    def check_same(self, plain: BatchKVCache, quantized: BatchQuantizedKVCache):
        """The quantized batch holds what quantizing the plain batch gives, with
        the same bookkeeping (so the same masks)."""
        assert quantized._idx == plain._idx
        assert quantized.offset.tolist() == plain.offset.tolist()
        assert quantized.left_padding.tolist() == plain.left_padding.tolist()
        for ours, theirs in zip(quantized.keys_and_values(), plain.keys_and_values()):
            assert mx.array_equal(self.dequantized(ours), self.round_trip(theirs))
        assert mx.array_equal(quantized.make_mask(3), plain.make_mask(3))

    def singles(self, lengths: list[int], seed: int) -> tuple[list, list]:
        plain, quantized = [], []
        for i, n in enumerate(lengths):
            p = KVCache()
            q = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
            if n:
                keys, values = self.kv(1, n, seed + i)
                p.update_and_fetch(keys, values)
                q.update_and_fetch(keys, values)
            plain.append(p)
            quantized.append(q)
        return plain, quantized


# 5 bits at 128 dims: mlx-lm's own single cache sizes its buffers wrongly there.
@pytest.mark.parametrize("layout", [Layout(), Layout(bits=5, dim=128)])
def test_batch_operations_match_the_unquantized_batch(layout: Layout):
    plain_singles, quantized_singles = layout.singles([5, 0, 9], seed=1)
    plain = KVCache.merge(plain_singles)
    quantized = QuantizedKVCache.merge(quantized_singles)
    assert isinstance(quantized, BatchQuantizedKVCache)
    layout.check_same(plain, quantized)

    # A decode step, then a right-padded prefill that finalize rolls left.
    for cache in (plain, quantized):
        cache.update_and_fetch(*layout.kv(3, 1, seed=7))
        cache.prepare(lengths=[3, 1, 2], right_padding=[0, 2, 1])
        cache.update_and_fetch(*layout.kv(3, 3, seed=8))
        cache.finalize()
    layout.check_same(plain, quantized)

    for cache in (plain, quantized):
        cache.filter([0, 2])
    layout.check_same(plain, quantized)

    more_plain, more_quantized = layout.singles([300, 2], seed=11)
    plain.extend(KVCache.merge(more_plain))
    quantized.extend(QuantizedKVCache.merge(more_quantized))
    layout.check_same(plain, quantized)

    # Trimmed, then one sequence taken out on its own, which grows again.
    assert quantized.trim(2) == plain.trim(2) == 2
    one, theirs = quantized.extract(2), plain.extract(2)
    assert isinstance(one, QuantizedKVCache) and one.offset == theirs.offset == 298
    assert one.nbytes == sum(x.nbytes for part in (one.keys, one.values) for x in part)
    for cache in (one, theirs):
        cache.update_and_fetch(*layout.kv(1, 2, seed=12))
    for ours, reference in zip(one.keys_and_values(), theirs.keys_and_values()):
        assert mx.array_equal(layout.dequantized(ours), layout.round_trip(reference))


def test_an_empty_batch_extends_and_merges():
    empty = QuantizedKVCache.merge([QuantizedKVCache(32, 8), QuantizedKVCache(32, 8)])
    assert empty.keys is None and empty.nbytes == 0
    _, filled = Layout().singles([4], seed=3)
    empty.extend(QuantizedKVCache.merge(filled))
    assert empty.left_padding.tolist() == [4, 4, 0]
    assert empty.extract(2).offset == 4


def test_cache_types_map_to_mlx_quantization():
    base = parse_options([])
    assert apply_cache_types(base, "q8_0", "q8_0").kv_bits == 8
    q4 = apply_cache_types(base, "Q4_0", "")
    assert (q4.kv_bits, q4.kv_group_size) == (4, 32)
    # Keys and values share one cache: the finer type serves both.
    assert apply_cache_types(base, "q4_0", "q8_0").kv_bits == 8
    assert apply_cache_types(base, "q8_0", "f16").kv_bits is None
    assert apply_cache_types(base, "f16", "").kv_bits is None
    # Float types are for the paged decoder's pages (bfloat16 pages don't exist).
    assert apply_cache_types(base, "f16", "f16").cache_float == "float16"
    assert apply_cache_types(base, "f32", "").cache_float == "float32"
    assert apply_cache_types(base, "bf16", "").cache_float is None
    assert apply_cache_types(base, "q8_0", "q8_0").cache_float is None
    # The option sets it directly, and wins.
    direct = parse_options(["kv_bits:4", "kv_group_size:64"])
    assert apply_cache_types(direct, "q8_0", "q8_0") == direct
    with pytest.raises(InvalidArgument, match="CacheTypeValue: unknown cache type"):
        apply_cache_types(base, "q8_0", "q3_k")
    with pytest.raises(InvalidArgument, match="kv_bits must be one of"):
        parse_options(["kv_bits:7"])
    with pytest.raises(InvalidArgument, match="max_kv_size can't be combined"):
        apply_cache_types(parse_options(["max_kv_size:512"]), "q8_0", "")


def test_staged_caches_quantize_once_they_hold_start_tokens():
    layout = Layout()
    singles = [StagedKVCache(start=8, group=32, kv_bits=8) for _ in range(2)]
    singles[0].update_and_fetch(*layout.kv(1, 3, seed=1))
    batch = StagedKVCache.merge(singles)
    assert isinstance(batch, BatchStagedKVCache) and not hasattr(batch, "bits")
    batch.update_and_fetch(*layout.kv(2, 5, seed=2))
    assert not hasattr(batch, "bits")  # 8 positions now, reached during that step
    taken = batch.extract(0)
    assert isinstance(taken, StagedKVCache) and taken.offset == 8
    batch.update_and_fetch(*layout.kv(2, 1, seed=3))
    assert isinstance(batch, BatchQuantizedKVCache) and batch.bits == 8
    assert isinstance(batch.extract(1), QuantizedKVCache)
    # A quantized batch takes in a staged one, and a staged single joins quantized.
    _, quantized = layout.singles([4], seed=4)
    batch.extend(StagedKVCache.merge([StagedKVCache(8, 32, 8)]))
    mixed = StagedKVCache.merge([taken, *quantized])
    assert isinstance(mixed, BatchQuantizedKVCache)
    assert mixed.left_padding.tolist() == [0, 4] and len(batch.offset.tolist()) == 3
