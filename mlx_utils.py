"""Small MLX / mlx-lm helpers: KV caches, batching, memory readings, logprobs."""

import dataclasses
import json
import logging
from collections.abc import Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import dequantize_model

from mlx_backend.caches.quantized_kv import QuantizedKVCache, StagedKVCache
from mlx_backend.errors import InvalidArgument
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


def unbatchable_reason(model: nn.Module, options: LoadOptions) -> str | None:
    """Why the model's requests can't share a BatchGenerator, or None when they can."""
    if options.max_kv_size is not None:
        # Batched rotating caches drop the kept prefix (keep=4) of the single path.
        return "max_kv_size makes rotating KV caches"
    kinds = {
        type(c).__name__
        for c in make_kv_cache(model, options)
        if not hasattr(c, "merge")
    }
    if kinds:
        return (
            f"its KV caches ({', '.join(sorted(kinds))}) cannot be merged into a batch"
        )
    return None


def make_kv_cache(model: nn.Module, options: LoadOptions) -> list:
    """The model's KV cache, its plain KV layers quantized (``kv_bits``) or made
    windows of ``max_kv_size`` tokens.

    mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` for models with a
    ``make_cache`` of their own, as llama has since it learned sliding windows.
    """
    cache = make_prompt_cache(model)
    if options.kv_bits is not None:
        group, bits, start = (
            options.kv_group_size or 64,
            options.kv_bits,
            options.quantized_kv_start,
        )
        if start:
            layer = partial(StagedKVCache, start, group, bits)
        else:
            layer = partial(QuantizedKVCache, group_size=group, bits=bits)
    elif options.max_kv_size is not None:
        layer = partial(RotatingKVCache, max_size=options.max_kv_size, keep=4)
    else:
        return cache
    return [layer() if type(c) is KVCache else c for c in cache]


def check_kv_cache(model: nn.Module, options: LoadOptions) -> None:
    """Build, without running, one token's forward pass over the quantized KV cache
    the options ask for: a group size the head dims don't divide, or attention
    sinks, then fail the load instead of every request. Lazy weights stay lazy."""
    if options.kv_bits is None:
        return
    quantized = dataclasses.replace(options, quantized_kv_start=0)
    try:
        model(mx.array([[0]]), cache=make_kv_cache(model, quantized))
    except Exception as e:
        layers = sorted(
            {
                type(m).__name__
                for _, m in model.named_modules()
                if type(m).__name__.endswith("Attention")
            }
        )
        raise InvalidArgument(
            f"Options: kv_bits {options.kv_bits} with kv_group_size "
            f"{options.kv_group_size or 64}: this model's KV cache can't be "
            f"quantized so: its {', '.join(layers) or 'attention'} layers fail ({e})"
        ) from None


def dequantize_to_float32(model: nn.Module) -> nn.Module:
    """The model with float32 weights in place of quantized ones (lazy)."""
    # Scales in float32 first: MLX dequantizes from float16 scales about 4x slower
    # on the CPU, and the weights skip a rounding to float16.
    model.set_dtype(mx.float32)
    return dequantize_model(model)


def model_signature(model: nn.Module, config: dict) -> str:
    """What KV states depend on: the config, and sums of the first and last
    weights, so a model replaced at the same path (same layer count, new heads or
    new weights) does not take the old one's saved states."""
    leaves = tree_flatten(model.parameters())
    sums = [mx.sum(leaves[i][1].astype(mx.float32)).item() for i in (0, -1) if leaves]
    return json.dumps([config, sums], sort_keys=True, default=str)


def memory_snapshot() -> dict[str, int]:
    """MLX's allocator readings in bytes."""
    return {
        "active": mx.get_active_memory(),
        "cache": mx.get_cache_memory(),
        "peak": mx.get_peak_memory(),
    }


def release_memory() -> None:
    mx.clear_cache()
    mx.reset_peak_memory()


# A token's logprob and its best alternatives, as (token id, logprob) pairs.
Scored = tuple[float, list[tuple[int, float]]]


def gather_logprobs(
    rows: Sequence[mx.array], tokens: Sequence[int], top: int
) -> list[Scored]:
    """Each row's logprob of its token and its ``top`` best tokens, best first.

    One evaluation for every row of a decode step.
    """
    logprobs = mx.stack(list(rows)).astype(mx.float32)
    # On a CPU numpy picks the best of a vocabulary about 4x faster than MLX.
    xp = np if mx.default_device() == mx.cpu else mx
    if xp is np:
        logprobs = np.asarray(logprobs)
    chosen = xp.take_along_axis(logprobs, xp.array(tokens)[:, None], axis=-1)[:, 0]
    if top == 0:
        return [(value, []) for value in chosen.tolist()]
    cut = logprobs.shape[-1] - top
    best = xp.argpartition(logprobs, kth=cut, axis=-1)[:, cut:]
    values = xp.take_along_axis(logprobs, best, axis=-1)
    order = xp.argsort(-values, axis=-1)
    best = xp.take_along_axis(best, order, axis=-1)
    values = xp.take_along_axis(values, order, axis=-1)
    if xp is mx:
        mx.eval(chosen, best, values)
    return [
        (value, list(zip(ids, alternatives)))
        for value, ids, alternatives in zip(
            chosen.tolist(), best.tolist(), values.tolist()
        )
    ]
