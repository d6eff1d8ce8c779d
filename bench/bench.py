#!/usr/bin/env python3
"""Side-by-side benchmarks of the backend on the embedded default model.

1. Server overhead: gRPC PredictStream against mlx-lm's own stream_generate on
   the same compute path, greedy, with EOS banned so every run decodes the same
   number of tokens, on servers with CPU pacing auto, on and off (speculation off,
   as in stream_generate); with logprobs
   (top 5 alternatives) and under a JSON-schema grammar; Health latency while a
   long generation streams; and where each millisecond per token goes
   (bench/profile.py). The header names the CPU, its cores, the BLAS and the
   pacing auto chose.
2. CPU paths (Linux CPU): the stock path (bundled BLAS, quantized kernels), float32
   weights on OpenBLAS, and the fast path that ``auto`` picks (MKL on x86_64):
   prefill on a 1000-token prompt, decode, and peak memory.
3. Prompt cache: time to first token for a ~1500-token prompt, cold and warm (after
   a request that shared its prefix), and the prompt tokens actually prefilled over
   a 6-turn chat against the tokens new in each turn.
4. Continuous batching (bench/batching.py): aggregate tokens/s, TTFT and inter-token
   latency at 1 to 16 concurrent streams, next to mlx_lm.server on the same weights.
5. Shared prefixes (bench/prefix.py): bursts of 8 and 16 chats with one ~1000-token
   system prompt, with prefix sharing on, off, and on mlx_lm.server: time to first
   token and wall time; and a cancel-then-resend's TTFT against a cold start.
6. Speculative decoding (bench/speculative.py): decode tok/s with n-gram prompt
   lookup on and off for a copy-heavy and an open-ended stream, aggregate tok/s of
   8 mixed streams, the acceptance rate, and the copy stream on mlx_lm.server.
7. Distributed (bench/distributed.py): 1 process, 2 ranks and 3 ranks on loopback.
8. Memory and persistence (bench/memory.py): KV bytes per token and decode tok/s at
   1 and 8 streams over a 4000-token context for full, q8_0 and q4_0 KV caches; the
   first request's TTFT after a restart with and without its PromptCachePath file.

Rounds alternate between the sides so machine noise hits both alike. Results go
to stdout and bench-results/core.json; the printed tables are appended, with the
date, the commit and the machine, to bench/RESULTS.md (``--no-results``: not).
"""

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager, suppress
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors

import backend_pb2 as pb
from bench.batching import bench_batching, percentile
from bench.distributed import bench_distributed
from bench.memory import bench_memory
from bench.prefix import bench_prefix
from bench.profile import process_cpu_seconds, profile_decode
from bench.speculative import bench_speculative
from mlx_backend.cpu.blas import (
    blas_choice_environment,
    fast_blas_in_use,
    find_fast_blas,
    maybe_reexec_with_fast_blas,
    physical_cores,
)
from mlx_backend.cpu.compute_path import prepare_for_cpu
from mlx_backend.models.gguf import export_mlx_folder, load_gguf
from mlx_backend.models.loading import default_model_path
from tests.support import Server

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
PROMPT = "Write a long story about a lighthouse keeper and a storm."
LONG_TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years, and every "
    "night its keeper climbed the spiral stairs to light the lamp. "
)
PREFILL_TOKENS = 1000
TOP_LOGPROBS = 5
# A JSON schema whose string can't close within the decode: every token is constrained.
STORY_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 4000}},
        "required": ["story"],
    }
)


@contextmanager
def running_process(env: dict | None = None, options: tuple[str, ...] = ()):
    """A backend process with the default model loaded (reloaded with LoadModel
    ``options`` when given); yields its ``Server``."""
    server = Server("--model", "default", env=env)
    try:
        server.wait_for_log("startup model", timeout=180)
        if options:
            request = pb.ModelOptions(Model="default", Options=list(options))
            assert server.stub.LoadModel(request).success
        yield server
    finally:
        server.stop()


@contextmanager
def running_server(env: dict | None = None, options: tuple[str, ...] = ()):
    """``running_process``'s stub."""
    with running_process(env, options) as server:
        yield server.stub


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


def server_prefill(stub, prompt: str) -> dict:
    reply = stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=1))
    seconds = reply.timing_prompt_processing / 1000
    return {
        "prompt_tokens": reply.prompt_tokens,
        "prefill_tps": reply.prompt_tokens / seconds,
    }


