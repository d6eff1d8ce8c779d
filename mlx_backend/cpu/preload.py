"""The libraries the Linux CPU path preloads: a fast BLAS (``blas.py``) and a
malloc (``allocator.py``), found, then put in ``LD_PRELOAD`` by one re-exec before
MLX loads (it binds its BLAS, and the process its malloc, at load time).

Run as ``python -m mlx_backend.cpu.preload``, it prints the environment that runs
MLX on them in another process (the test suite's).
"""

import importlib.metadata
import logging
import os
import re
import sys
from pathlib import Path

from mlx_backend.switches import switched_off

logger = logging.getLogger(__name__)


def preloaded(environ) -> list[str]:
    """``LD_PRELOAD``'s libraries (the dynamic loader takes colons or spaces)."""
    return [p for p in re.split(r"[:\s]+", environ.get("LD_PRELOAD", "")) if p]


def library_in_use(environ, switch: str) -> str | None:
    """The library that ``switch`` chose and this process preloads (after the
    restart), or None."""
    library = environ.get(switch, "")
    return (
        library if library.startswith("/") and library in preloaded(environ) else None
    )


def find_library(choice: str, candidates: dict, switch: str) -> str | None:
    """The first existing library for ``choice``: ``auto`` (any family, in order),
    a family of ``candidates`` or a path; None when none exists.

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
        raise ValueError(f"{switch}={choice!r}: expected one of {names}")
    return next((path for path in paths if Path(path).exists()), None)


def with_preload(environ, library: str, switch: str) -> dict:
    """``environ`` with ``library`` preloaded and named by ``switch``. Colons
    separate the libraries, so that ``env $(...)`` takes the list as one word."""
    preload = preloaded(environ)
    if library not in preload:
        preload.insert(0, library)
    return {**environ, "LD_PRELOAD": ":".join(preload), switch: library}


def without_preload(environ, switch: str, choice: str) -> dict:
    """``environ`` for a child process that picks ``switch``'s library by
    ``choice`` afresh: the one this process preloaded leaves ``LD_PRELOAD``, so a
    child started with ``off`` really runs without it."""
    library = library_in_use(environ, switch)
    preload = [p for p in preloaded(environ) if p != library]
    return {**environ, "LD_PRELOAD": ":".join(preload), switch: choice}


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def linux_cpu_build() -> bool:
    """Whether MLX is its Linux CPU build (the CUDA builds compute on the GPU)."""
    return (
        sys.platform == "linux"
        and _installed("mlx-cpu")
        and not (_installed("mlx-cuda-12") or _installed("mlx-cuda-13"))
    )


def library_to_preload(
    environ, switch: str, candidates: dict, what: str, missing: str
) -> str | None:
    """The library of ``candidates`` (``what``, in words) a process started with
    ``environ`` should preload by ``switch``'s choice, or None: off, already
    preloaded, not Linux CPU, or none installed (logged with ``missing``: what
    goes slower, and what to install)."""
    if switched_off(environ, switch) or library_in_use(environ, switch):
        return None
    if not linux_cpu_build():
        return None  # CUDA builds compute on the GPU
    choice = environ.get(switch, "auto")
    try:
        library = find_library(choice, candidates, switch)
    except ValueError as e:
        logger.warning("%s; using auto", e)
        library = find_library("auto", candidates, switch)
    if library is None:
        logger.warning("no %s found for %s=%s: %s", what, switch, choice, missing)
    return library


def _preloads():
    """(switch, what, the library a process started with an environment should
    preload) for each library: the allocator goes first in ``LD_PRELOAD``."""
    from mlx_backend.cpu.allocator import ALLOCATOR_ENV, allocator_to_preload
    from mlx_backend.cpu.blas import FAST_BLAS_ENV, fast_blas_to_preload

    return (
        (FAST_BLAS_ENV, "MLX's matmuls", fast_blas_to_preload),
        (ALLOCATOR_ENV, "malloc", allocator_to_preload),
    )


def preloaded_environment(environ) -> dict:
    """``environ`` with the allocator and the fast BLAS that a process started with
    it should preload (unchanged where there is none to add)."""
    environ = dict(environ)
    for switch, _, choose in _preloads():
        library = choose(environ)
        if library is None:
            continue
        changed = with_preload(environ, library, switch)
        # A path the loader's list cannot hold (a colon or a space in it) would
        # never read as preloaded, and each start would restart again.
        if library_in_use(changed, switch) != library:
            logger.warning(
                "%s=%r: a path with a colon or a space can't be preloaded; "
                "skipped (set it to a path without them, or to off)",
                switch,
                library,
            )
            continue
        environ = changed
    return environ


def maybe_reexec_with_preloads() -> None:
    """On Linux CPU, restart once with jemalloc and a fast BLAS preloaded, where
    they are installed and not preloaded yet."""
    environ = preloaded_environment(os.environ)
    if environ == dict(os.environ):
        return
    for switch, what, _ in _preloads():
        if environ.get(switch) != os.environ.get(switch):
            logger.info("restarting with %s preloaded for %s", environ[switch], what)
    os.execve(sys.executable, sys.orig_argv, environ)


if __name__ == "__main__":
    # `make test`: the environment that runs MLX inside pytest with the preloads.
    changed = preloaded_environment(os.environ)
    sys.stdout.write(
        " ".join(
            f"{name}={changed[name]}"
            for name in changed
            if changed[name] != os.environ.get(name)
        )
        + "\n"
    )
