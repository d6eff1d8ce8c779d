"""How a loaded model runs on this device: on a CPU with a fast BLAS, quantized
weights are dequantized to float32 when that is faster and they fit."""

import dataclasses
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import get_total_parameters

from mlx_backend.cpu.blas import fast_blas_in_use, physical_memory
from mlx_utils import dequantize_to_float32
from python_utils import switched_off

DEQUANTIZE_ENV = "MLX_BACKEND_DEQUANTIZE"
# On the CPU, attention's softmax dominates long chunks: on a 1000-token prompt,
# chunks of 256 prefill about 9% faster than chunks of 512.
CPU_PREFILL_STEP_SIZE = 256
# The share of physical memory dequantized weights may take by default.
DEQUANTIZE_MEMORY_FRACTION = 0.4


def float32_bytes(model: nn.Module) -> int:
    return get_total_parameters(model) * 4


def is_quantized(model: nn.Module) -> bool:
    return any(hasattr(m, "bits") for _, m in model.named_modules())


@dataclass(frozen=True)
class ComputePath:
    """How the loaded model runs; shown in the load log, LoadModel and Status."""

    description: str
    fast_blas: bool = False
    dequantized_bytes: int = 0
    # Prompt tokens per prefill chunk when LoadModel does not set one.
    prefill_step_size: int = CPU_PREFILL_STEP_SIZE
    # The fast BLAS's threads, as it reports them (0: no fast BLAS in use).
    blas_threads: int = 0
    # Batched CPU decode steps are paced (``Pacing``).
    paced: bool = False

    def breakdown(self) -> dict[str, int]:
        return {
            "fast_blas": int(self.fast_blas),
            "dequantized_weights": self.dequantized_bytes,
            "blas_threads": self.blas_threads,
            "cpu_paced": int(self.paced),
        }

    def extended(self, note: str, **changes) -> "ComputePath":
        """This path with ``note`` added to its description, and ``changes``."""
        return dataclasses.replace(
            self, description=f"{self.description}; {note}", **changes
        )


def prepare_for_cpu(
    model: nn.Module, dequantize: bool | None, max_bytes: int | None
) -> tuple[nn.Module, ComputePath]:
    """Pick the fastest correct weight layout for the CPU device.

    MLX's quantized CPU kernels cost the same per row at any batch size, while a
    float32 matmul through a fast BLAS is several times faster for one row and far
    faster for many. So quantized weights are dequantized when they fit the budget.

    Returns:
        The model to use and the path taken.
    """
    if mx.default_device().type != mx.cpu:
        return model, ComputePath("GPU, weights as loaded", prefill_step_size=512)
    blas = fast_blas_in_use(os.environ)
    blas_text = f"BLAS {blas}" if blas else "MLX's bundled reference BLAS"
    fast = blas is not None
    if not is_quantized(model):
        return model, ComputePath(f"CPU, {blas_text}, unquantized weights", fast)
    if switched_off(os.environ, DEQUANTIZE_ENV):
        dequantize = False
    budget = max_bytes or int(physical_memory() * DEQUANTIZE_MEMORY_FRACTION)
    needed = float32_bytes(model)
    if dequantize is None:
        dequantize = blas is not None and needed <= budget
    if not dequantize:
        if blas is None:
            why = "no fast BLAS"
        elif needed > budget:
            why = f"{needed} bytes over the budget of {budget}"
        else:
            why = "off"
        return model, ComputePath(
            f"CPU, {blas_text}, quantized kernels (dequantize: {why})", fast
        )
    model = dequantize_to_float32(model)
    mx.eval(model.parameters())
    return model, ComputePath(
        f"CPU, {blas_text}, weights dequantized to float32 ({needed >> 20} MiB)",
        fast,
        needed,
    )
