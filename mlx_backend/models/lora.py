"""LoRA adapters in mlx-lm's folder format, several at once, each with its own scale.

Each adapted linear computes ``base(x) + sum_i scale_i * s_i * (x @ A_i) @ B_i``, where
``s_i`` is ``lora_parameters.scale`` from adapter i's config and ``scale_i`` the scale
it was given here; fusing adds ``sum_i scale_i * s_i * (A_i @ B_i)^T`` to the weight.
A mixture's stacked experts (mlx-lm's ``SwitchLinear``, which ``mlx_lm.lora`` adapts
by default) take one update per expert, as mlx-lm's ``LoRASwitchLinear``.
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from mlx_backend.errors import InvalidArgument
from mlx_backend.refusals import Described, describe_path, read_json

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
ACCEPTED = f"a folder with {CONFIG_FILE} and {WEIGHTS_FILE}, as mlx_lm.lora writes them"
# mlx-lm's fine-tune types, which a refusal may name.
_FINE_TUNE_TYPES = ("lora", "dora", "full")


@dataclass(frozen=True)
class Adapter:
    path: Path
    scale: float = 1.0
    # The LoadModel field that named it ("LoraAdapter", "LoraAdapters[1]"), for errors.
    named_by: str = field(default="", compare=False)


class AdapterError(Described):
    """An adapter can't be applied; the message names the adapter folder and why,
    quoting none of its files (tensor names only when they are the model's own
    modules)."""


class MultiLoRALinear(nn.Module):
    """A linear layer plus the low-rank updates of one or more adapters."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.lora_a: list[mx.array] = []
        self.lora_b: list[mx.array] = []
        # Floats are not parameters: they stay out of tree_flatten(parameters()).
        self.scales: list[float] = []

    def add(self, lora_a: mx.array, lora_b: mx.array, scale: float) -> None:
        self.lora_a.append(lora_a)
        self.lora_b.append(lora_b)
        self.scales.append(scale)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        for a, b, scale in zip(self.lora_a, self.lora_b, self.scales):
            # As mlx-lm's LoRALinear: the update in the adapter's dtype, added in x's.
            y = y + (scale * ((x @ a) @ b)).astype(x.dtype)
        return y

    def fused(self) -> nn.Module:
        """The base linear with every update folded into its weight."""
        base = self.base
        quantized = isinstance(base, nn.QuantizedLinear)
        weight = base.weight
        if quantized:
            mode = getattr(base, "mode", "affine")
            weight = mx.dequantize(
                weight, base.scales, base.biases, base.group_size, base.bits, mode=mode
            )
        updates = zip(self.lora_a, self.lora_b, self.scales)
        delta = sum(scale * (b.T @ a.T) for a, b, scale in updates)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in base)
        linear.weight = weight + delta.astype(weight.dtype)
        if "bias" in base:
            linear.bias = base.bias
        if quantized:
            return nn.QuantizedLinear.from_linear(
                linear, base.group_size, base.bits, mode=mode
            )
        return linear


class MultiLoRASwitchLinear(MultiLoRALinear):
    """A mixture of experts' stacked linears (mlx-lm's ``SwitchLinear``) plus the
    low-rank updates of one or more adapters, one update per expert, as mlx-lm's
    ``LoRASwitchLinear``: lora_a is (experts, rank, inputs), lora_b (experts,
    outputs, rank)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices=False):
        y = self.base(x, indices, sorted_indices=sorted_indices)
        for a, b, scale in zip(self.lora_a, self.lora_b, self.scales):
            z = mx.gather_mm(
                x,
                a.swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            )
            z = mx.gather_mm(
                z,
                b.swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            )
            y = y + (scale * z).astype(x.dtype)
        return y

    def fused(self) -> nn.Module:
        """The base experts with every update folded into their weights."""
        base = self.base
        quantized = isinstance(base, QuantizedSwitchLinear)
        weight = base.weight
        if quantized:
            mode = getattr(base, "mode", "affine")
            biases = getattr(base, "biases", None)  # none in mxfp4 (gpt-oss)
            weight = mx.dequantize(
                weight, base.scales, biases, base.group_size, base.bits, mode=mode
            )
        updates = zip(self.lora_a, self.lora_b, self.scales)
        delta = sum(scale * (b @ a) for a, b, scale in updates)
        experts, outputs, inputs = weight.shape
        switch = SwitchLinear(inputs, outputs, experts, bias="bias" in base)
        switch.weight = weight + delta.astype(weight.dtype)
        if "bias" in base:
            switch.bias = base.bias
        if quantized:
            return switch.to_quantized(base.group_size, base.bits, mode=mode)
        return switch


def linear_dims(module: nn.Module) -> tuple[int, ...] | None:
    """(input dims, output dims) of a linear layer, (experts, input dims, output
    dims) of a mixture's stacked linears; None for any other module."""
    if isinstance(module, MultiLoRALinear):
        module = module.base
    if isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
        return module.num_experts, module.input_dims, module.output_dims
    if isinstance(module, nn.QuantizedLinear):
        # Packed weights: each uint32 holds 32 // bits inputs.
        return module.weight.shape[1] * 32 // module.bits, module.weight.shape[0]
    if isinstance(module, nn.Linear):
        return module.weight.shape[1], module.weight.shape[0]
    return None


