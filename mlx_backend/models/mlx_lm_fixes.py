"""Workarounds for mlx-lm bugs that change generated text, and for attention
that refuses a quantized KV cache or that a device can't run, applied at load.

Each replaces one function or method of an mlx-lm module with a corrected copy,
and ``tests/unit/test_mlx_lm_fixes.py`` shows what it answers. Drop a fix once the
pinned mlx-lm has it.
"""

import functools

import mlx.core as mx
from mlx_lm.models import base, gemma4_text, gpt_oss, nemotron_h
from mlx_lm.models.ssm import ssm_update

from mlx_backend.gpu import on_cuda


def _nemotron_h_ssm(self, hidden_states, B, C, dt, cache, mask):
    # mlx-lm 0.32.2 leaves out ``cache.lengths``: a right-padded row of a batched
    # prefill then ends with a zero SSM state (ml-explore/mlx-lm#1908 for Granite).
    batch, length, _ = hidden_states.shape
    hidden_states = hidden_states.reshape(batch, length, self.num_heads, self.head_dim)
    B = B.reshape(batch, length, self.n_groups, self.ssm_state_size)
    C = C.reshape(batch, length, self.n_groups, self.ssm_state_size)
    y, state = ssm_update(
        hidden_states,
        self.A_log,
        B,
        C,
        self.D.astype(hidden_states.dtype),
        dt,
        self.dt_bias,
        cache[1] if cache else None,
        self.time_step_limit,
        mask,
        cache.lengths if cache else None,
    )
    if cache:
        cache[1] = state
    return y.reshape(batch, length, self.intermediate_size)


@functools.cache
def quantized_attention_form() -> str:
    """How attention reads a quantized KV cache on the default device: "packed"
    (quantized matmuls on the packed keys and values) or "dequantized" (keys and
    values dequantized for the fused attention); asked once, not per layer."""
    # MLX's CUDA quantized_matmul takes only row-contiguous packed operands, which a
    # cache's view is not, and its untransposed product only from a naive kernel.
    return "dequantized" if on_cuda() else "packed"


def quantized_attention(
    queries,
    keys,
    values,
    scale: float,
    mask,
    group_size: int = 64,
    bits: int = 8,
    sinks=None,
) -> mx.array:
    """Attention over quantized keys and values (triples), in the device's form."""
    if quantized_attention_form() == "dequantized":
        keys, values = (
            mx.dequantize(*x, group_size=group_size, bits=bits).astype(queries.dtype)
            for x in (keys, values)
        )
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    if sinks is None:
        return _MLX_LM_QUANTIZED_ATTENTION(
            queries, keys, values, scale, mask, group_size=group_size, bits=bits
        )
    return _quantized_attention_with_sinks(
        queries, keys, values, scale, mask, sinks, group_size, bits
    )


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks=None
) -> mx.array:
    """mlx-lm's attention, which also takes quantized keys and values with
    attention sinks (gpt-oss) or without their cache (Gemma 4's layers that share
    another layer's keys and values): the packing gives the bits and groups."""
    if not isinstance(keys, (tuple, list)):
        # Arrays, or a paged pass's keys (caches/paged.py); quantized ones come
        # as (packed, scales, biases).
        return base.scaled_dot_product_attention(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )
    dims = queries.shape[-1]
    packed, scales = keys[0].shape[-1], keys[1].shape[-1]
    bits, group_size = 32 * packed // dims, dims // scales
    return quantized_attention(
        queries, keys, values, scale, mask, group_size, bits, sinks=sinks
    )


def _quantized_attention_with_sinks(
    queries, keys, values, scale, mask, sinks, group_size: int, bits: int
) -> mx.array:
    # A sink is one more logit per head that takes softmax mass and adds no value.
    B, heads, L, D = queries.shape
    kv_heads = keys[0].shape[-3]
    repeats = heads // kv_heads
    queries = (queries * scale).reshape(B, kv_heads, repeats, L, D)
    keys = tuple(mx.expand_dims(x, axis=-3) for x in keys)
    values = tuple(mx.expand_dims(x, axis=-3) for x in values)
    scores = mx.quantized_matmul(
        queries, *keys, transpose=True, group_size=group_size, bits=bits
    )
    if isinstance(mask, str):
        q_length, k_length = scores.shape[-2:]
        mask = mx.arange(k_length - q_length, k_length)[:, None] >= mx.arange(k_length)
    if mask is not None:
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    sink = mx.broadcast_to(
        sinks.astype(scores.dtype).reshape(1, kv_heads, repeats, 1, 1),
        (*scores.shape[:-1], 1),
    )
    weights = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)
    out = mx.quantized_matmul(
        weights[..., :-1], *values, transpose=False, group_size=group_size, bits=bits
    )
    return out.reshape(B, heads, L, D)


def apply_fixes() -> None:
    """Patch the mlx-lm classes whose bugs change output, give quantized KV to the
    families whose attention refuses it, and read it in the device's form
    (idempotent)."""
    nemotron_h.NemotronHMamba2Mixer._ssm = _nemotron_h_ssm
    base.quantized_scaled_dot_product_attention = quantized_attention
    gpt_oss.scaled_dot_product_attention = scaled_dot_product_attention
    gemma4_text.scaled_dot_product_attention = scaled_dot_product_attention


# The unpatched functions, for the tests that show the bugs.
UNPATCHED = {
    "nemotron_h": nemotron_h.NemotronHMamba2Mixer._ssm,
    "quantized_attention": base.quantized_scaled_dot_product_attention,
}
_MLX_LM_QUANTIZED_ATTENTION = UNPATCHED["quantized_attention"]
