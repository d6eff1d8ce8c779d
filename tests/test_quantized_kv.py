"""Quantized KV caches in the batch: the cache operations against mlx-lm's
unquantized batch cache, and quantized decoding on the embedded model."""

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_backend.caches.quantized_kv import (
    BatchQuantizedKVCache,
    BatchStagedKVCache,
    QuantizedKVCache,
    StagedKVCache,
)
from mlx_backend.decoders.base import BatchDecoder, SingleDecoder
from mlx_backend.errors import InvalidArgument
from mlx_utils import make_kv_cache
from python_utils import apply_cache_types, parse_options
from tests.support import (
    ANSWER,
    chat_prompt,
    generation,
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
)
from tests.test_engine import QUESTIONS, drive

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
    # The option sets it directly, and wins.
    direct = parse_options(["kv_bits:4", "kv_group_size:64"])
    assert apply_cache_types(direct, "q8_0", "q8_0") == direct
    with pytest.raises(InvalidArgument, match="CacheTypeValue: unknown cache type"):
        apply_cache_types(base, "q8_0", "q3_k")
    with pytest.raises(InvalidArgument, match="kv_bits must be one of"):
        parse_options(["kv_bits:7"])
    with pytest.raises(InvalidArgument, match="max_kv_size can't be combined"):
        apply_cache_types(parse_options(["max_kv_size:512"]), "q8_0", "")


@pytest.fixture(scope="module")
def engine():
    engine = load_engine()
    yield engine
    engine.shutdown()


def quantized(options, bits: int | None):
    return dataclasses.replace(options, kv_bits=bits, kv_group_size=32)


def assert_greedy_close(ours: tuple, theirs: tuple, noise: float) -> None:
    """Two greedy decodes of one prompt (``drive``'s tokens and top-2 logprob
    entries) agree token for token, the logprobs they share within ``noise``, up
    to a near tie: both then had the same two best tokens, within 2 * ``noise``.
    A masking or padding mistake moves logprobs by whole units."""
    (our_tokens, our_scores, _), (their_tokens, their_scores, _) = ours, theirs
    assert len(our_tokens) == len(their_tokens)
    for mine, theirs_, (_, my_top), (_, their_top) in zip(
        our_tokens, their_tokens, our_scores, their_scores
    ):
        my_top, their_top = dict(my_top), dict(their_top)
        assert {mine, theirs_} <= my_top.keys() & their_top.keys()
        for token in my_top.keys() & their_top.keys():
            assert my_top[token] == pytest.approx(their_top[token], abs=noise)
        if mine != theirs_:
            assert my_top.keys() == their_top.keys()
            return


# Batching changes the BLAS's matrix shapes, so its rounding; a quantized KV cache
# amplifies that to up to 0.25 in a logprob on a 2-core Xeon (0.003 unquantized).
BATCHING_NOISE = 0.4
# Measured up to 0.40 between the two caches on the test prompts.
Q8_NOISE = 0.6


def test_batched_and_single_quantized_decoding_agree(engine):
    def both(model, options):
        options = quantized(options, 8)
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        batched = drive(
            BatchDecoder(model, options, True), model, options, prompts, 24, 2
        )
        single = drive(
            SingleDecoder(model, options, True), model, options, prompts, 24, 2
        )
        return batched, single

    batched, single = on_engine_thread(engine, both)
    for b, s in zip(batched, single):
        assert len(b[0]) == 24
        assert_greedy_close(b, s, BATCHING_NOISE)
        assert isinstance(b[2].cache[0], QuantizedKVCache)
        assert isinstance(s[2].cache[0], QuantizedKVCache)


