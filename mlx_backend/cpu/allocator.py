"""The malloc of the Linux CPU path: jemalloc, preloaded by the re-exec of
``preload.py`` in place of glibc's.

MLX's CPU backend allocates each node's output with malloc, and a decode step has
about 24 nodes a layer. The thread that builds and submits a step allocates the
nodes' bookkeeping, and the CPU stream's thread frees it. glibc's per-thread cache
refills only from the thread's own frees, so each of those allocations goes through
its arena's bins (with ``malloc_consolidate`` passes). With jemalloc the default
model decodes about 15-30% faster here (``bench/RESULTS.md``).
"""

import logging

from mlx_backend.cpu.preload import find_library, library_in_use, library_to_preload

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = "MLX_BACKEND_ALLOCATOR"
ALLOCATOR_CANDIDATES = {
    "jemalloc": (
        "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",  # Debian's libjemalloc2
        "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
        "/usr/lib64/libjemalloc.so.2",
        "/usr/lib/libjemalloc.so.2",
    ),
    "tcmalloc": (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib64/libtcmalloc_minimal.so.4",
    ),
}
ALLOCATOR_INSTALL = "apt-get install libjemalloc2"


def allocator_in_use(environ) -> str | None:
    """The malloc library this process runs with (preloaded by the restart)."""
    return library_in_use(environ, ALLOCATOR_ENV)


def find_allocator(choice: str = "auto", candidates=ALLOCATOR_CANDIDATES) -> str | None:
    """The malloc library to preload, or None when there is none.

    Args:
        choice: ``auto`` (jemalloc, then tcmalloc), a family name or the path of a
          library.
        candidates: Library paths by family, in order of preference.

    Raises:
        ValueError: ``choice`` is neither a family nor a path.
    """
    return find_library(choice, candidates, ALLOCATOR_ENV)


def allocator_to_preload(environ) -> str | None:
    """The malloc a process started with ``environ`` should preload, or None: off,
    already preloaded, not Linux CPU, or none installed (logged).

    ``MLX_BACKEND_ALLOCATOR`` picks it: ``auto`` (default), ``jemalloc``,
    ``tcmalloc``, a library path, or ``off`` for glibc's malloc.
    """
    return library_to_preload(
        environ,
        ALLOCATOR_ENV,
        ALLOCATOR_CANDIDATES,
        "jemalloc",
        "decoding on the CPU runs on glibc's malloc, about a fifth slower. For "
        f"full speed: {ALLOCATOR_INSTALL} (or 'make install' as root)",
    )
