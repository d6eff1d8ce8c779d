"""The CPU quantized-matmul kernels: MLX's affine 4- and 8-bit weights multiplied
as they are stored, with SIMD on several threads (``_qmm``, an MLX extension that
``make install`` builds from the C++ beside this file).

A decode step reads each weight once, so 4-bit weights read an eighth of the bytes
that dequantized float32 weights do. ``use_kernels`` routes a model's quantized
linear layers (and a quantized embedding used as its output layer) to them.
"""

import importlib
import logging
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_backend.cpu.blas import blas_threads, choose_blas_threads, physical_cores
from mlx_backend.switches import switched_off

logger = logging.getLogger(__name__)

KERNELS_ENV = "MLX_BACKEND_CPU_KERNELS"
# Off: MLX's graphs for norms, RoPE, attention, SwiGLU and logsumexp (fast_ops.py),
# and one kernel call per projection (no sibling calls).
FAST_OPS_ENV = "MLX_BACKEND_CPU_FAST_OPS"
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)


# The loaded extension, which the routed layers call.
_qmm = None


def load_kernels():
    """The ``_qmm`` extension and an empty reason, or None and why it can't be used."""
    global _qmm
    if switched_off(os.environ, KERNELS_ENV):
        return None, f"off ({KERNELS_ENV})"
    if mx.default_device() != mx.cpu:
        return None, "not on the CPU"
    try:
        _qmm = importlib.import_module(f"{__name__}._qmm")
    except ImportError as e:
        # The message names files; the type and a hint are enough.
        missing = isinstance(e, ModuleNotFoundError)
        why = "is not built (make install builds it)" if missing else "failed to load"
        return None, f"the kernel extension {why}"
    return _qmm, ""


@dataclass(frozen=True)
class KernelSettings:
    """What runs the kernels, as the extension reports it."""

    isa: str
    threads: int
    # float32, int16 or int8: what the row kernel multiplies the weights with.
    activations: str = "float32"

    def describe(self) -> str:
        return (
            f"SIMD kernels ({self.isa}, {self.threads} threads, "
            f"{self.activations} activations)"
        )


def kernel_settings() -> KernelSettings | None:
    qmm, _ = load_kernels()
    if qmm is None:
        return None
    s = qmm.settings()
    return KernelSettings(s["isa"], s["threads"], s["activations"])


def runs_on_kernels(layer: nn.Module) -> bool:
    """Whether the kernels take ``layer``'s weight format."""
    return (
        getattr(layer, "mode", "affine") == "affine"
        and layer.bits in KERNEL_BITS
        and layer.group_size in KERNEL_GROUP_SIZES
        and "biases" in layer
    )


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul runs on the SIMD kernels."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _qmm.quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            self.group_size,
            self.bits,
        )
        if "bias" in self:
            y = y + self["bias"]
        return y


class _SharedInput:
    """Sibling projections of one input (q, k and v; gate and up): the first to
    see an x computes every sibling's output in one kernel call, the others take
    theirs."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.x = None
        self.outputs = ()
        self.unread = 0
        # Off for good once a call finds the last x's outputs not all taken: this
        # family calls the siblings on different inputs.
        self.on = True

    def output(self, layer: "KernelSiblingLinear", x: mx.array) -> mx.array | None:
        if not self.on:
            return None
        if self.x is not x:
            if self.unread:
                self.on, self.x, self.outputs = False, None, ()
                return None
            first = self.layers[0]
            self.outputs = _qmm.quantized_matmuls(
                x,
                [m["weight"] for m in self.layers],
                [m["scales"] for m in self.layers],
                [m["biases"] for m in self.layers],
                first.group_size,
                first.bits,
            )
            self.x, self.unread = x, len(self.layers)
        y = self.outputs[layer.sibling_index]
        self.unread -= 1
        if self.unread <= 0:
            # Taken by all: don't keep the activations alive until the next call.
            self.x, self.outputs, self.unread = None, (), 0
        return y


class KernelSiblingLinear(KernelQuantizedLinear):
    """A kernel linear layer whose siblings take the same input: one kernel call
    computes them all (``_SharedInput``)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = self.shared_input.output(self, x)
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


# Sibling projections that mlx-lm's families call on the same input, one after
# the other.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def share_inputs(model: nn.Module) -> int:
    """Make each group of ``SIBLINGS`` on the kernels one kernel call; how many
    groups."""
    if switched_off(os.environ, FAST_OPS_ENV):
        return 0
    groups = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            layers = [module.get(name) for name in names]
            if not all(type(m) is KernelQuantizedLinear for m in layers):
                continue
            first = layers[0]
            if any(
                m.bits != first.bits
                or m.group_size != first.group_size
                or m["weight"].shape[1] != first["weight"].shape[1]
                for m in layers
            ):
                continue
            shared = _SharedInput(layers)
            for index, layer in enumerate(layers):
                layer.__class__ = KernelSiblingLinear
                layer.shared_input = shared
                layer.sibling_index = index
            groups += 1
    return groups


def set_shared_inputs(model: nn.Module, on: bool) -> None:
    """Turn ``model``'s sibling calls on or off (the bench's side by side)."""
    for _, module in model.named_modules():
        if isinstance(module, KernelSiblingLinear):
            shared = module.shared_input
            shared.on, shared.x, shared.outputs, shared.unread = on, None, (), 0


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose lookup is one kernel node with float32 rows,
    and the kernels when it is the output layer too (tied weights)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype not in (mx.int32, mx.uint32):
            x = x.astype(mx.int32)
        return _qmm.quantized_rows(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            self.group_size,
            self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return _qmm.quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            self.group_size,
            self.bits,
        )


_KERNEL_CLASSES = {
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
}


def float32_parameters(model: nn.Module) -> None:
    """Cast every floating parameter but quantized layers' scales and biases to
    float32, so activations are float32 as on the dequantized path."""
    quantized = {name for name, m in model.named_modules() if hasattr(m, "bits")}
    cast = []
    for path, value in tree_flatten(model.parameters()):
        owner, _, leaf = path.rpartition(".")
        if owner in quantized and leaf in ("scales", "biases", "weight"):
            continue
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
            cast.append((path, value.astype(mx.float32)))
    if cast:
        model.update(tree_unflatten(cast))


def use_kernels(model: nn.Module) -> int:
    """Route ``model``'s quantized layers that the kernels take to them, in place;
    how many layers now run on them."""
    if load_kernels()[0] is None:
        return 0
    routed = 0
    for _, module in model.named_modules():
        kernel_class = _KERNEL_CLASSES.get(type(module))
        if kernel_class is not None and runs_on_kernels(module):
            module.__class__ = kernel_class
            routed += 1
    if routed:
        float32_parameters(model)
        share_inputs(model)
    return routed


def match_blas_threads(requested: int) -> int:
    """Give the kernels the BLAS's thread count (``Threads``, else the BLAS's own
    variable, else the physical cores); the count, or 0 without the extension."""
    qmm, _ = load_kernels()
    if qmm is None:
        return 0
    threads = blas_threads()
    if threads is None:
        threads, _ = choose_blas_threads(requested, physical_cores(), os.environ)
    if threads is None:
        threads = physical_cores()
    qmm.set_threads(threads)
    return threads
