"""Quantized KV caches on the embedded model, in-process: quantized pages, batched
and single quantized decoding agree, q8_0 stays close to full precision, the engine serves
and caches quantized KV state, staged quantization matches mlx-lm's, and a layout
the model can't take fails the load."""

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_backend.caches.paged import PAGE_TOKENS, PagedPrefix, pages_for
from mlx_backend.caches.quantized_kv import QuantizedKVCache
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from mlx_backend.decoders.single import SingleDecoder
from mlx_backend.errors import InvalidArgument
from mlx_backend.models import mlx_lm_fixes
from mlx_backend.models.loading import LoadPlan
from mlx_utils import make_kv_cache
from python_utils import parse_options
from tests.engine_helpers import (
    assert_greedy_close,
    chat_prompt,
    drive,
    generation,
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
)
from tests.support import ANSWER, QUESTIONS


@pytest.fixture(scope="module")
def engine():
    engine = load_engine()
    yield engine
    engine.shutdown()


def quantized(options, bits: int | None):
    return dataclasses.replace(options, kv_bits=bits, kv_group_size=32)


# Batching changes the BLAS's matrix shapes, so its rounding; a quantized KV cache
# amplifies that to up to 0.25 in a logprob on a 2-core Xeon (0.003 unquantized).
BATCHING_NOISE = 0.4
# Measured up to 0.40 between the two caches on the test prompts.
Q8_NOISE = 0.6


def test_paged_batched_and_single_quantized_decoding_agree(engine):
    """Quantized pages (the CPU kernel dequantizing a block at a time), the batch
    decoder's quantized caches and mlx-lm's for one sequence decode alike at q8_0
    (4 bits rounds too coarsely to judge so: its kernel is checked against the
    gathered pages in tests/unit/test_paged_kv.py)."""

    def each(model, options):
        options = quantized(options, 8)
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        decoders = (
            PagedDecoder(model, options, paged_layers(model, options)),
            BatchDecoder(model, options, True),
            SingleDecoder(model, options, True),
        )
        return [drive(d, model, options, prompts, 24, 2) for d in decoders]

    paged, batched, single = on_engine_thread(engine, each)
    for p, b, s in zip(paged, batched, single):
        assert len(p[0]) == len(b[0]) == 24
        assert_greedy_close(b, s, BATCHING_NOISE)
        assert_greedy_close(p, s, BATCHING_NOISE)
        assert isinstance(p[2].cache[0], PagedPrefix)
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


def test_q8_0_read_dequantized_keeps_full_precision_greedy_tokens(engine, monkeypatch):
    """The form CUDA reads a quantized cache in (dequantized for the fused
    attention) decodes full precision's greedy tokens, as the packed form does."""

    def greedy(model, options):
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        return [
            drive(BatchDecoder(model, o, True), model, o, prompts, 32, 2)
            for o in (options, quantized(options, 8))
        ]

    asked = []
    monkeypatch.setattr(
        mlx_lm_fixes,
        "quantized_attention_form",
        lambda: asked.append(1) or "dequantized",
    )
    full, q8 = on_engine_thread(engine, greedy)
    assert asked  # every quantized layer's attention took that form
    for ours, theirs in zip(q8, full):
        assert_greedy_close(ours, theirs, Q8_NOISE)


@pytest.mark.parametrize("paged", ["paged:true", "paged:false"])
def test_the_engine_serves_and_caches_quantized_kv(paged):
    """On quantized pages (the CPU's default) and on the batch decoder's quantized
    caches, each retired sequence's quantized KV state is kept at its real size,
    and the same requests again reuse it for the same text."""
    engine = load_engine("kv_bits:8", "kv_group_size:32", paged)
    try:
        requests = [generation(engine, q, max_tokens=16) for q in QUESTIONS]
        replies = run(engine, *requests)
        first = [text_of(events) for events in replies]
        stats = stats_after(engine)
        # 30 layers, 3 KV heads, 64 values quantized to 8 bits in groups of 32
        # (float32 scales and biases).
        per_token = 30 * 2 * 3 * (64 + 2 * 2 * 4)

        def entries(model, options):
            entries = engine.served.store.cache.entries(engine.info.load_id)
            return [(cache[0], cache[0].offset) for _, cache in entries]

        kept = on_engine_thread(engine, entries)
        assert len(kept) == 3
        if paged == "paged:true":
            # Pages: whole pages held, quantized.
            assert {type(c) for c, _ in kept} == {PagedPrefix}
            assert {c.lease.kv.shapes[0].bits for c, _ in kept} == {8}
            held = PAGE_TOKENS * sum(pages_for(n) for _, n in kept)
        else:
            assert {type(c) for c, _ in kept} == {QuantizedKVCache}
            held = sum(n for _, n in kept)
        assert stats["prompt_cache_bytes"] == per_token * held
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
        engine.load(LoadPlan(identity="default", options=options)).result()
    assert engine.stats.state == "ready"
    assert text_of(run(engine, generation(engine))[0]) == ANSWER