def long_prompt(stub, round: int) -> str:
    """Text of exactly PREFILL_TOKENS tokens, opening differently in each round.

    A new opening keeps the prompt cache from serving a round what an earlier one
    prefilled.
    """
    text = f"Round {round}. " + LONG_TEXT * 60
    ids = stub.TokenizeString(pb.PredictOptions(Prompt=text)).tokens
    return stub.Detokenize(pb.DetokenizeRequest(tokens=ids[:PREFILL_TOKENS])).content


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


def cpu_header(breakdown) -> str:
    """The machine and compute path, so runs on different machines compare."""
    model = platform.processor() or platform.machine()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    blas = fast_blas_in_use(os.environ) or "MLX's bundled BLAS"
    return (
        f"CPU {model}, {physical_cores()} physical cores ({os.cpu_count()} logical), "
        f"BLAS {Path(blas).name} with {breakdown['blas_threads']} threads; "
        f"auto chose pacing {'on' if breakdown['cpu_paced'] else 'off'}"
    )


def bench_overhead(servers: dict, rounds: int, tokens: int) -> tuple[dict, list[str]]:
    """Part 1 on servers loaded with cpu_pacing auto, on and off (``servers``)."""
    model, tokenizer, _ = load_gguf(default_model_path())
    model, path = prepare_for_cpu(model, None, None)
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
    # The last load's pacing line: the figures auto chose by.
    pacing = re.findall(r"CPU pacing \w+ \(auto[^)]*\)", servers["auto"].logs())
    labels = {
        "mlx_lm": "mlx-lm stream_generate",
        "auto": f"gRPC, pacing auto ({chosen})",
        "on": "gRPC, pacing on",
        "off": "gRPC, pacing off",
        "logprobs": f"  auto + logprobs, top {TOP_LOGPROBS}",
        "grammar": "  auto + JSON-schema grammar",
        "noise": "mlx-lm again (noise)",
    }
    ratios = {"mlx_lm": 1.0} | {name: statistics.median(p) for name, p in pairs.items()}
    lines = [
        f"1. server overhead: decode {tokens} tokens, {rounds} rounds of neighbouring "
        "runs "
        f"({path.description})",
        cpu_header(breakdown),
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
        mode: statistics.median(direct("auto", mode)) for mode in ("on", "off")
    }
    better = min(auto_over, key=auto_over.get)
    grammar_pairs = direct("grammar", "auto")
    grammar = statistics.median(grammar_pairs)
    lines += [
        "ratios: the median over rounds of the ratio to the library's run next to it; "
        f"mlx-lm against itself ranged {min(pairs['noise']):.3f}-"
        f"{max(pairs['noise']):.3f} by round",
        f"auto / mlx-lm: plain {ratios['auto']:.3f}, with logprobs "
        f"{ratios['logprobs']:.3f} (goal >= 0.97)",
        f"auto / the better of on and off: {auto_over[better]:.3f} (auto / "
        f"{better}), the median over rounds of auto's run over that mode's run "
        f"before it in the same round (auto / on "
        f"{auto_over['on']:.3f}, / off {auto_over['off']:.3f}; goal >= 0.97)",
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


def bench_cpu_paths(stubs: dict, rounds: int, tokens: int) -> tuple[dict, list[str]]:
    eos = 2
    for stub in stubs.values():
        server_decode(stub, 8, eos)  # warm
    runs = {name: {"prefill": [], "decode": []} for name in stubs}
    for i in range(rounds):
        prompt = long_prompt(stubs["fast"], i)
        for name, stub in stubs.items():
            logger.info("cpu paths round %d/%d: %s", i + 1, rounds, name)
            runs[name]["prefill"].append(server_prefill(stub, prompt))
            runs[name]["decode"].append(server_decode(stub, tokens, eos))
    summary = {}
    for name, stub in stubs.items():
        breakdown = stub.Status(pb.HealthMessage()).memory.breakdown
        summary[name] = {
            "prefill_tps": median_of(runs[name]["prefill"], "prefill_tps"),
            "decode_tps": median_of(runs[name]["decode"], "decode_tps"),
            "peak_mb": breakdown["peak"] / 2**20,
        }
    stock = summary["stock"]
    lines = [
        f"2. CPU paths: prefill {runs['fast']['prefill'][0]['prompt_tokens']} tokens, "
        f"decode {tokens} tokens, median of {rounds} alternating rounds",
        f"{'path':<12}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak MiB':>10}",
    ]
    for name, s in summary.items():
        lines.append(
            f"{name:<12}{s['prefill_tps']:>15.1f}{s['decode_tps']:>14.2f}"
            f"{s['peak_mb']:>10.0f}"
        )
    for name, s in summary.items():
        if name != "stock":
            prefill = s["prefill_tps"] / stock["prefill_tps"]
            decode = s["decode_tps"] / stock["decode_tps"]
            lines.append(
                f"{name} / stock: prefill {prefill:.1f}x, decode {decode:.2f}x"
            )
    return {"runs": runs, "summary": summary}, lines


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "And what river runs through it?",
    "Name one famous museum there.",
    "What is a popular dish in that city?",
    "How do people usually travel around the city?",
    "Give me one tip for a first visit.",
]


