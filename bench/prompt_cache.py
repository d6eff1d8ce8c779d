"""Part 3 of ``make bench``: the prompt cache. Time to first token for a
~1500-token prompt, cold and warm (after a request that shared its prefix), and
the prompt tokens actually prefilled over a 6-turn chat against the tokens new in
each turn.
"""

import statistics
import time

import backend_pb2 as pb
from bench.overhead import LONG_TEXT

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
