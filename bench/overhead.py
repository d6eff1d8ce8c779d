"""Part 1 of ``make bench``: server overhead. gRPC PredictStream against mlx-lm's
own stream_generate on the same compute path, greedy, with EOS banned so every run
decodes the same number of tokens, on the default server (the paged decoder on the
CPU) and the batch decoder's with CPU pacing on and off;
with logprobs and under a JSON-schema grammar; Health latency while a long
generation streams; and where each millisecond per token goes (bench/profile.py).
Each side's rate is compared with the library's run next to it. Parts 2 and 3
(bench/cpu_paths.py, bench/prompt_cache.py) use its prompts, its streamed decode
and its medians; bench.py its ``machine_header``.
"""

import json
import logging
import os
import platform
import re
import statistics
import threading
import time
from contextlib import suppress
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors

import backend_pb2 as pb
from bench.batching import percentile
from bench.profile import process_cpu_seconds, profile_decode
from mlx_backend.cpu.allocator import allocator_in_use
from mlx_backend.cpu.blas import fast_blas_in_use, physical_cores
from mlx_backend.cpu.compute_path import prepare_for_cpu
from mlx_backend.cpu.kernels import match_blas_threads, use_kernels
from mlx_backend.cpu.kernels.fast_ops import route_fast_ops
from mlx_backend.gpu import device_description
from mlx_backend.models.gguf import load_gguf
from mlx_backend.models.loading import default_model_path

logger = logging.getLogger(__name__)

PROMPT = "Write a long story about a lighthouse keeper and a storm."
LONG_TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years, and every "
    "night its keeper climbed the spiral stairs to light the lamp. "
)
TOP_LOGPROBS = 5
# A JSON schema whose string can't close within the decode: every token is constrained.
STORY_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 4000}},
        "required": ["story"],
    }
)


def chat_request(tokens: int, **fields) -> pb.PredictOptions:
    return pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content=PROMPT)],
        Tokens=tokens,
        **fields,
    )


def cpu_seconds(*pids: int) -> float | None:
    """CPU seconds of this process and of ``pids`` together (None without /proc)."""
    others = [process_cpu_seconds(pid) for pid in pids]
    return None if None in others else time.process_time() + sum(others)


def cpu_ms_per_token(
    start: float | None, end: float | None, tokens: int
) -> float | None:
    if start is None or end is None or tokens < 2:
        return None
    return (end - start) / (tokens - 1) * 1000


def server_decode(
    stub, tokens: int, eos: int, pid: int | None = None, **fields
) -> dict:
    """One streamed decode; with the server's ``pid``, the CPU it and this client
    spent per token after the first."""
    request = chat_request(tokens, LogitBias=json.dumps({str(eos): -1e9}), **fields)
    start = time.perf_counter()
    first = None
    for reply in stub.PredictStream(request):
        if first is None:
            first = time.perf_counter()
            cpu_start = cpu_seconds(pid) if pid else None
    end = time.perf_counter()
    cpu_end = cpu_seconds(pid) if pid else None
    return {
        "tokens": reply.tokens,
        "ttft_s": first - start,
        "decode_tps": (reply.tokens - 1) / (end - first),
        "cpu_ms_per_token": cpu_ms_per_token(cpu_start, cpu_end, reply.tokens),
    }


def library_decode(model, tokenizer, tokens: int, eos: int) -> dict:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    processors = make_logits_processors(logit_bias={eos: -1e9})
    start = time.perf_counter()
    first = None
    n = 0
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=tokens, logits_processors=processors
    ):
        if first is None:
            first = time.perf_counter()
            cpu_start = cpu_seconds()
        n = response.generation_tokens
    end = time.perf_counter()
    cpu_end = cpu_seconds()
    return {
        "tokens": n,
        "ttft_s": first - start,
        "decode_tps": (n - 1) / (end - first),
        "cpu_ms_per_token": cpu_ms_per_token(cpu_start, cpu_end, n),
    }


