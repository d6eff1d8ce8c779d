"""How a loaded model runs on this device: on a CPU, quantized weights run on the
SIMD kernels as stored, or (without them) are dequantized to float32 for a fast
BLAS when they fit."""

import dataclasses
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import get_total_parameters

from mlx_backend.cpu.activations import choose_activations
from mlx_backend.cpu.allocator import allocator_in_use
from mlx_backend.cpu.blas import fast_blas_in_use, physical_memory
from mlx_backend.cpu.kernels import kernel_settings, load_kernels, runs_on_kernels
from mlx_backend.switches import switched_off
from mlx_utils import dequantize_to_float32

DEQUANTIZE_ENV = "MLX_BACKEND_DEQUANTIZE"
# On the CPU, attention's softmax dominates long chunks: on a 1000-token prompt,
# chunks of 256 prefill about 9% faster than chunks of 512.
CPU_PREFILL_STEP_SIZE = 256
# The share of physical memory dequantized weights may take by default.
DEQUANTIZE_MEMORY_FRACTION = 0.4


def float32_bytes(model: nn.Module) -> int:
    return get_total_parameters(model) * 4


def dequantize_budget() -> int:
    """The bytes dequantized weights may take by default."""
    return int(physical_memory() * DEQUANTIZE_MEMORY_FRACTION)


def is_quantized(model: nn.Module) -> bool:
    return any(hasattr(m, "bits") for _, m in model.named_modules())


@dataclass(frozen=True)
class ComputePath:
    """How the loaded model runs; shown in the load log, LoadModel and Status."""

    description: str
    fast_blas: bool = False
    # jemalloc (or another malloc) preloaded in place of glibc's.
    fast_allocator: bool = False
    dequantized_bytes: int = 0
    # Prompt tokens per prefill chunk when LoadModel does not set one.
    prefill_step_size: int = CPU_PREFILL_STEP_SIZE
    # The fast BLAS's threads, as it reports them (0: no fast BLAS in use).
    blas_threads: int = 0
    # Batched CPU decode steps are paced (``Pacing``).
    paced: bool = False
    # The SIMD kernels' instruction set ("" when quantized layers don't use them),
    # and their threads.
    kernel_isa: str = ""
    kernel_threads: int = 0
    # The fused kernels' instruction set where mx.fast's operations run on them.
    fast_ops_isa: str = ""

    def breakdown(self) -> dict[str, int]:
        figures = {
            "fast_blas": int(self.fast_blas),
            "fast_allocator": int(self.fast_allocator),
            "dequantized_weights": self.dequantized_bytes,
            "blas_threads": self.blas_threads,
            "cpu_paced": int(self.paced),
            "cpu_kernels": int(bool(self.kernel_isa)),
            "cpu_kernel_threads": self.kernel_threads,
            "cpu_fast_ops": int(bool(self.fast_ops_isa)),
        }
        if self.kernel_isa:
            # Status carries numbers only: the instruction set is in the key.
            figures[f"cpu_kernel_isa_{self.kernel_isa.split()[0]}"] = 1
        return figures

    def extended(self, note: str, **changes) -> "ComputePath":
        """This path with ``note`` added to its description, and ``changes``."""
        return dataclasses.replace(
            self, description=f"{self.description}; {note}", **changes
        )


def prepare_for_cpu(
    model: nn.Module,
    dequantize: bool | None,
    max_bytes: int | None,
    kernels: bool = True,
    activations: str | None = "float32",
) -> tuple[nn.Module, ComputePath]:
    """Pick the fastest correct weight layout for the CPU device.

    Quantized weights stay quantized and run on the SIMD kernels (``cpu/kernels``)
    unless ``dequantize`` is true or ``kernels`` is false; ``activations`` is what
    they multiply the weights with (float32, or x rounded to int16 or int8; auto:
    chosen by measurement, ``cpu/activations.py``; None: as already set, for a
    draft model beside the model). Without the kernels, MLX's
    quantized CPU kernels cost the same per row at any batch size, while a float32
    matmul through a fast BLAS is several times faster for one row and far faster
    for many; so quantized weights are dequantized when they fit the budget.

    Returns:
        The model to use and the path taken. On the kernels' path the caller routes
        the layers (``use_kernels``) once adapters and sharding are applied.
    """
    if mx.default_device().type != mx.cpu:
        return model, ComputePath("GPU, weights as loaded", prefill_step_size=512)
    blas = fast_blas_in_use(os.environ)
    malloc = allocator_in_use(os.environ)
    blas_text = (f"BLAS {blas}" if blas else "MLX's bundled reference BLAS") + (
        f", malloc {malloc}" if malloc else ", glibc's malloc"
    )
    fast = blas is not None
    # The preloaded libraries, in every CPU path.
    libraries = {"fast_blas": fast, "fast_allocator": malloc is not None}
    if not is_quantized(model):
        return model, ComputePath(f"CPU, {blas_text}, unquantized weights", **libraries)
    if switched_off(os.environ, DEQUANTIZE_ENV):
        dequantize = False
    no_kernels = "tensor parallel" if not kernels else load_kernels()[1]
    if not no_kernels and not any(
        runs_on_kernels(m) for _, m in model.named_modules() if hasattr(m, "bits")
    ):
        no_kernels = "no layer in a format they take"
    if not dequantize and not no_kernels:
        qmm = load_kernels()[0]
        # A prompt's many rows go to sgemm tiles only on a fast BLAS: MLX's bundled
        # reference sgemm is far slower than the row kernel.
        qmm.use_sgemm(fast)
        if activations is not None:
            chosen = choose_activations(qmm, model, activations, os.environ)
            kernel_activations = chosen.describe()
        else:
            kernel_activations = f"{qmm.settings()['activations']} activations"
        settings = kernel_settings()
        return model, ComputePath(
            f"CPU, {blas_text}, quantized weights on SIMD kernels ({settings.isa}, "
            f"{settings.threads} threads, {kernel_activations})",
            **libraries,
            kernel_isa=settings.isa,
            kernel_threads=settings.threads,
        )
    budget = max_bytes or dequantize_budget()
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
            f"CPU, {blas_text}, MLX's quantized kernels (SIMD kernels: "
            f"{no_kernels or 'off'}; dequantize: {why})",
            **libraries,
        )
    model = dequantize_to_float32(model)
    mx.eval(model.parameters())
    kernels_text = f"; SIMD kernels: {no_kernels}" if no_kernels else ""
    return model, ComputePath(
        f"CPU, {blas_text}, weights dequantized to float32 ({needed >> 20} MiB)"
        f"{kernels_text}",
        **libraries,
        dequantized_bytes=needed,
    )
