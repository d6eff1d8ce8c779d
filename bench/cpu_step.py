"""Part 13 of ``make bench`` (Linux CPU): the decode step's anatomy with the fused
primitives (norms, RoPE, attention, SwiGLU and logsumexp as one node each, sibling
projections as one kernel call) on and off, side by side: graph nodes per step, host and evaluation
milliseconds of one synchronous step, in-process decode tok/s; then two servers,
one with ``MLX_BACKEND_CPU_FAST_OPS=off``, in alternating rounds: 1-stream decode,
8 and 16 streams, and prefill of a 1000- and a 4096-token prompt, with llama.cpp
on the same GGUF and threads after them in each round (``bench/llama_cpp.py``).
The header names the CPU's instruction sets.
"""

import collections
import logging
import os
import re
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench import llama_cpp
from bench.batching import grpc_stream, run_level
from bench.cpu_kernels import library_tps
from bench.cpu_paths import long_prompt, server_prefill
from bench.overhead import server_decode
from mlx_backend.cpu.compute_path import prepare_for_cpu
from mlx_backend.cpu.kernels import (
    FAST_OPS_ENV,
    load_kernels,
    match_blas_threads,
    set_shared_inputs,
    use_kernels,
)
from mlx_backend.cpu.kernels.fast_ops import mlx_fast_ops, route_fast_ops
from mlx_backend.models.loading import default_model_path, load_model

logger = logging.getLogger(__name__)

STREAMS = (8, 16)
SIDES = ("on", "off")
CONTEXT = 64
# Prefilled prompts' lengths: the 1000 that part 12 uses, and a ~4k prompt (the
# length of llama.cpp's pp4096).
PROMPTS = {"prefill": 1000, "prefill_long": 4096}
KEYS = ("decode", *PROMPTS, *STREAMS)
# About the tokens of the batch levels' chat prompts, for llama-batched-bench.
BATCH_PROMPT = 32


def cpu_flags() -> str:
    """The instruction sets this CPU reports that the kernels could use."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "neon")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = set(re.findall(r"\b[\w]+\b", text.split("flags", 1)[-1].split("\n", 1)[0]))
    return ", ".join(flag for flag in wanted if flag in found) or "none of AVX2/NEON"


def graph_nodes(output: mx.array) -> collections.Counter:
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, output)
        text = Path(dot.name).read_text()
    return collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z]+)', text))


def step_anatomy(model, steps: int = 30) -> dict:
    """One decode step at a CONTEXT-token context: its nodes, and the host and
    evaluation milliseconds of a synchronous step (medians)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, CONTEXT + 1))]), cache=cache))
    token = mx.array([[5]])
    nodes = graph_nodes(model(token, cache=cache))
    host, evaluation = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, cache=cache)
        built = time.perf_counter()
        mx.eval(logits)
        host.append(built - start)
        evaluation.append(time.perf_counter() - built)
        # Back to the same context: every step measures the same work.
        for layer in cache:
            layer.trim(1)
    return {
        "nodes": sum(nodes.values()),
        "nodes_per_layer": sum(nodes.values()) / len(model.layers),
        "host_ms": statistics.median(host) * 1e3,
        "eval_ms": statistics.median(evaluation) * 1e3,
        "top_nodes": nodes.most_common(8),
    }


def side(model, on: bool):
    """The fused primitives on or off, for the block."""
    set_shared_inputs(model, on)
    return nullcontext() if on else mlx_fast_ops()


def bench_in_process(rounds: int, tokens: int) -> dict:
    loaded = load_model(str(default_model_path()))
    mx.eval(loaded.model.parameters())
    model, _ = prepare_for_cpu(loaded.model, None, None)
    use_kernels(model)
    match_blas_threads(0)
    route_fast_ops()
    runs = {name: [] for name in SIDES}
    for i in range(rounds):
        for name in SIDES:
            logger.info("cpu step: in-process, fused %s, round %d", name, i + 1)
            with side(model, name == "on"):
                anatomy = step_anatomy(model)
                anatomy["decode_tps"] = library_tps(model, tokens)
            runs[name].append(anatomy)
    set_shared_inputs(model, True)
    return runs