def health_latency(stub, tokens: int) -> dict:
    """Health round trips (ms) sampled while one long generation streams."""
    done = threading.Event()
    samples: list[float] = []

    def probe():
        while not done.is_set():
            start = time.perf_counter()
            stub.Health(pb.HealthMessage())
            samples.append((time.perf_counter() - start) * 1000)
            time.sleep(0.02)

    stream = stub.PredictStream(chat_request(tokens, IgnoreEOS=True))
    next(stream)
    thread = threading.Thread(target=probe)
    thread.start()
    for _ in stream:
        pass
    done.set()
    thread.join()
    samples.sort()
    return {
        "samples": len(samples),
        "p50_ms": percentile(samples, 0.5),
        "p95_ms": percentile(samples, 0.95),
        "max_ms": samples[-1],
    }


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def median_cpu(runs: list[dict]) -> float | None:
    figures = [r["cpu_ms_per_token"] for r in runs]
    return None if None in figures else statistics.median(figures)


def machine_header(breakdown) -> str:
    """The machine and compute path, so runs on different machines compare."""
    model = platform.processor() or platform.machine()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cpu = f"CPU {model}, {physical_cores()} physical cores ({os.cpu_count()} logical)"
    device = device_description()
    if device != "CPU":
        return f"{device}; {cpu}"
    blas = fast_blas_in_use(os.environ) or "MLX's bundled BLAS"
    malloc = allocator_in_use(os.environ) or "glibc's"
    return (
        f"{cpu}, BLAS {Path(blas).name} with {breakdown['blas_threads']} threads, "
        f"malloc {Path(malloc).name}; auto chose pacing {'on' if breakdown['cpu_paced'] else 'off'}"
    )


