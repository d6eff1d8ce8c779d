"""Where one stream's time per token goes: a py-spy profile of the backend process
while it decodes, with each thread's CPU time read from /proc.

py-spy sees Python threads only. Its samples split the engine thread's time into
the stages below; the threads it can't see (MLX's stream thread, BLAS workers) are
counted from /proc, as the time left once the Python threads are taken out.
"""

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SAMPLE_RATE = 250
# Stages of the engine thread, by the first rule whose file or function appears
# in a sample's stack (outermost frames first).
ENGINE_STAGES = (
    (("speculative.py",), "speculative decoding (propose, verify)"),
    (("reply_pipeline.py", "detokenizer.py", "chat_output.py"), "detokenize, classify"),
    (("pace_step",), "step evaluation (MLX encode, wait)"),
    # The paged decoder reads a step's tokens (waiting for it) in _read.
    (("_read (",), "step evaluation (MLX encode, wait)"),
    (("sampling.py", "sample_utils.py", "grammar.py"), "sampling"),
    (("mlx_lm/models/",), "forward pass: graph building"),
    (("decoders/paged.py", "caches/paged"), "paged pass: schedule, layout, queue"),
    (("GenerationBatch", "BatchGenerator"), "step evaluation (MLX encode, wait)"),
    # "Outbox" also matches the engine's older class name, "_Outbox".
    (("Outbox", "call_soon_threadsafe"), "hand-off to the event loop"),
)


def find_py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=f"{sys.prefix}/bin")


def cpu_seconds(stat: Path) -> float:
    """User plus system CPU seconds from a /proc ``stat`` file."""
    text = stat.read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """Process ``pid``'s CPU seconds, its ended threads' included (None without /proc)."""
    try:
        return cpu_seconds(Path(f"/proc/{pid}/stat"))
    except OSError:
        return None


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each thread's user plus system CPU seconds, by thread id."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            times[int(tid)] = cpu_seconds(Path(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
    return times


def engine_stage(frames: list[str]) -> str:
    for markers, stage in ENGINE_STAGES:
        if any(marker in frame for frame in frames for marker in markers):
            return stage
    return "engine loop, other"


def read_samples(path: Path) -> tuple[dict[int, str], Counter]:
    """Thread names by id, and sample counts by (thread id, stage)."""
    names: dict[int, str] = {}
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, *frames = stack.split(";")
        tid_text, name = re.fullmatch(r"thread \((\w+)\): (.*)", head).groups()
        tid = int(tid_text, 0)
        names[tid] = name
        stage = engine_stage(frames) if name == "mlx-engine" else name
        counts[tid, stage] += int(count)
    return names, counts


def profile_decode(pid: int, decode, tokens: int) -> tuple[dict, list[str]]:
    """Profile the backend ``pid`` while ``decode(tokens)`` streams one reply.

    Returns:
        The figures in milliseconds per token, and the report's lines.
    """
    py_spy = find_py_spy()
    if py_spy is None or not sys.platform.startswith("linux"):
        return {}, ["per-token profile skipped: py-spy (requirements-bench.txt)"]
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "samples.txt"
        command = [py_spy, "record", "-p", str(pid), "-r", str(SAMPLE_RATE)]
        command += ["--threads", "--nonblocking", "--format", "raw", "-o", str(raw)]
        spy = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(1.0)  # py-spy attaches
        before = thread_cpu_seconds(pid)
        client = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        decoded = decode(tokens)["tokens"]
        wall = time.perf_counter() - start
        after = thread_cpu_seconds(pid)
        client_after = resource.getrusage(resource.RUSAGE_SELF)
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
        if not raw.exists():
            return {}, ["per-token profile skipped: py-spy could not attach"]
        names, counts = read_samples(raw)

    def per_token(seconds: float) -> float:
        return 1000 * seconds / decoded

    cpu = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    python_threads = sum(cpu.get(tid, 0.0) for tid in names)
    figures = {
        "wall": per_token(wall),
        "native threads (MLX stream, BLAS)": per_token(
            sum(cpu.values()) - python_threads
        ),
    }
    for tid, name in sorted(names.items(), key=lambda item: -cpu.get(item[0], 0)):
        label = "engine thread" if name == "mlx-engine" else f"thread {name}"
        figures[label] = per_token(cpu.get(tid, 0.0))
        if name == "mlx-engine":
            stages = {stage: 0 for _, stage in ENGINE_STAGES}
            stages |= {s: n for (t, s), n in counts.items() if t == tid}
            for stage, n in sorted(stages.items(), key=lambda item: -item[1]):
                figures[f"  {stage}"] = per_token(n / SAMPLE_RATE)
    figures["client (bench process)"] = per_token(
        client_after.ru_utime
        - client.ru_utime
        + client_after.ru_stime
        - client.ru_stime
    )
    lines = [
        f"per-token profile: {decoded} tokens, {figures['wall']:.2f} ms per token "
        "wall; CPU ms per token (engine stages: py-spy samples while running)"
    ]
    lines += [
        f"  {label:<44}{value:>8.2f}"
        for label, value in figures.items()
        if label != "wall"
    ]
    return figures, lines
