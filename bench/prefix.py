"""Part 5 of ``make bench``: bursts of requests that share a long system prompt.

Agents and chat front-ends send the same system prompt with every request, often
several at once. Each burst sends ``level`` chats at the same moment: one
~1000-token system prompt, new in every burst so no cache holds it, and a
different question each. The backend with prefix sharing on, the backend with it
off, and ``mlx_lm.server`` on the same weights and BLAS take turns, each going
first in turn. Then cancel-then-resend: a client reads the first token, cancels,
and asks the next question at once; its time to first token is compared with a
cold start.
"""

import logging
import statistics
import time

import backend_pb2 as pb
from bench.batching import (
    grpc_stream,
    http_stream,
    mlx_lm_server,
    percentile,
    run_concurrently,
)

logger = logging.getLogger(__name__)

LEVELS = (8, 16)
# Each burst asks only for the first tokens: time to first token is the measure.
TOKENS = 4
SYSTEM = (
    "You are the support assistant of Atelier Lumen, a small company in Lyon that "
    "makes and repairs handmade lamps. Answer politely and briefly. Opening hours "
    "are Tuesday to Saturday, 10:00 to 18:30. Repairs take two to three weeks and "
    "are quoted before any work starts. Shipping within France costs 9 euros and is "
    "free above 150 euros. Custom orders need a 30 percent deposit. "
)
QUESTIONS = (
    "When are you open?",
    "How long does a repair take?",
    "What does shipping cost?",
    "Do you make custom lamps?",
    "Can I visit on Monday?",
    "Is shipping free for a 200 euro order?",
    "How much is the deposit?",
    "Do you quote repairs first?",
)


def system_chat(burst: str, question: str) -> list[dict]:
    # A new opening for every burst, so no prompt cache serves it.
    return [
        {"role": "system", "content": f"Burst {burst}. " + SYSTEM * 9},
        {"role": "user", "content": question},
    ]


def run_burst(make_stream, burst: str, level: int) -> dict:
    """``level`` chats sent at once; their times to first token and the wall time."""
    questions = [QUESTIONS[i % len(QUESTIONS)] + f" ({i})" for i in range(level)]
    streams = run_concurrently(
        make_stream, [system_chat(burst, question) for question in questions]
    )
    ttfts = sorted(s.arrivals[0] - s.start for s in streams)
    begin = min(s.start for s in streams)
    return {
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "wall_s": max(s.arrivals[-1] for s in streams) - begin,
    }


def first_token_seconds(stub, messages: list[dict]) -> float:
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(**m) for m in messages],
        Tokens=TOKENS,
    )
    start = time.perf_counter()
    stream = stub.PredictStream(request)
    for reply in stream:
        if reply.message:
            seconds = time.perf_counter() - start
            stream.cancel()
            return seconds
    raise RuntimeError("no text came back")


def cancel_then_resend(stub, burst: str) -> dict:
    """A cold start's time to first token, and a resend's after a cancel."""
    # The first question is read to its first token and cancelled (a cold start);
    # the next is asked at once.
    cold = first_token_seconds(stub, system_chat(burst, QUESTIONS[0]))
    resend = first_token_seconds(stub, system_chat(burst, QUESTIONS[1]))
    return {"cold_ttft_s": cold, "resend_ttft_s": resend}


def bench_prefix(
    sharing, no_sharing, folder: str, log_folder: str, rounds: int
) -> tuple[dict, list[str]]:
    """Args:
    sharing: A backend stub with prefix sharing on; ``no_sharing``: with it off.
    folder: The exported MLX folder that ``mlx_lm.server`` serves.
    """
    eos = 2
    runs = {}
    with mlx_lm_server(folder, log_folder) as port:
        makers = {
            "sharing": lambda m: grpc_stream(sharing, m, TOKENS, eos),
            "no_sharing": lambda m: grpc_stream(no_sharing, m, TOKENS, eos),
            "mlx_lm": lambda m: http_stream(port, "default_model", m, TOKENS, eos),
        }
        for name, make in makers.items():
            make("Warm up.")
            runs[name] = {level: [] for level in LEVELS}
        for level in LEVELS:
            for r in range(rounds):
                names = list(makers)
                # Each round a different server goes first.
                names = names[r % 3 :] + names[: r % 3]
                for name in names:
                    logger.info(
                        "prefix burst: %s, %d streams, round %d", name, level, r + 1
                    )
                    burst = f"{name}.{level}.{r}"
                    runs[name][level].append(run_burst(makers[name], burst, level))
    resends = [cancel_then_resend(sharing, f"resend.{r}") for r in range(rounds + 1)]
    summary = {
        name: {
            level: {key: statistics.median(b[key] for b in bursts) for key in bursts[0]}
            for level, bursts in levels.items()
        }
        for name, levels in runs.items()
    }
    cold = statistics.median(r["cold_ttft_s"] for r in resends)
    resend = statistics.median(r["resend_ttft_s"] for r in resends)
    lines = [
        f"5. shared prefixes: bursts of chats with one ~1000-token system prompt, "
        f"median of {rounds} rounds, each server first in turn",
        f"{'streams':>7}  {'server':<16}{'TTFT mean s':>12}{'p95 s':>8}{'wall s':>8}",
    ]
    labels = {
        "sharing": "sharing on",
        "no_sharing": "sharing off",
        "mlx_lm": "mlx_lm.server",
    }
    for level in LEVELS:
        for name, label in labels.items():
            s = summary[name][level]
            lines.append(
                f"{level:>7}  {label:<16}{s['ttft_mean_s']:>12.2f}"
                f"{s['ttft_p95_s']:>8.2f}{s['wall_s']:>8.2f}"
            )
        ours = summary["sharing"][level]["ttft_mean_s"]
        lines.append(
            f"{level:>7}  mean TTFT, sharing on is "
            f"{summary['mlx_lm'][level]['ttft_mean_s'] / ours:.1f}x mlx_lm.server's "
            f"and {summary['no_sharing'][level]['ttft_mean_s'] / ours:.1f}x sharing off's"
        )
    lines.append(
        f"cancel-then-resend TTFT {resend:.3f} s vs cold {cold:.3f} s: "
        f"{cold / resend:.1f}x faster"
    )
    report = {"runs": runs, "summary": summary, "resends": resends}
    return report, lines
