"""A decode step's layers as one kernel node each (``decode_layer.cpp``).

mlx-lm's Llama block builds 24 graph nodes a token: norms, three projections,
reshapes and transposes, RoPE, the cache's slice updates and slices, attention,
the MLP and two residual adds. On the CPU their building (Python) and scheduling
(MLX) took about a quarter of a decode step's CPU time, on the core that the
matmuls' second thread needed. ``route_decode_layers`` gives each block whose
parts the kernels take a plan; a routed block's call on one token over mlx-lm's
``KVCache`` (with room for the token) is then one node that writes the key and
value into the cache in place. Any other call (a prompt, a batch, a paged or
rotating cache, the cache's growth every 256 tokens) runs mlx-lm's own code.
"""

from dataclasses import asdict, dataclass
from functools import cached_property

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from mlx_backend.cpu.kernels import KernelQuantizedLinear, load_kernels
from mlx_backend.cpu.kernels.fast_ops import routed_kernels

# The blocks whose call is norm, attention, residual, norm, SwiGLU MLP, residual
# over these parts.
BLOCKS = (llama.TransformerBlock,)
_PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


@dataclass(frozen=True)
class DecodePlan:
    """A block's shapes and constants, as ``decode_layer`` takes them."""

    heads: int
    kv_heads: int
    attention_scale: float
    rope_dims: int
    rope_traditional: bool
    rope_base: float
    rope_scale: float
    attention_norm_eps: float
    mlp_norm_eps: float
    group_sizes: tuple[int, ...]
    bits: tuple[int, ...]

    @cached_property
    def arguments(self) -> dict:
        return asdict(self)


def decode_plan(block: nn.Module) -> DecodePlan | None:
    """The plan of a block whose parts the kernel takes, else None."""
    if type(block) not in BLOCKS:
        return None
    attention, mlp = block.self_attn, block.mlp
    linears = [block[part][name] for part, name in _PROJECTIONS]
    if not all(
        isinstance(m, KernelQuantizedLinear) and "bias" not in m for m in linears
    ):
        return None
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if not all(type(n) is nn.RMSNorm for n in norms) or type(mlp) is not llama.MLP:
        return None
    rope = attention.rope
    if type(rope) is nn.RoPE:
        base, scale = rope.base, rope.scale
    elif type(rope) is Llama3RoPE:
        base, scale = 0.0, 1.0
    else:
        return None
    return DecodePlan(
        heads=attention.n_heads,
        kv_heads=attention.n_kv_heads,
        attention_scale=attention.scale,
        rope_dims=rope.dims,
        rope_traditional=rope.traditional,
        rope_base=base,
        rope_scale=scale,
        attention_norm_eps=norms[0].eps,
        mlp_norm_eps=norms[1].eps,
        group_sizes=tuple(m.group_size for m in linears),
        bits=tuple(m.bits for m in linears),
    )


def _fits(plan: DecodePlan, x: mx.array, mask, cache) -> bool:
    """Whether this call is one token over a float32 ``KVCache`` of the block's
    heads, with room."""
    return (
        type(cache) is KVCache
        and mask is None
        and x.shape[:2] == (1, 1)
        and x.dtype == mx.float32
        and cache.keys is not None
        and cache.keys.shape[:2] == (1, plan.kv_heads)
        and cache.offset < cache.keys.shape[2]
        and cache.keys.dtype == cache.values.dtype == mx.float32
        and routed_kernels() is not None
    )


def _decode(block: nn.Module, plan: DecodePlan, x: mx.array, cache: KVCache):
    # The module fast_ops routed to (_fits checked it): load_kernels reads the
    # environment on every call.
    qmm = routed_kernels()
    linears = []
    for part, name in _PROJECTIONS:
        m = block[part][name]
        linears += [m["weight"], m["scales"], m["biases"]]
    rope = block.self_attn.rope
    y, cache.keys, cache.values = qmm.decode_layer(
        x,
        cache.keys,
        cache.values,
        cache.offset,
        block.input_layernorm.weight,
        block.post_attention_layernorm.weight,
        linears,
        rope._freqs if type(rope) is Llama3RoPE else None,
        **plan.arguments,
    )
    cache.offset += 1
    return y


def _routed_call(call):
    def routed(self, x, mask=None, cache=None):
        plan = self.decode_plan
        if plan is None or not _fits(plan, x, mask, cache):
            return call(self, x, mask, cache)
        return _decode(self, plan, x, cache)

    return routed


# The block classes whose call is routed (once per process).
_ROUTED: set[type] = set()


def route_decode_layers(model: nn.Module) -> int:
    """Give ``model``'s blocks that the kernel takes their plan (their decode
    steps then run as one node each); how many."""
    if load_kernels()[0] is None:
        return 0
    routed = 0
    for _, module in model.named_modules():
        plan = decode_plan(module)
        if plan is None:
            continue
        cls = type(module)
        if cls not in _ROUTED:
            _ROUTED.add(cls)
            cls.decode_plan = None
            cls.__call__ = _routed_call(cls.__call__)
        module.decode_plan = plan
        routed += 1
    return routed


def unroute_decode_layers(model: nn.Module) -> None:
    """Back to mlx-lm's calls for ``model``'s blocks (the side by side)."""
    for _, module in model.named_modules():
        if type(module) in BLOCKS:
            module.decode_plan = None
