"""A step's anatomy, in-process (issue 68): graph nodes, the engine thread's CPU
time and its share inside ``mx.async_eval`` (MLX's walk of the graph and the
tasks it queues), and the wall time of a step, on the paged decoder and on the
batch decoder, for one stream, for two streams, and for two streams beside a
prompt being prefilled, in alternating rounds.

    venv/bin/python -m bench.step_anatomy [--rounds 3]

Nodes are counted on the first graph a step queues (``mx.export_to_dot``).
"""

import random
import statistics
import time
from contextlib import contextmanager

import mlx.core as mx

from bench.cpu_step import graph_nodes
from bench.in_process import make_decoder, run_rounds
from tests.engine_helpers import new_sequence

STEPS = 40
PROMPT = 3000
SCENARIOS = ("1 stream", "2 streams", "2 streams and a prompt")


@contextmanager
def timed_async_eval(totals: dict):
    """Count the graph of the first ``mx.async_eval`` and time every call."""
    inner = mx.async_eval

    def wrapped(*arrays):
        if "nodes" not in totals:
            totals["nodes"] = sum(graph_nodes(arrays[0]).values())
        cpu = time.thread_time()
        inner(*arrays)
        totals["async_eval_cpu"] += time.thread_time() - cpu

    mx.async_eval = wrapped
    try:
        yield
    finally:
        mx.async_eval = inner


def anatomy(decoder, model, options, scenario: str) -> dict:
    rng = random.Random(11)
    streams = 1 if scenario == "1 stream" else 2
    for _ in range(streams):
        prompt = tuple(rng.randrange(100, 40000) for _ in range(20))
        decoder.add(new_sequence(model, options, prompt, 10_000))
    for _ in range(10):
        decoder.step()
    if scenario.endswith("prompt"):
        prompt = tuple(rng.randrange(100, 40000) for _ in range(PROMPT))
        decoder.add(new_sequence(model, options, prompt, 1))
        decoder.step()
    totals = {"async_eval_cpu": 0.0}
    with timed_async_eval(totals):
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(STEPS):
            decoder.step()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return {
        "nodes": totals.get("nodes", 0),
        "engine_cpu_ms": cpu / STEPS * 1e3,
        "async_eval_cpu_ms": totals["async_eval_cpu"] / STEPS * 1e3,
        "wall_ms": wall / STEPS * 1e3,
    }


def measure(model, options, rounds: int) -> dict:
    out = {}
    for round_ in range(rounds):
        sides = (True, False) if round_ % 2 == 0 else (False, True)
        for scenario in SCENARIOS:
            for paged in sides:
                decoder = make_decoder(paged, model, options)
                figures = anatomy(decoder, model, options, scenario)
                out.setdefault((scenario, "paged" if paged else "batch"), []).append(
                    figures
                )
                decoder.close()
    return out


def main() -> None:
    out = run_rounds(__doc__, measure)
    print(
        "scenario                 decoder  nodes  engine CPU ms  in async_eval ms"
        "  wall ms a step (per round)"
    )
    for (scenario, side), runs in out.items():
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        walls = " / ".join(f"{r['wall_ms']:.1f}" for r in runs)
        print(
            f"{scenario:24} {side:7} {median['nodes']:6.0f} "
            f"{median['engine_cpu_ms']:14.2f} {median['async_eval_cpu_ms']:17.2f}"
            f"  {walls}"
        )


if __name__ == "__main__":
    main()
