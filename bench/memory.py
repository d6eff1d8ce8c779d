"""Part 8 of ``make bench``: memory and persistence.

KV cache types: the bytes of KV state per token, and decode tok/s at 1 and 8
streams over a ~4000-token context (one document, a different question per
stream), at full precision (float32 on the CPU path), ``q8_0`` and ``q4_0``, each
loaded through ``CacheTypeKey`` / ``CacheTypeValue`` with speculative decoding off,
and taking turns first.
Then prompt cache files: the first request after a start, with a ~1500-token
system prompt, without a ``PromptCachePath`` file and, after a restart, with it.
"""

import logging
import statistics
import tempfile
import time
from pathlib import Path

import backend_pb2 as pb
from bench.batching import grpc_stream, run_concurrently

logger = logging.getLogger(__name__)

CACHE_TYPES = ("", "q8_0", "q4_0")
LEVELS = (1, 8)
CONTEXT_TOKENS = 4000
SYSTEM_TOKENS = 1500
TEXT = (
    "The archive of the harbour office lists every ship that docked in the bay, "
    "its cargo, its crew and the weather on the day it arrived. "
)
QUESTIONS = (
    "Which ships carried grain?",
    "What was the weather like?",
    "How large were the crews?",
    "Which cargo was the most valuable?",
    "Did any ship arrive twice?",
    "What came in winter?",
    "Who kept the records?",
    "What changed over the years?",
)


def document(stub, tokens: int, opening: str) -> str:
    """Text of exactly ``tokens`` tokens; a new opening keeps caches from serving it."""
    text = f"{opening}. " + TEXT * (tokens // 20)
    ids = stub.TokenizeString(pb.PredictOptions(Prompt=text)).tokens
    return stub.Detokenize(pb.DetokenizeRequest(tokens=ids[:tokens])).content


def chat(system: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]


def load(stub, cache_type: str, model_path: str = "") -> None:
    # Without speculation: a lone stream over a repetitive document would measure
    # how well n-gram lookup guesses, not the KV cache.
    request = pb.ModelOptions(
        Model="default",
        CacheTypeKey=cache_type,
        CacheTypeValue=cache_type,
        ModelPath=model_path,
        Options=["speculative:off"],
    )
    result = stub.LoadModel(request)
    assert result.success, result.message


def breakdown(stub) -> dict:
    return dict(stub.Status(pb.HealthMessage()).memory.breakdown)


def kv_bytes_per_token(stub, system: str) -> float:
    """One request on an empty prompt cache: its entry's bytes per token."""
    messages = [pb.Message(**m) for m in chat(system, QUESTIONS[0])]
    reply = stub.Predict(
        pb.PredictOptions(UseTokenizerTemplate=True, Messages=messages, Tokens=1)
    )
    figures = breakdown(stub)
    assert figures["prompt_cache_entries"] == 1, figures
    return figures["prompt_cache_bytes"] / reply.prompt_tokens


def decode_rate(stub, system: str, level: int, tokens: int, eos: int) -> float:
    """Aggregate decode tok/s of ``level`` streams over one shared context."""
    chats = [chat(system, f"{QUESTIONS[i % 8]} ({i})") for i in range(level)]
    streams = run_concurrently(lambda m: grpc_stream(stub, m, tokens, eos), chats)
    decoded = sum(len(s.arrivals) - 1 for s in streams)
    first = min(s.arrivals[0] for s in streams)
    return decoded / (max(s.arrivals[-1] for s in streams) - first)


def bench_cache_types(stub, rounds: int, tokens: int) -> dict:
    eos = 2
    runs = {name: [] for name in CACHE_TYPES}
    for r in range(rounds):
        names = CACHE_TYPES[r % 3 :] + CACHE_TYPES[: r % 3]
        for name in names:
            logger.info("KV cache type %s, round %d", name or "full", r + 1)
            load(stub, name)
            system = document(stub, CONTEXT_TOKENS, f"Ledger {name}.{r}")
            run = {"kv_bytes_per_token": kv_bytes_per_token(stub, system)}
            for level in LEVELS:
                run[f"decode_tps_{level}"] = decode_rate(
                    stub, system, level, tokens, eos
                )
            runs[name].append(run)
    load(stub, "")
    return runs


def first_request_ttft(stub, system: str, path: str) -> float:
    messages = [pb.Message(**m) for m in chat(system, QUESTIONS[1])]
    request = pb.PredictOptions(
        UseTokenizerTemplate=True, Messages=messages, Tokens=8, PromptCachePath=path
    )
    reply_at = None
    start = time.perf_counter()
    for reply in stub.PredictStream(request):
        reply_at = reply_at or time.perf_counter()
    return reply_at - start


def bench_files(start_server, rounds: int) -> dict:
    """TTFT of the first request after a start: without a file, then after a
    restart with the file that request wrote."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(rounds):
            path = f"system-{r}.cache"
            times = {}
            for name in ("without_file", "with_file"):
                with start_server() as stub:
                    load(stub, "", model_path=folder)
                    system = document(stub, SYSTEM_TOKENS, f"Session {r}")
                    logger.info("prompt cache file: %s, round %d", name, r + 1)
                    times[name] = first_request_ttft(stub, system, path)
            times["file_bytes"] = (Path(folder) / path).stat().st_size
            runs.append(times)
    return runs


def bench_memory(stub, start_server, rounds: int, tokens: int) -> tuple[dict, list]:
    """Args:
    stub: A fresh backend's stub; it ends with the default model reloaded.
    start_server: A context manager factory yielding a new backend's stub.
    """
    types = bench_cache_types(stub, rounds, tokens)
    files = bench_files(start_server, rounds)
    median = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in types.items()
    }
    full = median[""]
    lines = [
        f"8. memory and persistence: KV cache types over a {CONTEXT_TOKENS}-token "
        f"context, {tokens} tokens per stream, median of {rounds} rounds",
        f"{'cache type':<12}{'KV bytes/token':>16}{'vs full':>9}"
        + "".join(f"{f'{level} streams tok/s':>20}" for level in LEVELS),
    ]
    for name, m in median.items():
        lines.append(
            f"{name or 'full (f32)':<12}{m['kv_bytes_per_token']:>16.0f}"
            f"{full['kv_bytes_per_token'] / m['kv_bytes_per_token']:>8.2f}x"
            + "".join(
                f"{m[f'decode_tps_{level}']:>12.1f} ({m[f'decode_tps_{level}'] / full[f'decode_tps_{level}']:.2f}x)"
                for level in LEVELS
            )
        )
    without = statistics.median(r["without_file"] for r in files)
    with_file = statistics.median(r["with_file"] for r in files)
    lines.append(
        f"first request after a start, {SYSTEM_TOKENS}-token system prompt: TTFT "
        f"{without:.3f} s without its PromptCachePath file, {with_file:.3f} s with it "
        f"({without / with_file:.1f}x; file {files[0]['file_bytes'] / 2**20:.0f} MiB)"
    )
    return {"cache_types": types, "files": files}, lines
