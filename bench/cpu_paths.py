"""Part 2 of ``make bench`` (Linux CPU): the CPU paths. The stock path (bundled
BLAS, quantized kernels), float32 weights on OpenBLAS, and the fast path that
``auto`` picks (MKL on x86_64), each on its own server: prefill tok/s on a
1000-token prompt, decode tok/s, and peak memory, over alternating rounds.
"""

import logging

import backend_pb2 as pb
from bench.overhead import LONG_TEXT, median_of, server_decode

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 1000


def server_prefill(stub, prompt: str) -> dict:
    reply = stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=1))
    seconds = reply.timing_prompt_processing / 1000
    return {
        "prompt_tokens": reply.prompt_tokens,
        "prefill_tps": reply.prompt_tokens / seconds,
    }


def long_prompt(stub, round: int, tokens: int = PREFILL_TOKENS) -> str:
    """Text of exactly ``tokens`` tokens, opening differently in each round.

    A new opening keeps the prompt cache from serving a round what an earlier one
    prefilled.
    """
    # LONG_TEXT is about 27 tokens.
    text = f"Round {round}. " + LONG_TEXT * (tokens // 16)
    ids = stub.TokenizeString(pb.PredictOptions(Prompt=text)).tokens
    return stub.Detokenize(pb.DetokenizeRequest(tokens=ids[:tokens])).content


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
        f"{'path':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak MiB':>10}",
    ]
    for name, s in summary.items():
        lines.append(
            f"{name:<14}{s['prefill_tps']:>15.1f}{s['decode_tps']:>14.2f}"
            f"{s['peak_mb']:>10.0f}"
        )
    for name, s in summary.items():
        if name != "stock":
            prefill = s["prefill_tps"] / stock["prefill_tps"]
            decode = s["decode_tps"] / stock["decode_tps"]
            lines.append(
                f"{name} / stock: prefill {prefill:.1f}x, decode {decode:.2f}x"
            )
    if "glibc malloc" in runs:
        # The malloc alone, round by round (each round's servers ran back to back).
        ratios = [
            fast["decode_tps"] / glibc["decode_tps"]
            for fast, glibc in zip(
                runs["fast"]["decode"], runs["glibc malloc"]["decode"]
            )
        ]
        lines.append(
            "fast / glibc malloc, decode by round: "
            + " / ".join(f"{r:.2f}x" for r in ratios)
            + f" (worst {min(ratios):.2f}x)"
        )
    return {"runs": runs, "summary": summary}, lines