def cache_counter(stub, name: str) -> int:
    return stub.Status(pb.HealthMessage()).memory.breakdown[name]


def stream_ttft(stub, request: pb.PredictOptions) -> float:
    """Seconds to the first streamed reply.

    The stream is read to its end, so the request is retired and its KV state
    cached before the next request arrives.
    """
    start = time.perf_counter()
    first = None
    for _ in stub.PredictStream(request):
        first = first or time.perf_counter() - start
    return first


def bench_prompt_cache(stub, rounds: int) -> tuple[dict, list[str]]:
    base = LONG_TEXT * 57
    cold, warm, prompt_tokens = [], [], 0
    for i in range(rounds):
        # A new opening each round, so the first request finds nothing cached.
        system = f"Session {i}. Read this story carefully. {base}"

        def ask(question: str) -> pb.PredictOptions:
            messages = [
                pb.Message(role="system", content=system),
                pb.Message(role="user", content=question),
            ]
            return pb.PredictOptions(
                UseTokenizerTemplate=True, Messages=messages, Tokens=8
            )

        cold.append(stream_ttft(stub, ask("Who climbed the stairs?")))
        warm.append(stream_ttft(stub, ask("What did the keeper light?")))
        prompt_tokens = stub.Predict(ask("Why?")).prompt_tokens

    # A chat where each turn resends the whole history plus one new question.
    messages: list[pb.Message] = []
    prefilled = new = 0
    previous = 0  # prompt plus reply tokens of the previous turn
    for question in CHAT_QUESTIONS:
        messages.append(pb.Message(role="user", content=question))
        before = cache_counter(stub, "prompt_tokens_prefilled")
        reply = stub.Predict(
            pb.PredictOptions(UseTokenizerTemplate=True, Messages=messages, Tokens=48)
        )
        prefilled += cache_counter(stub, "prompt_tokens_prefilled") - before
        new += reply.prompt_tokens - previous
        previous = reply.prompt_tokens + reply.tokens
        messages.append(pb.Message(role="assistant", content=reply.message.decode()))

    report = {
        "prompt_tokens": prompt_tokens,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "chat_prefilled_tokens": prefilled,
        "chat_new_tokens": new,
    }
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    lines = [
        f"3. prompt cache: {prompt_tokens}-token prompt, median of {rounds} rounds",
        f"TTFT cold {cold_s:.3f} s, warm {warm_s:.3f} s: {cold_s / warm_s:.1f}x faster",
        f"{len(CHAT_QUESTIONS)}-turn chat: {prefilled} prompt tokens prefilled for "
        f"{new} new tokens ({prefilled / new:.2f}x)",
    ]
    return report, lines


