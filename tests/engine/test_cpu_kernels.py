"""The SIMD kernels in-process: on the embedded model's first layers, greedy
decoding alone and in a batch of 8 gives the float32 path's tokens, and MLX's own
norms, RoPE and attention's, up to a near tie, with logprobs within the kernels'
noise; the engine serves the embedded model on them by default and says so in
Status."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_backend.cpu import kernels
from mlx_backend.cpu.kernels.fast_ops import mlx_fast_ops
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.single import SingleDecoder
from mlx_utils import make_kv_cache
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

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="the kernels run on the CPU"
)

# The kernels (float32 activations) moved logprobs by up to 4e-5 from the float32
# path's on these prompts. (Activations rounded to int16: 0.004.)
KERNEL_NOISE = 0.01
PROMPTS = QUESTIONS + (
    "List five animals that live in the ocean.",
    "Explain why the sky is blue in one sentence.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
    "Describe a sunset.",
)


@pytest.fixture(scope="module")
def engines(short_default):
    """The kernels and the float32 path on the default model's first layers: its
    quantized weights and shapes, every kind of layer the kernels run, at a
    seventh of the passes."""
    model = str(short_default)
    kernels = load_engine(model=model)
    float32 = load_engine("dequantize:true", model=model)
    yield kernels, float32
    kernels.shutdown()
    float32.shutdown()


def decode(engine, decoder_class, prompts):
    def go(model, options):
        return drive(
            decoder_class(model, options, True), model, options, prompts, 24, 2
        )

    return on_engine_thread(engine, go)


@pytest.fixture(scope="module")
def float32_decodes(engines):
    """The float32 path's greedy decodes of PROMPTS, as one batch of 8 (one at a
    time it differs from the batch by ~0.003 in a logprob, and costs 8 times the
    steps)."""
    _, float32 = engines
    assert float32.info.compute_path.dequantized_bytes > 0
    return decode(float32, BatchDecoder, [chat_prompt(float32, q) for q in PROMPTS])


@pytest.fixture(scope="module")
def mlx_operations_decodes(engines):
    """The kernels' greedy decodes of PROMPTS as one batch of 8 with MLX's own
    norms, RoPE and attention (the fused primitives off)."""
    kernels, _ = engines
    assert kernels.info.compute_path.fast_ops_isa
    with mlx_fast_ops():
        return decode(kernels, BatchDecoder, [chat_prompt(kernels, q) for q in PROMPTS])


@pytest.mark.parametrize("decoder_class", [SingleDecoder, BatchDecoder])
def test_greedy_decoding_matches_the_float32_path_and_mlx_operations(
    engines, float32_decodes, mlx_operations_decodes, decoder_class
):
    kernels, _ = engines
    assert kernels.info.compute_path.kernel_isa
    prompts = [chat_prompt(kernels, q) for q in PROMPTS]
    # SingleDecoder runs them one at a time; BatchDecoder as one batch of 8.
    ours = decode(kernels, decoder_class, prompts)
    for mine, reference in zip(ours, float32_decodes):
        assert_greedy_close(mine, reference, KERNEL_NOISE)
    for mine, reference in zip(ours, mlx_operations_decodes):
        assert_greedy_close(mine, reference, KERNEL_NOISE)


def test_the_engine_serves_on_the_kernels_and_reports_them():
    kernels = load_engine()
    try:
        replies = run(kernels, *[generation(kernels) for _ in range(3)])
        assert [text_of(r) for r in replies] == [ANSWER] * 3
        stats = stats_after(kernels)
        path = kernels.info.compute_path
        assert stats["cpu_kernels"] == 1 and stats["dequantized_weights"] == 0
        assert stats["cpu_kernel_threads"] == path.kernel_threads >= 1
        assert stats[f"cpu_kernel_isa_{path.kernel_isa.split()[0]}"] == 1
        assert "SIMD kernels" in path.description and "threads" in path.description
        assert stats["cpu_fast_ops"] == 1 and path.fast_ops_isa
        assert (
            f"logsumexp on the fused kernels ({path.fast_ops_isa})" in path.description
        )
    finally:
        kernels.shutdown()


# A fixed text for the next-token distributions (the default model's own
# domain: plain English), 72 tokens: chunks of 3 stay on the row kernels (x
# scaled per 4 values), chunks of 6 take the GEMM per 4, of 16 (the last 8) and
# 36 the GEMM per 8 (decode's side, and a prompt's).
KL_TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and every evening "
    "the keeper climbed its ninety steps to light the lamp. Ships passed far out "
    "at sea, and their crews counted the flashes to know which coast they were "
    "near. In winter the storms came from the west, and the waves broke over the "
    "rocks so hard that the whole tower shook."
)
CHUNKS = (3, 6, 16, 36)


def test_int8_activations_keep_the_next_token_distributions():
    """x rounded to int8 (a scale per 4 values on the row kernels and a small
    batch's GEMM, per 8 on the GEMM from 8 rows, the biases meeting the rounded
    sums): over a fixed text, read in chunks that take each, the mean KL
    divergence from the float32 kernels'
    next-token distributions stays within 0.005 and the perplexity within 0.5%,
    as llama.cpp's --kl-divergence judges quantized inference; the load option
    says so, and greedy decodes of PROMPTS (a batch of 8) keep the float32
    kernels' tokens up to a near tie (their best two within NEAR_TIE)."""
    engine = load_engine("kernel_activations:int8")

    def logprobs(model, options, chunk):
        qmm, _ = kernels.load_kernels()
        ids = engine.info.tokenizer.encode(KL_TEXT)
        out = {}
        for activations in ("float32", "int8"):
            qmm.set_activations(activations)
            cache, rows = make_kv_cache(model, options), []
            for i in range(0, len(ids), chunk):
                logits = model(mx.array(ids[i : i + chunk])[None], cache=cache)[0]
                rows.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
                mx.eval(rows[-1])
            out[activations] = np.array(mx.concatenate(rows))
        qmm.set_activations("int8")
        return ids, out["float32"], out["int8"]

    try:
        assert "int8 activations" in engine.info.compute_path.description
        for chunk in CHUNKS:
            ids, exact, rounded = on_engine_thread(
                engine, lambda model, options: logprobs(model, options, chunk)
            )
            # Every chunk, the last one too, on the kernel and rounding its size
            # names.
            last = len(ids) % chunk or chunk
            assert len(ids) > 4 * CHUNKS[-2] and rounding(last) == rounding(chunk)
            kl = (np.exp(exact) * (exact - rounded)).sum(axis=-1)[:-1]
            assert 0 < kl.mean() <= 0.005, chunk
            taken = np.arange(len(ids) - 1), np.array(ids[1:])
            nll = [-x[:-1][taken].mean() for x in (exact, rounded)]
            assert math.exp(nll[1] - nll[0]) <= 1.005, chunk
        prompts = [chat_prompt(engine, q) for q in PROMPTS]
        qmm, _ = kernels.load_kernels()
        decodes = {}
        for activations in ("float32", "int8"):
            qmm.set_activations(activations)
            decodes[activations] = decode(engine, BatchDecoder, prompts)
        parted = 0
        for mine, reference in zip(decodes["int8"], decodes["float32"]):
            parted += part_at_a_near_tie(mine, reference)
        # The first answer's "The" and "L" are 0.082 apart on float32 x.
        assert parted < len(prompts)
    finally:
        engine.shutdown()


def rounding(rows: int) -> tuple[bool, int, bool]:
    """The int8 path of a product of ``rows`` rows: the GEMM or the row kernels,
    x's values per scale, and whether a prompt's side (past the row limit)."""
    return rows >= 4, 8 if rows >= 8 else 4, rows > 32


# Where two greedy decodes may part: the float32 decode's best two logprobs this
# close (the bound for quantized activations, as the quantized-KV tests).
NEAR_TIE = 0.1


def part_at_a_near_tie(mine: tuple, reference: tuple) -> bool:
    """Two greedy decodes (``drive``'s, with top-2 logprobs) agree token for
    token, or part where the reference's best two were a near tie; whether they
    parted."""
    tokens, _, _ = mine
    theirs, scores, _ = reference
    for i, (a, b) in enumerate(zip(tokens, theirs)):
        if a != b:
            best = sorted(value for _, value in scores[i][1])
            assert best[-1] - best[-2] < NEAR_TIE, f"parted at {i}, not a near tie"
            return True
    return False
