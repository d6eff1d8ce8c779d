"""MLX's fast operations on the CPU kernels.

On a GPU ``mx.fast.rms_norm``, ``layer_norm``, ``rope`` and
``scaled_dot_product_attention`` are one kernel each; on the CPU MLX runs their
fallback graphs, 8 to 30 small operations that each cost a dispatch, an allocation
and a pass over memory. ``route_fast_ops`` puts a function in ``mx.fast`` for each
that builds one primitive of the kernel extension (``fused.cpp``) instead, and
calls MLX's own where the primitive does not take the inputs. Every family's code
reaches them unchanged: mlx-lm's layers call ``mx.fast`` when they run.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from mlx_backend.cpu.kernels import FAST_OPS_ENV, load_kernels
from mlx_backend.switches import switched_off

_NAMES = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
# MLX's own functions, captured before any routing.
_MLX = {name: getattr(mx.fast, name) for name in _NAMES}


@dataclass
class _Routing:
    kernels: object = None


_routing = _Routing()


def rms_norm(x, weight, eps, *, stream=None):
    k = _routing.kernels
    if k is not None and stream is None:
        return k.rms_norm(x, weight, eps)
    return _MLX["rms_norm"](x, weight, eps, stream=stream)


def layer_norm(x, weight, bias, eps, *, stream=None):
    k = _routing.kernels
    if k is not None and stream is None:
        return k.layer_norm(x, weight, bias, eps)
    return _MLX["layer_norm"](x, weight, bias, eps, stream=stream)


def rope(a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
    k = _routing.kernels
    if k is not None and stream is None:
        return k.rope(
            a,
            dims,
            traditional=traditional,
            base=base,
            scale=scale,
            offset=offset,
            freqs=freqs,
        )
    return _MLX["rope"](
        a,
        dims,
        traditional=traditional,
        base=base,
        scale=scale,
        offset=offset,
        freqs=freqs,
        stream=stream,
    )


def scaled_dot_product_attention(
    q, k, v, *, scale, mask=None, sinks=None, force_fused=False, stream=None
):
    kernels = _routing.kernels
    if kernels is not None and stream is None:
        if isinstance(mask, str):
            mode, mask = mask, None
        else:
            mode = "" if mask is None else "array"
        return kernels.scaled_dot_product_attention(
            q, k, v, scale=scale, mask_mode=mode, mask=mask, sinks=sinks
        )
    return _MLX["scaled_dot_product_attention"](
        q,
        k,
        v,
        scale=scale,
        mask=mask,
        sinks=sinks,
        force_fused=force_fused,
        stream=stream,
    )


_ROUTED = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rope": rope,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}


def route_fast_ops() -> tuple[str, str]:
    """Run ``mx.fast``'s four operations on the CPU kernels in this process from
    now on (idempotent): their instruction set and "", or "" and why MLX's own
    run (then restored)."""
    kernels, why = load_kernels()
    if switched_off(os.environ, FAST_OPS_ENV):
        kernels, why = None, f"off ({FAST_OPS_ENV})"
    _routing.kernels = kernels
    for name, fn in (_MLX if kernels is None else _ROUTED).items():
        setattr(mx.fast, name, fn)
    return ("", why) if kernels is None else (kernels.fused_isa(), "")


@contextmanager
def mlx_fast_ops():
    """MLX's own operations within the block (what the kernels are judged
    against)."""
    kernels, _routing.kernels = _routing.kernels, None
    try:
        yield
    finally:
        _routing.kernels = kernels