def bench_servers(
    running_process, rounds: int, tokens: int, batch_tokens: int, llama
) -> dict:
    """The two servers' figures, and llama.cpp's (``llama``: its tools, or None)
    after them in each round."""
    eos = 2
    names = SIDES + (("llama.cpp",) if llama else ())
    runs = {name: {key: [] for key in KEYS} for name in names}
    environments = {"on": None, "off": {**os.environ, FAST_OPS_ENV: "off"}}
    with running_process(environments["on"]) as on, running_process(
        environments["off"]
    ) as off:
        servers = {"on": on.stub, "off": off.stub}
        for stub in servers.values():
            server_decode(stub, 8, eos)  # warm
        for i in range(rounds):
            for name in SIDES:
                logger.info("cpu step: server, fused %s, round %d", name, i + 1)
                stub = servers[name]
                r = runs[name]
                for key, length in PROMPTS.items():
                    prompt = long_prompt(stub, 2 * i + (name == "off"), length)
                    r[key].append(server_prefill(stub, prompt)["prefill_tps"])
                r["decode"].append(server_decode(stub, tokens, eos)["decode_tps"])
                for n in STREAMS:
                    level = run_level(
                        lambda p: grpc_stream(stub, p, batch_tokens, eos), n, i
                    )
                    r[n].append(level["throughput_tps"])
            if llama:
                logger.info("cpu step: llama.cpp, round %d", i + 1)
                r = runs["llama.cpp"]
                for key, length in PROMPTS.items():
                    r[key].append(llama.bench(length, 0))
                r["decode"].append(llama.bench(0, tokens))
                for n in STREAMS:
                    r[n].append(llama.batched(n, BATCH_PROMPT, batch_tokens))
    return runs


def worst(values, higher_is_better: bool = True) -> float:
    return min(values) if higher_is_better else max(values)


def ratio(values, reference, higher: bool = True) -> float:
    """Worst run over the reference's worst run (nan without a reference)."""
    base = worst(reference, higher)
    return worst(values, higher) / base if base else float("nan")


def bench_cpu_step(
    running_process, rounds: int, tokens: int, batch_tokens: int
) -> tuple[dict, list[str]]:
    qmm, why = load_kernels()
    if qmm is None:
        return {"skipped": why}, [f"13. CPU decode step: skipped ({why})"]
    llama = llama_cpp.build(str(default_model_path()), qmm.settings()["threads"])
    if isinstance(llama, str):
        llama_skipped, llama = llama, None
        logger.warning("cpu step: no llama.cpp column: %s", llama_skipped)
    library = bench_in_process(rounds, tokens)
    servers = bench_servers(running_process, rounds, tokens, batch_tokens, llama)
    rows = []

    def text(xs, fmt):
        return " / ".join(fmt.format(x) for x in xs)

    def row(label, values: dict, fmt="{:.1f}", higher=True, reference=None):
        on, off = values["on"], values["off"]
        against_off = ratio(on, off, higher)
        cells = [text(on, fmt), text(off, fmt), f"{against_off:.2f}x"]
        if reference:
            cells += [text(reference, fmt), f"{ratio(on, reference, higher):.2f}x"]
        elif llama:
            cells += ["", ""]
        rows.append("| " + " | ".join([label, *cells]) + " |")
        return against_off

    def values(source, key):
        return {name: [r[key] for r in source[name]] for name in SIDES}

    reference = servers.get("llama.cpp", {})
    report = {"library": library, "servers": servers}
    row("graph nodes per step", values(library, "nodes"), "{:.0f}", higher=False)
    row("graph nodes per layer", values(library, "nodes_per_layer"), higher=False)
    row("host ms per step (synchronous)", values(library, "host_ms"), higher=False)
    row("evaluation ms per step", values(library, "eval_ms"), higher=False)
    report["decode_ratio"] = row(
        "decode tok/s, in-process",
        values(library, "decode_tps"),
        reference=reference.get("decode"),
    )
    labels = {
        "decode": "server decode tok/s, 1 stream",
        **{n: f"server tok/s, {n} streams" for n in STREAMS},
        **{k: f"server prefill tok/s, {n}-token prompt" for k, n in PROMPTS.items()},
    }
    for key, label in labels.items():
        report[f"{key}_ratio"] = row(
            label,
            {name: servers[name][key] for name in SIDES},
            reference=reference.get(key),
        )
    header = "| | on | off | on / off |"
    if llama:
        header += " llama.cpp | on / llama.cpp |"
    lines = [
        "13. CPU decode step (bench/cpu_step.py): the fused primitives on / off,"
        " and llama.cpp",
        f"    CPU instruction sets: {cpu_flags()}; kernels {qmm.settings()['isa']},"
        f" fused rows {qmm.fused_isa()}, {qmm.settings()['threads']} threads",
        f"    every run listed (rounds alternate); ratios are of the worst runs;"
        f" context {CONTEXT} for the step's anatomy",
        (
            f"    llama.cpp ({llama_cpp.SDIST}, GGML_NATIVE) on the same GGUF and"
            f" threads: llama-bench tg{tokens} and pp1000 / pp4096,"
            f" llama-batched-bench at {BATCH_PROMPT}-token prompts"
            f" and {batch_tokens} tokens, prefill included"
            if llama
            else f"    llama.cpp: skipped ({llama_skipped})"
        ),
        "",
        header,
        "|---" * (header.count("|") - 1) + "|",
        *rows,
        "",
        "    largest node kinds, on: "
        + ", ".join(f"{k} {v}" for k, v in library["on"][0]["top_nodes"]),
        "    largest node kinds, off: "
        + ", ".join(f"{k} {v}" for k, v in library["off"][0]["top_nodes"]),
    ]
    for name in SIDES:
        for r in library[name]:
            r.pop("top_nodes", None)
    return report, lines
