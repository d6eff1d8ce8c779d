"""MLX's fast operations on the CPU kernels.

On a GPU ``mx.fast.rms_norm``, ``layer_norm``, ``rope`` and
``scaled_dot_product_attention`` are one kernel each; on the CPU MLX runs their
fallback graphs, 8 to 30 small operations that each cost a dispatch, an allocation
and a pass over memory. ``route_fast_ops`` puts a function in ``mx.fast`` for each
that builds one primitive of the kernel extension (``fused.cpp``) instead, and
calls MLX's own where the primitive does not take the inputs. Every family's code
reaches them unchanged: mlx-lm's layers call ``mx.fast`` when they run.

Two more go the same way because MLX's CPU build computes exp one scalar at a time
(about 13 ns each): mlx-lm's ``swiglu`` (the MLP activation of most families, a
compiled graph) and ``mx.logsumexp`` (every decode step's logprobs, over the whole
vocabulary, for every row).
"""

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import activations

from mlx_backend.cpu.kernels import FAST_OPS_ENV, load_kernels
from mlx_backend.switches import switched_off

_NAMES = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
# MLX's own functions, captured before any routing.
_MLX = {name: getattr(mx.fast, name) for name in _NAMES}
_MLX_LOGSUMEXP = mx.logsumexp
_MLX_SWIGLU = activations.swiglu


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


def swiglu(gate, x):
    k = _routing.kernels
    if k is not None and gate.shape == x.shape:
        return k.swiglu(gate, x)
    return _MLX_SWIGLU(gate, x)


def logsumexp(a, axis=None, keepdims=False, *, stream=None):
    k = _routing.kernels
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    # Over the last axis, or over all of them where only the last is longer than 1.
    over_last = a.ndim > 0 and (
        axes in ([-1], [a.ndim - 1]) or (axis is None and a.size == a.shape[-1])
    )
    if k is None or stream is not None or a.size == 0 or not over_last:
        return _MLX_LOGSUMEXP(a, axis, keepdims, stream=stream)
    y = k.logsumexp(a)
    if axis is None:
        return y.reshape([1] * a.ndim if keepdims else [])
    return y if keepdims else y.squeeze(-1)


def _install_swiglu(fn) -> None:
    """``fn`` as mlx-lm's swiglu: in its module, for models imported later, and in
    every model module that already took it."""
    current = activations.swiglu
    activations.swiglu = fn
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.models.")
            and getattr(module, "swiglu", None) is current
        ):
            module.swiglu = fn


_ROUTED = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "rope": rope,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}


def _fast_kernels():
    """The kernels for the fused operations, or None and why not."""
    if switched_off(os.environ, FAST_OPS_ENV):
        return None, f"off ({FAST_OPS_ENV})"
    return load_kernels()


def route_fast_ops() -> tuple[str, str]:
    """Run ``mx.fast``'s four operations, ``mx.logsumexp`` and mlx-lm's ``swiglu``
    on the CPU kernels in this process from now on (idempotent): their
    instruction set and "", or "" and why MLX's own run (then restored)."""
    kernels, why = _fast_kernels()
    _routing.kernels = kernels
    for name, fn in (_MLX if kernels is None else _ROUTED).items():
        setattr(mx.fast, name, fn)
    mx.logsumexp = _MLX_LOGSUMEXP if kernels is None else logsumexp
    _install_swiglu(_MLX_SWIGLU if kernels is None else swiglu)
    return ("", why) if kernels is None else (kernels.fused_isa(), "")


def route_training_ops() -> str:
    """For training on the CPU: ``mx.logsumexp`` (the loss's) and mlx-lm's
    ``swiglu`` on the kernels, the two that define their gradients (``mx.fast``'s
    stay MLX's, which differentiate). Their instruction set, or "" where MLX's run.
    """
    kernels, _ = _fast_kernels()
    if kernels is None:
        return ""
    _routing.kernels = kernels
    mx.logsumexp = logsumexp
    _install_swiglu(swiglu)
    return kernels.fused_isa()


@contextmanager
def mlx_fast_ops():
    """MLX's own operations within the block (what the kernels are judged
    against)."""
    kernels, _routing.kernels = _routing.kernels, None
    try:
        yield
    finally:
        _routing.kernels = kernels


def routed_kernels():
    """The kernel module ``mx.fast`` is routed to now; None where MLX's own run."""
    return _routing.kernels