def read_adapter(
    adapter: Adapter, modules: dict[str, nn.Module]
) -> tuple[float, dict[str, tuple[mx.array, mx.array]]]:
    """An adapter's overall scale and its (lora_a, lora_b) by layer, checked
    against ``modules`` (the model's, by path)."""
    folder = adapter.path
    field_name = f"{adapter.named_by}: " if adapter.named_by else ""

    def fail(why: str) -> AdapterError:
        return AdapterError(f"{field_name}adapter {folder}: {why}")

    if not folder.exists():
        raise fail("no such folder")
    if not folder.is_dir():
        raise fail(f"{describe_path(folder)}, not a folder; accepted: {ACCEPTED}")
    if not math.isfinite(adapter.scale):
        raise fail(f"scale {adapter.scale} is not a finite number")
    try:
        config = read_json(folder / CONFIG_FILE)
    except Described as e:
        raise fail(str(e)) from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        named = f" {kind}" if kind in _FINE_TUNE_TYPES else ""
        raise fail(
            f"fine_tune_type{named} is not supported; only lora adapters can be "
            "combined"
        )
    own_scale = (config.get("lora_parameters") or {}).get("scale")
    if not isinstance(own_scale, (int, float)) or isinstance(own_scale, bool):
        raise fail(f"{CONFIG_FILE} has no numeric lora_parameters.scale")
    if not (folder / WEIGHTS_FILE).is_file():
        raise fail(f"no {WEIGHTS_FILE}")
    try:
        weights = mx.load(str(folder / WEIGHTS_FILE))
    except Exception as e:  # mx.load raises bare RuntimeError/ValueError
        logger.warning("reading %s failed", folder / WEIGHTS_FILE, exc_info=True)
        raise fail(
            f"{WEIGHTS_FILE} is not a safetensors file MLX reads ({type(e).__name__})"
        ) from e
    if not weights:
        raise fail(f"{WEIGHTS_FILE} holds no tensors")

    # Tensor names are the file's bytes: a message names a layer only when it is
    # one of the model's modules.
    by_layer: dict[str, dict[str, mx.array]] = {}
    for name, w in weights.items():
        layer, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            part = f" for {layer}" if layer in modules else ""
            raise fail(
                f"{WEIGHTS_FILE} holds a tensor{part} that is not a LoRA tensor "
                "(lora_a or lora_b)"
            )
        if layer not in modules:
            raise AdapterError(
                f"{field_name}adapter {folder} does not fit this model: "
                f"{WEIGHTS_FILE} adapts a module the model does not have"
            )
        by_layer.setdefault(layer, {})[leaf] = w
    pairs = {}
    for layer, leaves in sorted(by_layer.items()):
        if len(leaves) < 2:
            missing = "lora_b" if "lora_a" in leaves else "lora_a"
            raise fail(f"{layer} has no {missing}")
        a, b = leaves["lora_a"], leaves["lora_b"]
        misfit = f"{field_name}adapter {folder} does not fit this model: {layer}"
        dims = linear_dims(modules[layer])
        if dims is None:
            found = type(modules[layer]).__name__
            raise AdapterError(f"{misfit} is a {found}, not a linear layer")
        shapes = f"{tuple(a.shape)} and {tuple(b.shape)}"
        if len(dims) == 3:
            # Experts: lora_a (experts, rank, inputs), lora_b (experts, outputs, rank).
            experts, inputs, outputs = dims
            expected = (experts, a.shape[1], inputs), (experts, outputs, a.shape[1])
            if a.ndim != 3 or (tuple(a.shape), tuple(b.shape)) != expected:
                raise AdapterError(
                    f"{misfit} has {experts} experts of {inputs} inputs and "
                    f"{outputs} outputs; lora_a and lora_b have shapes {shapes}"
                )
            pairs[layer] = (a, b)
            continue
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"{misfit}: lora_a and lora_b have shapes {shapes}")
        if a.shape[0] != dims[0]:
            raise AdapterError(
                f"{misfit} takes {dims[0]} inputs, its lora_a has {a.shape[0]} rows"
            )
        if b.shape[1] != dims[1]:
            raise AdapterError(
                f"{misfit} has {dims[1]} outputs, its lora_b has {b.shape[1]} columns"
            )
        pairs[layer] = (a, b)
    return adapter.scale * own_scale, pairs


