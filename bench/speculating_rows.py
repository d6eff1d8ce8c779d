"""Speculating rows beside a long prompt: the served paged decoder's pacer, in-process.

Two chat streams decode with 8 draft tokens (n-gram lookup, the default) until
their greedy text loops and their rows verify proposals most steps; then a
3,800-token prompt arrives. Reports the prompt's first token against its time
alone (the same prompt with nothing decoding), the steps that verified, the
steps' time against what their rows alone take, and the streams' tokens. The
embedded model, q8_0 KV as part 16 runs it; ``--warm`` sets the streams' steps
before the prompt.

    venv/bin/python -m bench.speculating_rows [--rounds 1] [--warm 1000]
"""

import argparse
import statistics
import time
from dataclasses import replace

from bench.overhead import LONG_TEXT
from mlx_backend.cpu.preload import maybe_reexec_with_preloads
from tests.engine_helpers import (
    chat_prompt,
    load_engine,
    new_sequence,
    on_engine_thread,
)

PROMPT_TOKENS = 3800
DRAFT_TOKENS = 8
TOPICS = ("dragon", "robot")


def measure(engine, model, options, warm: int, round_: int) -> dict:
    decoder = engine.served.decoder
    tokenizer = engine.info.tokenizer
    ids = tokenizer.encode(f"Round {round_}. " + LONG_TEXT * 300)[:PROMPT_TOKENS]
    prompt = tuple(ids)
    alone_s = first_token_seconds(decoder, model, options, prompt)
    steps = []
    observe = decoder.pacer.observe

    def timed(seconds, rows, chunk, read=False):
        steps.append((seconds, rows, chunk, read, decoder.pacer.alone_s(rows, read)))
        observe(seconds, rows, chunk, read)

    decoder.pacer.observe = timed
    try:
        keys = [
            decoder.add(
                replace(
                    new_sequence(
                        model,
                        options,
                        chat_prompt(
                            engine,
                            f"Write a long story about a {topic} who learns to "
                            f"cook (round {round_}). Make it detailed.",
                        ),
                        10**6,
                    ),
                    draft_tokens=DRAFT_TOKENS,
                )
            )
            for topic in TOPICS
        ]
        for _ in range(warm):
            decoder.step()
        before = len(steps)
        key = decoder.add(new_sequence(model, options, prompt, 4))
        start, first, streamed = time.perf_counter(), None, 0
        while first is None:
            for result in decoder.step():
                if result.key == key and result.tokens:
                    first = time.perf_counter() - start
                elif result.key in keys:
                    streamed += len(result.tokens)
        for k in (*keys, key):
            decoder.remove(k, keep_state=False)
    finally:
        decoder.pacer.observe = observe
    warm_steps, during = steps[:before], steps[before:]
    chunked = [s for s in during if s[2].tokens]
    return {
        "ttft_s": first,
        "alone_s": alone_s,
        "steps": len(during),
        "verified": sum(1 for s in during if s[3]),
        "warm_verified": sum(1 for s in warm_steps if s[3]),
        "warm_steps": len(warm_steps),
        "before_ms": statistics.median(s[0] for s in warm_steps[-50:]) * 1e3,
        "step_ms": statistics.median(s[0] for s in during) * 1e3,
        "max_step_ms": max(s[0] for s in during) * 1e3,
        "mean_over_rows": statistics.mean(s[0] / s[4] for s in chunked),
        "max_over_rows": max(s[0] / s[4] for s in chunked),
        "streamed": streamed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warm", type=int, default=1000)
    args = parser.parse_args()
    maybe_reexec_with_preloads()
    engine = load_engine("kv_bits:8", "kv_group_size:32")
    print(
        f"speculating rows: 2 chat streams, {DRAFT_TOKENS} draft tokens, "
        f"{args.warm} steps, then a {PROMPT_TOKENS}-token prompt (q8_0 KV)"
    )
    print(
        f"{'round':>5}{'TTFT s':>8}{'alone s':>8}{'x alone':>8}{'steps':>6}"
        f"{'verified':>9}{'before ms':>10}{'step ms':>8}{'max ms':>7}"
        f"{'/rows':>6}{'max/rows':>9}{'streamed':>9}"
    )
    try:
        for round_ in range(args.rounds):
            r = on_engine_thread(
                engine,
                lambda model, options: measure(
                    engine, model, options, args.warm, round_
                ),
            )
            print(
                f"{round_:>5}{r['ttft_s']:>8.1f}{r['alone_s']:>8.1f}"
                f"{r['ttft_s'] / r['alone_s']:>7.2f}x{r['steps']:>6}"
                f"{r['verified']:>9}{r['before_ms']:>10.0f}{r['step_ms']:>8.0f}"
                f"{r['max_step_ms']:>7.0f}{r['mean_over_rows']:>5.1f}x"
                f"{r['max_over_rows']:>8.1f}x{r['streamed']:>9}",
                flush=True,
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
