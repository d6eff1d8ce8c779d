"""The mlx-lm workarounds (mlx_backend/models/mlx_lm_fixes.py): what each answers,
shown on mlx-lm's own code."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base, nemotron_h
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load as load_mlx_lm

from mlx_backend.gpu import on_cuda
from mlx_backend.models import mlx_lm_fixes
from mlx_backend.models.mlx_lm_fixes import (
    UNPATCHED,
    apply_fixes,
    quantized_attention,
    quantized_attention_form,
    scaled_dot_product_attention,
)
from tests.support import device_tolerance

PROMPTS = [[5 + i for i in range(n)] for n in (7, 13, 20, 31)]


def first_logits(model, prompts) -> list[mx.array]:
    """The logits of each prompt's first generated token, the prompts prefilled
    together (right-padded) as BatchGenerator prefills them."""
    batch = BatchGenerator(model, prefill_batch_size=len(prompts))
    batch.insert(prompts, max_tokens=[1] * len(prompts))
    rows = {}
    while len(rows) < len(prompts):
        for response in batch.next()[1]:
            rows[response.uid] = response.logprobs
    batch.close()
    return [rows[uid] for uid in sorted(rows)]


@pytest.fixture(scope="module")
def nemotron(family_folder):
    model, _ = load_mlx_lm(str(family_folder("nemotron_h")))
    return model


def test_nemotron_h_keeps_the_ssm_state_of_padded_rows(nemotron):
    alone = [first_logits(nemotron, [p])[0] for p in PROMPTS]
    mixer = nemotron_h.NemotronHMamba2Mixer
    try:
        mixer._ssm = UNPATCHED["nemotron_h"]
        broken = first_logits(nemotron, PROMPTS)
    finally:
        apply_fixes()
    fixed = first_logits(nemotron, PROMPTS)
    # mlx-lm drops cache.lengths: the shorter, right-padded rows end with a zero
    # SSM state; the longest row has no padding.
    gaps = [mx.abs(a - b).max().item() for a, b in zip(alone, broken)]
    assert min(gaps[:3]) > 0.1 and gaps[3] < device_tolerance(1e-4, 10)
    for a, b in zip(alone, fixed):
        assert mx.abs(a - b).max().item() < device_tolerance(1e-4, 10)
    assert greedy_sampler(mx.stack(fixed)).tolist() == [
        greedy_sampler(a[None]).item() for a in alone
    ]


@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_quantized_attention_with_sinks_matches_the_full_precision_kernel(mask):
    mx.random.seed(3)
    heads, kv_heads, length, dims = 4, 2, 5, 64
    queries = mx.random.normal((1, heads, length, dims))
    keys = mx.random.normal((1, kv_heads, 9, dims))
    values = mx.random.normal((1, kv_heads, 9, dims))
    sinks = mx.random.normal((heads,))
    if mask == "window":
        # A sliding window's boolean mask, as gpt-oss's rotating layers make one.
        mask = mx.arange(4, 9)[:, None] - mx.arange(9)[None] < 3
        mask = mask & (mx.arange(4, 9)[:, None] >= mx.arange(9)[None])
    quantized_keys = mx.quantize(keys, group_size=32, bits=8)
    quantized_values = mx.quantize(values, group_size=32, bits=8)

    def exact(triple):
        return mx.dequantize(*triple, group_size=32, bits=8)

    scale = dims**-0.5
    ours = scaled_dot_product_attention(
        queries, quantized_keys, quantized_values, None, scale, mask, sinks
    )
    theirs = mx.fast.scaled_dot_product_attention(
        queries,
        exact(quantized_keys),
        exact(quantized_values),
        scale=scale,
        mask=mask,
        sinks=sinks,
    )
    assert mx.abs(ours - theirs).max().item() < 1e-4
    # mlx-lm's own quantized attention refuses sinks.
    with pytest.raises(ValueError, match="sinks"):
        cache = type("Cache", (), {"bits": 8, "group_size": 32})()
        base.scaled_dot_product_attention(
            queries, quantized_keys, quantized_values, cache, scale, mask, sinks
        )


def cache_views(kv_heads: int, length: int, dims: int, bits: int):
    """Quantized keys and values as a cache hands them to attention: views of the
    first ``length`` positions of buffers grown in steps (not contiguous)."""
    triples = []
    for _ in range(2):
        full = mx.random.normal((2, kv_heads, 64, dims))
        packed = mx.quantize(full, group_size=32, bits=bits)
        triples.append(tuple(x[..., :length, :] for x in packed))
    return triples


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mask", [None, "causal", "window"])
@pytest.mark.parametrize("bits", [4, 8])
def test_both_forms_of_quantized_attention_match_the_dequantized_kernel(
    monkeypatch, sinks, mask, bits
):
    """The packed form (CPU, Metal) and the dequantized one (CUDA, whose quantized
    matmul refuses a cache's views) answer alike, with grouped heads, on views."""
    mx.random.seed(5)
    heads, kv_heads, queries_n, length, dims = 8, 2, 3, 40, 64
    keys, values = cache_views(kv_heads, length, dims, bits)
    queries = mx.random.normal((2, heads, queries_n, dims))
    head_sinks = mx.random.normal((heads,)) if sinks else None
    if mask == "window":
        rows = mx.arange(length - queries_n, length)[:, None]
        mask = (rows - mx.arange(length)[None] < 16) & (rows >= mx.arange(length))
    scale = dims**-0.5
    exact = mx.fast.scaled_dot_product_attention(
        queries,
        *(mx.dequantize(*x, group_size=32, bits=bits) for x in (keys, values)),
        scale=scale,
        mask=mask,
        sinks=head_sinks,
    )
    assert quantized_attention_form() == ("dequantized" if on_cuda() else "packed")
    answers = {}
    # MLX's CUDA quantized matmul has no kernel for a cache's views.
    forms = ("dequantized",) if on_cuda() else ("packed", "dequantized")
    for form in forms:
        monkeypatch.setattr(mlx_lm_fixes, "quantized_attention_form", lambda: form)
        # mlx-lm's packed form scales its queries in place.
        answers[form] = quantized_attention(
            mx.array(queries), keys, values, scale, mask, 32, bits, sinks=head_sinks
        )
    for form, answer in answers.items():
        assert answer.shape == exact.shape
        assert mx.abs(answer - exact).max().item() < device_tolerance(1e-4), form
