"""The Linux CPU path: a fast BLAS found and preloaded by a re-exec, quantized
weights dequantized when that is faster, and the step pacing of a CPU decode."""

import ctypes
import importlib.metadata
import logging
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import get_total_parameters

from mlx_backend.errors import FailedPrecondition
from mlx_utils import dequantize_to_float32
from python_utils import CPU_PACING_MODES, switched_off

logger = logging.getLogger(__name__)

FAST_BLAS_ENV = "MLX_BACKEND_FAST_BLAS"
# The host's pacing for models whose cpu_pacing is auto: pacing suits a CPU, not a model.
CPU_PACING_ENV = "MLX_BACKEND_CPU_PACING"
# Fast BLAS libraries by family, in order of preference. MKL's sgemm is about twice
# OpenBLAS 0.3.21's for the one-row products of decoding (measured on x86_64).
FAST_BLAS_CANDIDATES = {
    "mkl": (
        f"{sys.prefix}/lib/libmkl_rt.so.3",  # PyPI `mkl` (requirements-cpu.txt)
        "/usr/lib/x86_64-linux-gnu/libmkl_rt.so",
    ),
    "openblas": (
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
    ),
}
FAST_BLAS_INSTALL = (
    "pip install -r requirements-cpu.txt (MKL, x86_64) "
    "or apt-get install libopenblas0-pthread"
)


def fast_blas_in_use(environ) -> str | None:
    """The fast BLAS this process runs with (preloaded by backend.py's restart)."""
    library = environ.get(FAST_BLAS_ENV, "")
    preloaded = environ.get("LD_PRELOAD", "").split()
    return library if library.startswith("/") and library in preloaded else None


def find_fast_blas(choice: str = "auto", candidates=FAST_BLAS_CANDIDATES) -> str | None:
    """The fast BLAS library to preload, or None when there is none.

    Args:
        choice: ``auto`` (the first family found), a family name (``mkl``,
          ``openblas``) or the path of a library.
        candidates: Library paths by family, in order of preference.

    Raises:
        ValueError: ``choice`` is neither a family nor a path.
    """
    choice = choice.strip() or "auto"
    if choice.startswith("/"):
        paths = (choice,)
    elif (choice := choice.lower()) == "auto":
        paths = tuple(p for family in candidates.values() for p in family)
    elif choice in candidates:
        paths = candidates[choice]
    else:
        names = ", ".join(["auto", "off", *candidates, "a library path"])
        raise ValueError(f"{FAST_BLAS_ENV}={choice!r}: expected one of {names}")
    return next((path for path in paths if Path(path).exists()), None)


def preload_environment(environ, library: str) -> dict:
    """``environ`` with ``library`` preloaded, so MLX binds its BLAS calls to it."""
    preload = [p for p in environ.get("LD_PRELOAD", "").split() if p]
    if library not in preload:
        preload.insert(0, library)
    return {**environ, "LD_PRELOAD": " ".join(preload), FAST_BLAS_ENV: library}


def blas_choice_environment(environ, choice: str) -> dict:
    """``environ`` for a child process that picks its BLAS by ``choice`` afresh.

    The library this process preloaded is dropped from ``LD_PRELOAD``, so a child
    started with ``off`` really runs MLX's bundled BLAS.
    """
    library = fast_blas_in_use(environ)
    preload = [p for p in environ.get("LD_PRELOAD", "").split() if p != library]
    return {**environ, "LD_PRELOAD": " ".join(preload), FAST_BLAS_ENV: choice}


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def fast_blas_to_preload(environ) -> str | None:
    """The fast BLAS a process started with ``environ`` should preload, or None:
    off, already preloaded, not Linux CPU, or none installed (logged).

    ``MLX_BACKEND_FAST_BLAS`` picks it: ``auto`` (default: MKL, then OpenBLAS),
    ``mkl``, ``openblas``, a library path, or ``off`` for MLX's bundled reference
    BLAS.
    """
    if sys.platform != "linux" or switched_off(environ, FAST_BLAS_ENV):
        return None
    if fast_blas_in_use(environ):
        return None  # already preloaded
    if (
        not _installed("mlx-cpu")
        or _installed("mlx-cuda-12")
        or _installed("mlx-cuda-13")
    ):
        return None  # CUDA builds do their matmuls on the GPU
    choice = environ.get(FAST_BLAS_ENV, "auto")
    try:
        library = find_fast_blas(choice)
    except ValueError as e:
        logger.warning("%s; using auto", e)
        library = find_fast_blas()
    if library is None:
        logger.warning(
            "no fast BLAS found for %s=%s: the CPU path stays slow. "
            "For full speed: %s (or 'make install' as root)",
            FAST_BLAS_ENV,
            choice,
            FAST_BLAS_INSTALL,
        )
    return library


def maybe_reexec_with_fast_blas() -> None:
    """On Linux CPU, restart once with a fast BLAS preloaded in place of MLX's own.

    MLX binds its BLAS at load time, so the choice has to be made before it loads.
    """
    library = fast_blas_to_preload(os.environ)
    if library is None:
        return
    logger.info("restarting with %s preloaded for MLX's matmuls", library)
    os.execve(
        sys.executable,
        sys.orig_argv,
        preload_environment(os.environ, library),
    )


DEQUANTIZE_ENV = "MLX_BACKEND_DEQUANTIZE"
# On the CPU, attention's softmax dominates long chunks: on a 1000-token prompt,
# chunks of 256 prefill about 9% faster than chunks of 512.
CPU_PREFILL_STEP_SIZE = 256
# The share of physical memory dequantized weights may take by default.
DEQUANTIZE_MEMORY_FRACTION = 0.4


