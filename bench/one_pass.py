"""Part 16 of ``make bench``: one forward pass per step over paged KV
(``paged:true``) beside the batch decoder (``paged:false``), side by side.

Both sides run with speculation off (part 6 measures it).

1. Part 11's long-prompt scenario (``bench/admission.py``) with streams that
   decode through the whole prefill, as on a server that is never idle: on each
   side a lone stream's inter-token time and the long prompt's time to first token
   alone are measured first, and the streams get the tokens that last the 4 s
   before the prompt plus twice its time alone at that pace. Runs alternate the
   sides' order; each side is judged by its worst run against issue 68's goals.
2. Arrivals: 16 clients in a loop send prompts of 50 to 2,000 tokens (a fixed
   seed, a new opening each, so no prompt cache serves them) for 128 tokens each,
   for ``--one-pass-seconds``; then their last requests finish. Output tokens/s,
   requests, time to first token and inter-token time p50/p99, per side.
"""

import logging
import math
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from bench.admission import (
    BEFORE_S,
    EOS,
    LONG_TOKENS,
    SEED,
    LongPrompt,
    grpc_maker,
    long_prompt_run,
)
from bench.batching import Stream, grpc_stream, percentile
from bench.model_families import varied_text

logger = logging.getLogger(__name__)

# Speculation off on both sides: the streams' looping greedy text would let the
# paged decoder's rows verify n-gram proposals, and streams sized from a lone
# stream's pace would then end before the prompt (part 6 measures speculation).
SIDES = {
    "paged": ("paged:true", "speculative:off"),
    "batch": ("paged:false", "speculative:off"),
}
CONTEXT_SIZE = 8192
PACE_TOKENS = 64
# Issue 68's goals, every run.
GOAL_LONG_OVER_ALONE = 1.5
GOAL_GAP_RATIO = 4.0
GOAL_DURING_RATIO = 3.0
GOAL_SHORT_TTFT_S = 0.5
GOAL_ARRIVALS_TPS = 1.2
GOAL_ARRIVALS_ITL_P99 = 3.0
# Scenario 2.
CLIENTS = 16
ARRIVAL_TOKENS = 128
PROMPT_RANGE = (50, 2000)


def arrival_prompts(tokenizer, count: int) -> list[str]:
    """``count`` prompts of 50 to 2,000 tokens of varied text, from a fixed seed,
    each with an opening of its own."""
    rng = random.Random(SEED + 1)
    text = varied_text(rng, tokenizer, PROMPT_RANGE[1] + 64)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for i in range(count):
        length = rng.randint(*PROMPT_RANGE)
        start = rng.randrange(0, len(ids) - length)
        body = tokenizer.decode(ids[start : start + length])
        prompts.append(f"Request {i}. Summarize: {body}")
    return prompts


def arrivals(stub, prompts: list[str], seconds: float) -> dict:
    """Scenario 2 on one server: its figures."""
    streams: list[Stream] = []
    lock = threading.Lock()
    taken = iter(range(len(prompts)))
    began = time.perf_counter()

    def client() -> None:
        while time.perf_counter() - began < seconds:
            with lock:
                i = next(taken, None)
            if i is None:
                return
            stream = grpc_stream(stub, prompts[i], ARRIVAL_TOKENS, EOS)
            with lock:
                streams.append(stream)

    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        for _ in range(CLIENTS):
            pool.submit(client)
    end = max(s.arrivals[-1] for s in streams if s.arrivals)
    ttfts = sorted(s.arrivals[0] - s.start for s in streams if s.arrivals)
    gaps = sorted(b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]))
    return {
        "requests": len(streams),
        "tokens_per_s": sum(s.tokens for s in streams) / (end - began),
        "wall_s": end - began,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_ms": percentile(gaps, 0.5) * 1e3,
        "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
    }


