"""The fast BLAS of the Linux CPU path: found, preloaded by the re-exec of
``preload.py`` before MLX loads, and given its thread count."""

import ctypes
import logging
import os
import sys
from pathlib import Path

import mlx.core as mx

from mlx_backend.cpu.preload import (
    find_library,
    library_in_use,
    library_to_preload,
    with_preload,
    without_preload,
)

logger = logging.getLogger(__name__)

FAST_BLAS_ENV = "MLX_BACKEND_FAST_BLAS"
# The host's pacing for models whose cpu_pacing is auto: pacing suits a CPU, not a model.
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
    return library_in_use(environ, FAST_BLAS_ENV)


def find_fast_blas(choice: str = "auto", candidates=FAST_BLAS_CANDIDATES) -> str | None:
    """The fast BLAS library to preload, or None when there is none.

    Args:
        choice: ``auto`` (the first family found), a family name (``mkl``,
          ``openblas``) or the path of a library.
        candidates: Library paths by family, in order of preference.

    Raises:
        ValueError: ``choice`` is neither a family nor a path.
    """
    return find_library(choice, candidates, FAST_BLAS_ENV)


def preload_environment(environ, library: str) -> dict:
    """``environ`` with ``library`` preloaded, so MLX binds its BLAS calls to it."""
    return with_preload(environ, library, FAST_BLAS_ENV)


def blas_choice_environment(environ, choice: str) -> dict:
    """``environ`` for a child process that picks its BLAS by ``choice`` afresh.

    The library this process preloaded is dropped from ``LD_PRELOAD``, so a child
    started with ``off`` really runs MLX's bundled BLAS.
    """
    return without_preload(environ, FAST_BLAS_ENV, choice)


def fast_blas_to_preload(environ) -> str | None:
    """The fast BLAS a process started with ``environ`` should preload, or None:
    off, already preloaded, not Linux CPU, or none installed (logged).

    ``MLX_BACKEND_FAST_BLAS`` picks it: ``auto`` (default: MKL, then OpenBLAS),
    ``mkl``, ``openblas``, a library path, or ``off`` for MLX's bundled reference
    BLAS.
    """
    return library_to_preload(
        environ,
        FAST_BLAS_ENV,
        FAST_BLAS_CANDIDATES,
        "fast BLAS",
        f"the CPU path stays slow. For full speed: {FAST_BLAS_INSTALL} (or 'make "
        "install' as root)",
    )


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


def apply_blas_threads(requested: int, shared: bool) -> str:
    """Cap the fast BLAS's threads for a model (``requested``: ``Threads``, 0 for
    the default); what was set, for the load message. Empty when nothing was: on a
    GPU, without a fast BLAS, or for 0 when ranks of a group share the cores
    (``share_cores`` capped them)."""
    if mx.default_device() != mx.cpu or (shared and not requested):
        return ""
    threads, why = choose_blas_threads(requested, physical_cores(), os.environ)
    if threads is None:
        threads = blas_threads()
    elif not set_blas_threads(threads):
        return ""
    logger.info("BLAS threads: %s (%s)", threads, why)
    return f"{threads} BLAS threads ({why})"


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
