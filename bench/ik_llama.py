"""ik_llama.cpp on the same GGUF and thread count, as part 13's second reference.

It has no release on a package registry, so it is built from a git snapshot of
its repository: ``IK_LLAMA_GIT`` (a git directory), else the snapshot the tool
library fetches (``/work/.mirror/ikawrakow+ik_llama.cpp/repo``). Its tree is
checked out less the files whose contents the snapshot lacks (the server's web
assets, which nothing here builds) into ``bench-results/ik_llama.cpp/``, and
built for this CPU's instruction sets as ``bench.llama_cpp`` builds llama.cpp. The tools are llama.cpp's (``llama-bench``, ``llama-batched-bench``), so
``bench.llama_cpp.LlamaCpp`` measures them. Anything that fails skips the row
with the reason.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

from bench.llama_cpp import LlamaCpp, built, compile_tools, isa_flags

logger = logging.getLogger(__name__)

GIT_ENV = "IK_LLAMA_GIT"
MIRROR = Path("/work/.mirror/ikawrakow+ik_llama.cpp/repo")
FOLDER = Path("bench-results/ik_llama.cpp")


def snapshot() -> Path | None:
    """The git directory to build from, if there is one."""
    given = os.environ.get(GIT_ENV)
    path = Path(given) if given else MIRROR
    return path if path.exists() else None


def check_out(git: Path, folder: Path, out) -> str | None:
    """The snapshot's tree into ``folder / "source"`` less the files whose
    contents it lacks (the server's web assets); why not, if it fails."""
    listing = subprocess.run(
        ["git", f"--git-dir={git}", "ls-tree", "-r", "HEAD"],
        capture_output=True, text=True,
    )  # fmt: skip
    if listing.returncode:
        return f"reading its snapshot {git} failed"
    entries = [line.split(None, 3) for line in listing.stdout.splitlines()]
    blobs = [e for e in entries if e[1] == "blob"]
    checked = subprocess.run(
        ["git", f"--git-dir={git}", "cat-file", "--batch-check"],
        input="".join(f"{e[2]}\n" for e in blobs), capture_output=True, text=True,
    )  # fmt: skip
    missing = [e[3] for e, line in zip(blobs, checked.stdout.splitlines())
               if line.endswith("missing")]  # fmt: skip
    (folder / "source").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GIT_INDEX_FILE": str(folder / "index")}
    git_ = ["git", f"--git-dir={git}", f"--work-tree={folder / 'source'}"]
    steps = [
        [*git_, "read-tree", "HEAD"],
        [*git_, "update-index", "--force-remove", "--", *missing],
        [*git_, "checkout-index", "-a", f"--prefix={folder / 'source'}/"],
    ]
    for step in steps:
        if subprocess.run(step, env=env, stdout=out, stderr=out).returncode:
            return f"checking out its snapshot {git} failed"
    return None


def build(model: str, threads: int, folder: Path = FOLDER) -> LlamaCpp | str:
    """ik_llama.cpp's tools built for this CPU (reused once built), or why not."""
    tools, ready = built(folder, model, threads)
    if ready:
        return tools
    folder = folder.resolve()
    git = snapshot()
    if git is None:
        return f"no snapshot of its repository (set {GIT_ENV} to a git directory)"
    if sys.platform != "linux" or "-mavx2" not in isa_flags():
        return "its CPU kernels need x86 with AVX2"
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    source = folder / "source"
    logger.info("ik_llama.cpp: building %s into %s (once)", git, folder)
    with log.open("w") as out:
        if not (source / "CMakeLists.txt").exists():
            why = check_out(git, folder, out)
            if why:
                return f"{why} (log {log})"
        options = (
            "-DGGML_OPENMP=ON", "-DGGML_IQK_FA_ALL_QUANTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        )  # fmt: skip
        why = compile_tools(source, folder, options, out)
        if why:
            return f"building it failed: {why} (log {log})"
    return tools