def git_commit() -> str:
    """The checkout's short commit hash, or "" outside a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def append_results(path: Path, header: str, parts: list[int], lines: list[str]) -> None:
    """Append a run's printed tables to ``path`` (RESULTS.md) as a dated section:
    the date (UTC), the commit and the machine's ``header``, then ``lines`` fenced."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ran = ", ".join(map(str, parts))
    which = "all" if parts == list(range(1, 9)) else ran
    tables = "\n".join(line.rstrip() for line in lines).strip("\n")
    section = [
        "",
        f"## {date}, commit {git_commit() or 'unknown'}",
        "",
        header,
        "",
        f"Parts run: {which}.",
        "",
        "```",
        tables,
        "```",
        "",
    ]
    with path.open("a") as results:
        results.write("\n".join(section))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cpu-rounds", type=int, default=2)
    parser.add_argument("--cache-rounds", type=int, default=3)
    parser.add_argument("--batch-rounds", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--prefix-rounds", type=int, default=1)
    parser.add_argument("--speculative-rounds", type=int, default=5)
    parser.add_argument("--memory-rounds", type=int, default=2)
    parser.add_argument("--memory-tokens", type=int, default=48)
    parser.add_argument("--distributed-rounds", type=int, default=1)
    parser.add_argument("--distributed-tokens", type=int, default=32)
    parser.add_argument(
        "--parts",
        type=lambda text: {int(part) for part in text.split(",")},
        default=set(range(1, 9)),
        help="the parts to run, e.g. 1,4 (default: all)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "core.json"))
    parser.add_argument(
        "--no-results",
        action="store_true",
        help="don't append the printed tables to bench/RESULTS.md",
    )
    args = parser.parse_args(argv)
    parts = args.parts
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    # The library side runs on the same compute path as the server.
    maybe_reexec_with_fast_blas()
    fast_library = fast_blas_in_use(os.environ)

    report, lines = {}, []
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        fast = stack.enter_context(running_server())
        header = cpu_header(fast.Status(pb.HealthMessage()).memory.breakdown)
        if 1 in parts:
            # Part 1's servers, one per pacing mode; without speculation, which
            # stream_generate does not do either (part 6 measures it).
            with ExitStack() as pinned:
                servers = {
                    mode: pinned.enter_context(
                        running_process(
                            options=(f"cpu_pacing:{mode}", "speculative:off")
                        )
                    )
                    for mode in ("auto", "on", "off")
                }
                report["overhead"], part = bench_overhead(
                    servers, args.rounds, args.tokens
                )
            lines += part
        if 2 in parts and sys.platform == "linux":
            # The stock path, OpenBLAS where "auto" picked MKL, and the fast path.
            stubs = {}
            for name, choice in (("stock", "off"), ("openblas", "openblas")):
                library = find_fast_blas(choice) if choice != "off" else None
                if choice == "off" or library not in (None, fast_library):
                    env = blas_choice_environment(os.environ, choice)
                    stubs[name] = stack.enter_context(running_server(env))
            stubs["fast"] = fast
            report["cpu_paths"], part = bench_cpu_paths(
                stubs, args.cpu_rounds, args.tokens
            )
            lines += [""] + part
        if 3 in parts:
            report["prompt_cache"], part = bench_prompt_cache(fast, args.cache_rounds)
            lines += [""] + part
        # mlx_lm.server gets the weights as this backend runs them.
        breakdown = fast.Status(pb.HealthMessage()).memory.breakdown
        dequantize = breakdown["dequantized_weights"] > 0
        exported = export_mlx_folder(
            default_model_path(), Path(folder) / "mlx", dequantize=dequantize
        )
        if 4 in parts:
            report["batching"], part = bench_batching(
                fast,
                str(exported),
                folder,
                args.batch_rounds,
                args.batch_tokens,
                Path(args.out).parent / "batching.png",
            )
            lines += [""] + part
        if 5 in parts:
            no_sharing = stack.enter_context(
                running_server(options=("prefix_sharing:false",))
            )
            report["prefix"], part = bench_prefix(
                fast, no_sharing, str(exported), folder, args.prefix_rounds
            )
            lines += [""] + part
        if 6 in parts:
            # Two fresh servers, so neither carries the earlier parts' state.
            speculating = stack.enter_context(running_server())
            plain = stack.enter_context(running_server(options=("speculative:off",)))
            report["speculative"], part = bench_speculative(
                speculating, plain, str(exported), folder, args.speculative_rounds
            )
            lines += [""] + part
        if 8 in parts:
            fresh = stack.enter_context(running_server())
            report["memory"], part = bench_memory(
                fresh, running_server, args.memory_rounds, args.memory_tokens
            )
            lines += [""] + part
    if 7 in parts:
        # After the other parts' servers are gone: each rank wants the cores.
        report["distributed"], part = bench_distributed(
            args.distributed_rounds, args.distributed_tokens
        )
        lines += [""] + part

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    sys.stdout.write("\n".join(lines) + f"\nwritten to {out}\n")
    if not args.no_results:
        linux = sys.platform == "linux"  # part 2 runs on Linux only
        ran = [n for n in range(1, 9) if n in parts and (n != 2 or linux)]
        append_results(RESULTS, header, ran, lines)
        sys.stdout.write(f"appended to {RESULTS}\n")


if __name__ == "__main__":
    main()