def apply_adapters(
    model: nn.Module, adapters: Sequence[Adapter], fuse: bool = False
) -> str:
    """Apply LoRA adapters to a loaded model in place, in order.

    Every adapter is read and checked against the model before any layer changes,
    so a failure leaves the model as it was.

    Args:
        model: The model, weights loaded; its linears are ``nn.Linear`` or
            ``nn.QuantizedLinear`` (possibly wrapped by an earlier call).
        adapters: Adapter folders as ``mlx_lm.lora`` writes them, each with the
            scale its update is multiplied by (on top of its config's own scale).
        fuse: Fold the updates into the weights (re-quantizing quantized ones),
            leaving plain linears; otherwise wrap each adapted linear.

    Returns:
        A short description for logs, e.g. ``"2 LoRA adapters, fused"``.

    Raises:
        AdapterError: An adapter is missing, malformed, not a LoRA adapter, or
            does not fit the model's layers.
    """
    modules = dict(model.named_modules())
    checked = [(adapter, *read_adapter(adapter, modules)) for adapter in adapters]

    wrappers: dict[str, MultiLoRALinear] = {}
    for adapter, scale, pairs in checked:
        for layer, (a, b) in pairs.items():
            if layer not in wrappers:
                module = modules[layer]
                if isinstance(module, MultiLoRALinear):
                    wrappers[layer] = module
                elif isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
                    wrappers[layer] = MultiLoRASwitchLinear(module)
                else:
                    wrappers[layer] = MultiLoRALinear(module)
            wrappers[layer].add(a, b, scale)
        logger.info(
            "LoRA adapter %s: %d linears, scale %g", adapter.path, len(pairs), scale
        )
    if fuse:
        # Wrappers left by an earlier unfused call are folded in as well.
        for name, module in modules.items():
            if isinstance(module, MultiLoRALinear):
                wrappers.setdefault(name, module)
    for layer, wrapper in wrappers.items():
        # One layer at a time, so a fused model's old weights are freed as we go.
        new = wrapper.fused() if fuse else wrapper
        mx.eval(new.parameters())
        model.update_modules(tree_unflatten([(layer, new)]))

    count = len(adapters)
    noun = "adapter" if count == 1 else "adapters"
    return f"{count} LoRA {noun}" + (", fused" if fuse else "")


def check_adapters(model: nn.Module, adapters: Sequence[Adapter]) -> None:
    """Raise AdapterError if any adapter can't be applied to ``model``, whose
    weights may still be lazy; the model is left as it is."""
    modules = dict(model.named_modules())
    for adapter in adapters:
        read_adapter(adapter, modules)


def make_adapters(
    adapter: str,
    scale: float,
    adapters: Sequence[str],
    scales: Sequence[float],
    model_path: str,
) -> tuple[Adapter, ...]:
    """LoadModel's ``LoraAdapter`` / ``LoraScale`` and ``LoraAdapters`` /
    ``LoraScales`` as adapters, relative folders taken under ``ModelPath``.

    An unset ``LoraScale`` (0) is 1; ``LoraScales`` pairs with ``LoraAdapters``
    in order, and an adapter without a scale there gets 1.
    """
    if len(scales) > len(adapters):
        raise InvalidArgument(
            f"LoraScales: {len(scales)} scales for {len(adapters)} LoraAdapters"
        )
    named = [(adapter, scale or 1.0, "LoraAdapter")] if adapter else []
    named += [
        (path, scales[i] if i < len(scales) else 1.0, f"LoraAdapters[{i}]")
        for i, path in enumerate(adapters)
    ]
    made = []
    for path, value, named_by in named:
        folder = Path(path).expanduser()
        if not folder.is_absolute() and model_path:
            folder = Path(model_path) / folder
        made.append(Adapter(folder, value, named_by))
    return tuple(made)