def test_q8_0_stays_close_to_full_precision(engine):
    """Closeness: the last prompt position's logits differ by under 1.0 at q8_0
    (measured 0.31 to 0.41 on the test prompts, against 5.6 to 8.1 at q4_0), and
    greedy decoding keeps full precision's tokens up to a near tie."""

    def logits(model, options):
        out = []
        for question in QUESTIONS:
            prompt = mx.array(chat_prompt(engine, question))[None]
            row = {}
            for bits in (None, 8, 4):
                cache = make_kv_cache(model, quantized(options, bits))
                row[bits] = model(prompt, cache=cache)[0, -1].astype(mx.float32)
            out.append(
                {bits: (v - row[None]).abs().max().item() for bits, v in row.items()}
            )
        return out

    for differences in on_engine_thread(engine, logits):
        assert differences[8] < 1.0
        assert differences[4] > 2 * differences[8]

    def greedy(model, options):
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        return [
            drive(BatchDecoder(model, o, True), model, o, prompts, 32, 2)
            for o in (options, quantized(options, 8))
        ]

    full, q8 = on_engine_thread(engine, greedy)
    for ours, theirs in zip(q8, full):
        assert_greedy_close(ours, theirs, Q8_NOISE)


def test_the_engine_serves_and_caches_quantized_kv():
    engine = load_engine("kv_bits:8", "kv_group_size:32")
    try:
        requests = [generation(engine, q, max_tokens=16) for q in QUESTIONS]
        replies = run(engine, *requests)
        first = [text_of(events) for events in replies]
        stats = stats_after(engine)
        # Each retired sequence's quantized KV state is kept, at its real size:
        # 30 layers, 3 KV heads, 64 values quantized to 8 bits in groups of 32.
        per_token = 30 * 2 * 3 * (64 + 2 * 2 * 4)

        def entries(model, options):
            lru = engine._prompt_cache._lru
            return [
                (type(e.prompt_cache[0]), e.prompt_cache[0].offset)
                for e in lru.values()
            ]

        kept = on_engine_thread(engine, entries)
        assert {kind for kind, _ in kept} == {QuantizedKVCache} and len(kept) == 3
        assert stats["prompt_cache_bytes"] == per_token * sum(n for _, n in kept)
        # At least the prompt and all but the last generated token.
        assert sum(n for _, n in kept) >= sum(
            e[-1].prompt_tokens + e[-1].completion_tokens - 1 for e in replies
        )
        again = [text_of(events) for events in run(engine, *requests)]
        assert again == first
        assert stats_after(engine)["prompt_cache_reused_tokens"] >= sum(
            len(r.prompt) - 1 for r in requests
        )
    finally:
        engine.shutdown()


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


def test_staged_decoding_matches_mlx_lm(engine):
    """quantized_kv_start as mlx-lm's generate_step applies it: the same greedy
    tokens through the switch to quantized."""

    def both(model, options):
        prompt = chat_prompt(engine)
        start = len(prompt) + 6
        ours = dataclasses.replace(quantized(options, 8), quantized_kv_start=start)
        ((tokens, _, state),) = drive(
            SingleDecoder(model, ours, True), model, ours, [prompt], 16, None
        )
        theirs = [
            token
            for token, _ in generate_step(
                mx.array(prompt),
                model,
                max_tokens=16,
                kv_bits=8,
                kv_group_size=32,
                quantized_kv_start=start,
                prefill_step_size=options.prefill_step_size,
            )
        ]
        ((batched, _, _),) = drive(
            BatchDecoder(model, ours, True), model, ours, [prompt], 16, None
        )
        return tokens, batched, theirs, type(state.cache[0])

    tokens, batched, theirs, kind = on_engine_thread(engine, both)
    assert tokens == batched == theirs and kind is QuantizedKVCache


def test_a_layout_the_model_cannot_take_fails_the_load(engine):
    """SmolLM2's heads have 64 dims: groups of 128 can't quantize them. The load
    fails before the running model is unloaded."""
    options = parse_options(["kv_bits:8", "kv_group_size:128"])
    with pytest.raises(InvalidArgument, match="kv_group_size 128: this model's KV"):
        engine.load("", options, 0, identity="default").result()
    assert engine.stats.state == "ready"
    assert text_of(run(engine, generation(engine))[0]) == ANSWER