def bench_overhead(servers: dict, rounds: int, tokens: int) -> tuple[dict, list[str]]:
    """Part 1 on the default server and the batch decoder's with cpu_pacing on and
    off (``servers``: "auto", "on", "off"; the default alone on a GPU)."""
    model, tokenizer, _ = load_gguf(default_model_path())
    model, path = prepare_for_cpu(model, None, None)
    # The server's compute path: quantized layers on the SIMD kernels with its
    # threads, and the fused primitives.
    if path.kernel_isa:
        use_kernels(model)
        match_blas_threads(0)
    if mx.default_device() == mx.cpu:
        route_fast_ops()
    eos = next(iter(tokenizer.eos_token_ids))
    auto, auto_pid = servers["auto"].stub, servers["auto"].process.pid
    for server in servers.values():  # warm every side once
        server_decode(server.stub, 16, eos)
    library_decode(model, tokenizer, 16, eos)
    # Auto's plain runs sit right after the fixed modes' and before the grammar's,
    # which are all compared with them directly.
    sides = {
        name: partial(
            server_decode, servers[name].stub, tokens, eos, servers[name].process.pid
        )
        for name in ("off", "on", "auto")
        if name in servers
    }
    sides |= {
        "grammar": partial(
            server_decode, auto, tokens, eos, auto_pid, Grammar=STORY_SCHEMA
        ),
        "logprobs": partial(
            server_decode,
            auto,
            tokens,
            eos,
            auto_pid,
            Logprobs=TOP_LOGPROBS,
            TopLogprobs=TOP_LOGPROBS,
        ),
    }
    # The library against itself: how far from 1 the machine's noise alone moves a ratio.
    sides["noise"] = partial(library_decode, model, tokenizer, tokens, eos)
    runs = {"mlx_lm": [], **{name: [] for name in sides}}
    # Each side's tok/s over the library's in the run next to it: on a shared
    # machine the speed drifts within seconds, so only neighbours compare.
    pairs = {name: [] for name in sides}
    for i in range(rounds):
        logger.info("overhead round %d/%d", i + 1, rounds)
        for name, decode in sides.items():
            if i % 2:
                side = decode()
                library = library_decode(model, tokenizer, tokens, eos)
            else:
                library = library_decode(model, tokenizer, tokens, eos)
                side = decode()
            runs["mlx_lm"].append(library)
            runs[name].append(side)
            pairs[name].append(side["decode_tps"] / library["decode_tps"])
    health = health_latency(auto, tokens)
    profile, profile_lines = profile_decode(
        auto_pid, lambda n: server_decode(auto, n, eos), 2 * tokens
    )
    breakdown = auto.Status(pb.HealthMessage()).memory.breakdown
    chosen = "on" if breakdown["cpu_paced"] else "off"
    paged = "one forward pass per step over paged KV" in servers["auto"].logs()
    decoder = "paged" if paged else f"batch, pacing auto {chosen}"
    # The last load's pacing line: the figures auto chose by.
    pacing = re.findall(r"CPU pacing \w+ \(auto[^)]*\)", servers["auto"].logs())
    labels = {
        "mlx_lm": "mlx-lm stream_generate",
        "auto": f"gRPC, default ({decoder})",
        **{
            mode: f"gRPC, batch, pacing {mode}"
            for mode in ("on", "off")
            if mode in servers
        },
        "logprobs": f"  auto + logprobs, top {TOP_LOGPROBS}",
        "grammar": "  auto + JSON-schema grammar",
        "noise": "mlx-lm again (noise)",
    }
    ratios = {"mlx_lm": 1.0} | {name: statistics.median(p) for name, p in pairs.items()}
    lines = [
        f"1. server overhead: decode {tokens} tokens, {rounds} rounds of neighbouring "
        "runs "
        f"({path.description})",
        machine_header(breakdown),
        pacing[-1] if pacing else "auto pacing: no figures in the server's log",
        f"{'path':<30}{'decode tok/s':>14}{'/ mlx-lm':>10}{'TTFT s':>9}"
        f"{'CPU ms/tok':>12}",
    ]
    cpu = {name: median_cpu(runs[name]) for name in labels}
    for name, label in labels.items():
        lines.append(
            f"{label:<30}{median_of(runs[name], 'decode_tps'):>14.2f}"
            f"{ratios[name]:>10.3f}{median_of(runs[name], 'ttft_s'):>9.3f}"
            + (f"{cpu[name]:>12.1f}" if cpu[name] else f"{'n/a':>12}")
        )

    # Runs of one round compared directly: the library's drift between them stays out.
    def direct(name: str, base: str) -> list[float]:
        return [
            a["decode_tps"] / b["decode_tps"] for a, b in zip(runs[name], runs[base])
        ]

    auto_over = {
        mode: statistics.median(direct("auto", mode))
        for mode in ("on", "off")
        if mode in servers
    }
    grammar_pairs = direct("grammar", "auto")
    grammar = statistics.median(grammar_pairs)
    lines += [
        "ratios: the median over rounds of the ratio to the library's run next to it; "
        f"mlx-lm against itself ranged {min(pairs['noise']):.3f}-"
        f"{max(pairs['noise']):.3f} by round",
        f"auto / mlx-lm: plain {ratios['auto']:.3f}, with logprobs "
        f"{ratios['logprobs']:.3f} (goal >= 0.97)",
    ]
    if auto_over:
        better = min(auto_over, key=auto_over.get)
        lines.append(
            f"auto / the better of on and off: {auto_over[better]:.3f} (auto / "
            f"{better}), the median over rounds of auto's run over that mode's run "
            f"before it in the same round (auto / on "
            f"{auto_over['on']:.3f}, / off {auto_over['off']:.3f}; goal >= 0.97)"
        )
    lines += [
        f"auto grammar / auto plain: {grammar:.3f}, the median over rounds of the "
        f"ratio between the two (ranged {min(grammar_pairs):.3f}-"
        f"{max(grammar_pairs):.3f}; goal >= 0.95)",
        "CPU ms/tok: the CPU time of the server's threads and this client's (the "
        "library's: this process) per token after the first; time stolen by other "
        "tenants is not in it",
        f"Health during generation: p50 {health['p50_ms']:.2f} ms, "
        f"p95 {health['p95_ms']:.2f} ms, max {health['max_ms']:.2f} ms "
        f"over {health['samples']} calls",
        *profile_lines,
    ]
    report = {
        "runs": runs,
        "pairs": pairs,
        "over_mlx_lm": ratios,
        "grammar_over_plain": grammar,
        "auto_over_paced_and_unpaced": auto_over,
        "auto_chose_pacing": bool(breakdown["cpu_paced"]),
        "health": health,
        "profile_ms_per_token": profile,
    }
    return report, lines
