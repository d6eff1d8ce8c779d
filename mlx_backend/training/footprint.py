"""A training job's memory, estimated before its first step from the model as it
will train and the dataset's longest batch, and checked against what the device
has free: a job that cannot fit fails with the numbers instead of being killed
mid-step. On Linux and CUDA the free memory is read system- or device-wide, so the
serving process's use is counted; on Metal, only this process's."""

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_backend.cpu.blas import physical_memory
from mlx_backend.errors import ResourceExhausted

# Bytes of one activation value: float32 (an upper bound where training runs in
# bfloat16 on a GPU).
ACTIVATION_BYTES = 4
# Copies of the logits the backward pass holds: the logits, the softmax and
# their gradient.
LOGIT_COPIES = 3
# A trainable weight's gradient and the optimizer's two moments (Adam, AdamW).
OPTIMIZER_COPIES = 3
# The share of the device's memory a job may take where the free memory cannot be read.
UNREAD_FRACTION = 0.8
EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)


@dataclass(frozen=True)
class Footprint:
    """A job's memory, by part."""

    weights: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.activations

    def describe(self) -> str:
        return (
            f"{self.total >> 20} MiB: weights {self.weights >> 20} MiB, gradients "
            f"and optimizer state {self.optimizer >> 20} MiB, activations "
            f"{self.activations >> 20} MiB"
        )


def _linear_width(module: nn.Module) -> int:
    """Inputs plus outputs of a linear layer: what its backward pass keeps per token."""
    if isinstance(module, nn.QuantizedLinear):
        out_features = module.weight.shape[0]
        return out_features + module.scales.shape[-1] * module.group_size
    if isinstance(module, nn.Linear):
        return sum(module.weight.shape[-2:])
    return 0


def estimate(
    model: nn.Module, rows: int, tokens: int, checkpointing: bool
) -> Footprint:
    """The memory of training ``model`` on batches of ``rows`` sequences of up
    to ``tokens`` tokens."""
    modules = [m for _, m in model.named_modules()]
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    trainable = sum(a.nbytes for _, a in tree_flatten(model.trainable_parameters()))
    widths = sum(_linear_width(m) for m in modules)
    # Every attention layer's scores and probabilities, per row.
    scores = (
        2 * tokens * tokens * sum(m.n_heads for m in modules if hasattr(m, "n_heads"))
    )
    embeddings = [m for m in modules if isinstance(m, EMBEDDINGS)]
    vocab = max((m.weight.shape[0] for m in embeddings), default=0)
    if checkpointing:
        # One block's activations at a time, and each block's input.
        blocks = max(len(model.layers), 1)
        hidden = max((_dims(m) for m in embeddings), default=0)
        widths = widths // blocks + blocks * hidden
        scores //= blocks
    per_row = tokens * (widths + LOGIT_COPIES * vocab) + scores
    return Footprint(
        weights, OPTIMIZER_COPIES * trainable, rows * per_row * ACTIVATION_BYTES
    )


def _dims(embedding: nn.Module) -> int:
    if isinstance(embedding, nn.QuantizedEmbedding):
        return embedding.scales.shape[-1] * embedding.group_size
    return embedding.weight.shape[1]


def free_bytes() -> tuple[int, str]:
    """The memory free for this process to grow into, and where it was read."""
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        if "free_memory" in info:
            # CUDA reads it device-wide: serving's use is already out of it.
            return int(info["free_memory"]), "the GPU's free memory"
        # Metal: the working set less this process's own use.
        total = info.get("max_recommended_working_set_size") or physical_memory()
        return int(total) - mx.get_active_memory(), "the recommended working set"
    if sys.platform == "linux":
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the system's available memory"
    share = int(physical_memory() * UNREAD_FRACTION)
    return share - mx.get_active_memory(), f"{UNREAD_FRACTION:.0%} of the memory"


def check_fits(footprint: Footprint, held: int) -> None:
    """Refuse a job whose memory still to come (beyond the ``held`` bytes of
    weights already loaded) exceeds what is free."""
    free, where = free_bytes()
    coming = footprint.total - held
    if coming > free:
        raise ResourceExhausted(
            f"the job needs about {footprint.describe()}; beyond the weights loaded, "
            f"{coming >> 20} MiB more, and {free >> 20} MiB are free ({where}); "
            "lower batch_size, shorten the examples, set gradient_checkpointing or "
            "train LoRA instead of full"
        )