def pace(stub, long_text: str) -> tuple[float, float]:
    """A lone stream's median inter-token time, and the long prompt's time to
    its first token alone (a warm-up opening no later prompt shares)."""
    stream = grpc_stream(
        stub, "Pace. Write a story about a lighthouse.", PACE_TOKENS, EOS
    )
    gaps = [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:])]
    alone = grpc_stream(stub, f"Pace document. {long_text}", 4, EOS)
    return statistics.median(gaps), alone.arrivals[0] - alone.start


def met(run: LongPrompt) -> dict[str, bool]:
    return {
        "long": run.long_over_alone <= GOAL_LONG_OVER_ALONE,
        "gap": bool(run.tokens_after) and run.gap_ratio <= GOAL_GAP_RATIO,
        "during": run.during_ratio <= GOAL_DURING_RATIO,
        "short": run.short_ttft_s <= GOAL_SHORT_TTFT_S,
    }


def bench_one_pass(
    running_process,
    folder: Path,
    runs: int,
    seconds: float,
    paged_options: tuple[str, ...] = (),
) -> tuple[dict, list[str]]:
    """Args:
    running_process: ``bench.running_process``: a fresh backend.
    folder: The default model as an MLX folder (its tokenizer).
    runs: Runs of scenario 1 on each side (0: none).
    seconds: How long scenario 2's clients send requests (0: no scenario 2).
    paged_options: More LoadModel options for the paged side.
    """
    sides = dict(SIDES, paged=(*SIDES["paged"], *paged_options))
    tokenizer = load_tokenizer(folder)
    long_text = varied_text(random.Random(SEED), tokenizer, LONG_TOKENS)
    results: dict[str, list[LongPrompt]] = {name: [] for name in SIDES}
    sizing = {}
    with ExitStack() as stack:
        stubs = {}
        for name, options in sides.items():
            server = stack.enter_context(running_process())
            loaded = server.stub.LoadModel(
                pb.ModelOptions(
                    Model="default", ContextSize=CONTEXT_SIZE, Options=list(options)
                )
            )
            assert loaded.success, loaded.message
            stubs[name] = server.stub
        for name, stub in stubs.items() if runs else ():
            itl, alone = pace(stub, long_text)
            tokens = math.ceil((BEFORE_S + 2 * alone) / itl)
            sizing[name] = (itl, alone, tokens)
            logger.info(
                "one pass: %s ITL %.1f ms, alone %.1f s", name, itl * 1e3, alone
            )
        order = list(SIDES)
        for run in range(runs):
            for name in order if run % 2 == 0 else order[::-1]:
                logger.info("one pass: %s, run %d", name, run)
                results[name].append(
                    long_prompt_run(
                        grpc_maker(stubs[name]),
                        long_text,
                        run,
                        stream_tokens=sizing[name][2],
                    )
                )
        flows = {}
        if seconds:
            prompts = arrival_prompts(tokenizer, 4096)
            for name in order[::-1]:
                logger.info("one pass: arrivals on %s", name)
                flows[name] = arrivals(stubs[name], prompts, seconds)
    report = {
        "arrivals": flows,
        "sizing": sizing,
        "runs": {
            name: [vars(r) | {"met": met(r)} for r in rs]
            for name, rs in results.items()
        },
    }
    lines = lines_of(results, sizing, sides["paged"]) if runs else []
    return report, lines + (arrival_lines(flows, seconds) if flows else [])