# How each fast BLAS family sets and reads its thread count.
_THREAD_CALLS = (
    ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


def _blas_thread_calls():
    library = fast_blas_in_use(os.environ)
    if library is None:
        return None
    blas = ctypes.CDLL(library)
    for setter, getter in _THREAD_CALLS:
        if hasattr(blas, setter):
            return getattr(blas, setter), getattr(blas, getter)
    return None


def set_blas_threads(count: int) -> bool:
    """Cap the fast BLAS at ``count`` threads; False without a fast BLAS."""
    calls = _blas_thread_calls()
    if calls is None:
        return False
    calls[0](ctypes.c_int(count))
    return True


def blas_threads() -> int | None:
    """The fast BLAS's thread count, as the library reports it."""
    calls = _blas_thread_calls()
    return None if calls is None else int(calls[1]())


def physical_cores() -> int:
    """The physical cores this process may run on: hyperthreads share a core's
    floating-point units, so a BLAS thread per logical CPU only adds contention."""
    allowed = os.sched_getaffinity(0)
    cores = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(allowed)
        cores.add((package, core))
    return max(1, len(cores))


BLAS_THREAD_ENV = ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def choose_blas_threads(requested: int, cores: int, environ) -> tuple[int | None, str]:
    """The BLAS thread count and why: ``ModelOptions.Threads`` when set, else
    None when the environment sets the BLAS's own variable, else the physical cores."""
    if requested > 0:
        return requested, "Threads"
    for name in BLAS_THREAD_ENV:
        if environ.get(name, "").strip():
            return None, name
    return cores, "physical cores"


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


def pace_step(tokens: mx.array, logits: mx.array) -> mx.array:
    """A logits processor that runs the step's forward pass to its end before the
    rest of the step's graph is built.

    The Python thread then builds no graphs while the cores run the matmuls. Whether
    that pays depends on the machine: a 2-core Intel Xeon decoded 15% faster with
    it and a 2-core AMD EPYC 9-25% slower, so ``choose_pacing`` decides by
    measuring.
    """
    mx.eval(logits)
    return logits


# Unpaced steps must beat paced ones by this share to be kept: what overlapping
# costs comes in spells that a short measurement can miss (on a 2-core Xeon, 5 of
# 18 loads measured a tie or unpaced faster, where 150-token runs were 6-35% faster
# paced), and what it gains shows in every step.
PACING_MARGIN = 0.05


def mean_speeds(rounds: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The mean paced and unpaced tokens/s over measured (paced, unpaced) rounds."""
    paced, unpaced = zip(*rounds)
    return statistics.fmean(paced), statistics.fmean(unpaced)


@dataclass(frozen=True)
class Pacing:
    """Whether batched CPU decode steps are paced (``pace_step``), and why; shown
    in the load log, LoadModel and Status."""

    paced: bool
    # What decided: the option, a measurement, or why there was none.
    reason: str
    # One stream's tokens/s in each measured round: (paced, unpaced).
    rounds: tuple[tuple[float, float], ...] = ()

    def describe(self) -> str:
        text = f"CPU pacing {'on' if self.paced else 'off'} ({self.reason}"
        if self.rounds:
            paced, unpaced = mean_speeds(self.rounds)
            text += f": tok/s paced {paced:.1f}, unpaced {unpaced:.1f}"
            if len(self.rounds) > 1:
                ratios = ", ".join(f"{p / u:.2f}" for p, u in self.rounds)
                text += f"; paced/unpaced by round {ratios}"
        return text + ")"


def pacing_setting(option: str, environ) -> tuple[str, str]:
    """The pacing mode and what set it: the option when it says on or off, else
    the host's ``MLX_BACKEND_CPU_PACING``, else ``auto``."""
    if option != "auto":
        return option, f"cpu_pacing:{option}"
    host = environ.get(CPU_PACING_ENV, "").strip().lower() or "auto"
    if host not in CPU_PACING_MODES:
        raise FailedPrecondition(
            f"{CPU_PACING_ENV} must be one of {', '.join(CPU_PACING_MODES)}, "
            f"not {host!r}"
        )
    return host, "auto" if host == "auto" else f"{CPU_PACING_ENV}={host}"


def choose_pacing(option: str, rounds: Sequence[tuple[float, float]] = ()) -> Pacing:
    """Pacing as the option ``cpu_pacing`` sets it, or for ``auto`` as measured:
    unpaced only when the unpaced mean speed beats the paced one by
    ``PACING_MARGIN``, or when nothing was measured.

    Args:
        option: ``on``, ``off`` or ``auto``.
        rounds: One stream's tokens/s per measured round, (paced, unpaced).
    """
    if option != "auto":
        return Pacing(option == "on", f"cpu_pacing:{option}")
    if not rounds:
        return Pacing(False, "auto, not measured")
    paced, unpaced = mean_speeds(rounds)
    return Pacing(
        unpaced <= paced * (1 + PACING_MARGIN), "auto, measured", tuple(rounds)
    )


if __name__ == "__main__":
    # `make test`: the environment that runs MLX inside pytest on the fast BLAS.
    preload = fast_blas_to_preload(os.environ)
    if preload:
        changed = preload_environment(os.environ, preload)
        sys.stdout.write(
            f"LD_PRELOAD={changed['LD_PRELOAD']} {FAST_BLAS_ENV}={preload}\n"
        )