def arrival_lines(flows: dict, seconds: float) -> list[str]:
    lines = [
        f"16. (2) arrivals: {CLIENTS} clients send prompts of {PROMPT_RANGE[0]}-"
        f"{PROMPT_RANGE[1]} tokens for {ARRIVAL_TOKENS} tokens each, for "
        f"{seconds:g} s, then their last requests finish",
        f"{'side':<7}{'requests':>9}{'tok/s':>7}{'wall s':>8}{'TTFT p50 s':>11}"
        f"{'p99 s':>7}{'ITL p50 ms':>11}{'p99 ms':>8}{'p99/p50':>8}",
    ]
    for name, f in flows.items():
        lines.append(
            f"{name:<7}{f['requests']:>9}{f['tokens_per_s']:>7.1f}{f['wall_s']:>8.1f}"
            f"{f['ttft_p50_s']:>11.2f}{f['ttft_p99_s']:>7.2f}{f['itl_p50_ms']:>11.1f}"
            f"{f['itl_p99_ms']:>8.1f}{f['itl_p99_ms'] / f['itl_p50_ms']:>7.1f}x"
        )
    if {"paged", "batch"} <= flows.keys():
        ratio = flows["paged"]["tokens_per_s"] / flows["batch"]["tokens_per_s"]
        spread = flows["paged"]["itl_p99_ms"] / flows["paged"]["itl_p50_ms"]
        lines.append(
            f"paged / batch tok/s {ratio:.2f}x (goal >= {GOAL_ARRIVALS_TPS:g}x, "
            f"{'met' if ratio >= GOAL_ARRIVALS_TPS else 'missed'}); paged ITL p99/p50 "
            f"{spread:.1f}x (<= {GOAL_ARRIVALS_ITL_P99:g}x, "
            f"{'met' if spread <= GOAL_ARRIVALS_ITL_P99 else 'missed'})"
        )
    return lines


def lines_of(
    results: dict[str, list[LongPrompt]], sizing: dict, paged: tuple[str, ...]
) -> list[str]:
    lines = [
        f"16. one pass over paged KV ({', '.join(paged)}) beside the batch decoder "
        f"({', '.join(SIDES['batch'])}): a {LONG_TOKENS}-token prompt {BEFORE_S:g} s after 2 streams "
        "began, a one-line request 0.5 s later; the streams decode through the "
        "whole prefill (tokens: 4 s plus twice the prompt's time alone, at a lone "
        f"stream's pace); ContextSize {CONTEXT_SIZE}, greedy, EOS banned",
        f"{'side':<7}{'run':>4}{'ITL ms':>7}{'gap/ITL':>8}{'prefill /ITL':>13}"
        f"{'short TTFT s':>13}{'long TTFT s':>12}{'alone s':>8}{'long/alone':>11}"
        f"{'after':>6}{'outlast':>8}",
    ]
    for name, runs in results.items():
        itl, alone, tokens = sizing[name]
        lines.append(
            f"{name}: lone stream {itl * 1e3:.1f} ms a token, the prompt alone "
            f"{alone:.1f} s, streams of {tokens} tokens"
        )
        for i, run in enumerate(runs):
            lines.append(
                f"{name:<7}{i:>4}{run.before_s * 1e3:>7.1f}{run.gap_ratio:>7.1f}x"
                f"{run.during_ratio:>12.1f}x{run.short_ttft_s:>13.2f}"
                f"{run.long_ttft_s:>12.2f}{run.alone_ttft_s:>8.2f}"
                f"{run.long_over_alone:>10.2f}x{run.tokens_after:>6}"
                f"{'yes' if run.streams_outlast_long else 'no':>8}"
            )
    for name, runs in results.items():
        worst = {
            "long": max(r.long_over_alone for r in runs),
            "gap": max(r.gap_ratio for r in runs),
            "during": max(r.during_ratio for r in runs),
            "short": max(r.short_ttft_s for r in runs),
        }
        every = {goal: all(met(r)[goal] for r in runs) for goal in worst}
        verdict = {goal: "met" if ok else "missed" for goal, ok in every.items()}
        lines.append(
            f"{name}, worst of {len(runs)}: long TTFT {worst['long']:.2f}x alone "
            f"(<= {GOAL_LONG_OVER_ALONE:g}x, {verdict['long']}); longest gap "
            f"{worst['gap']:.1f}x (<= {GOAL_GAP_RATIO:g}x, {verdict['gap']}); while "
            f"prefilling {worst['during']:.1f}x (<= {GOAL_DURING_RATIO:g}x, "
            f"{verdict['during']}); short TTFT {worst['short']:.2f} s "
            f"(<= {GOAL_SHORT_TTFT_S:g} s, {verdict['short']})"
        )
    return lines
