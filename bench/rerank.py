"""Part 14 of ``make bench``: Rerank. Documents per second for 100 documents of about
200 tokens against one query, on a yes/no reranker whose prompt cache shares the
judging prompt and the query between documents, against one without a prompt cache
(every document prefilled whole). Rounds alternate between the two; each round has a
query of its own, so neither finds it cached from the round before.
"""

import statistics
import time

import backend_pb2 as pb
from bench.overhead import LONG_TEXT

DOCUMENTS = 100
# The reranker's options: the shared side, and the side without a prompt cache.
SHARED = ("reranker:yes_no",)
UNSHARED = ("reranker:yes_no", "max_cache_entries:0")
# A long instruction, as retrieval pipelines write them: the prefix documents share.
INSTRUCTION = (
    "rerank_instruction:"
    + (
        "Given a question from a reader of a maritime history archive, judge whether the "
        "passage answers it directly, names the people, places and dates it asks about, "
        "and would let the reader answer without reading anything else. "
    )
    * 2
)


def documents() -> list[str]:
    """100 passages of about 200 tokens, each with its own opening."""
    words = LONG_TEXT.split()
    return [
        f"Passage {i}. " + " ".join(words[(7 * i + j) % len(words)] for j in range(150))
        for i in range(DOCUMENTS)
    ]


def rerank_seconds(stub, query: str, passages: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    result = stub.Rerank(pb.RerankRequest(query=query, documents=passages))
    return time.perf_counter() - start, result.usage.prompt_tokens


def bench_rerank(running_server, rounds: int) -> tuple[dict, list[str]]:
    passages = documents()
    with running_server(options=(*SHARED, INSTRUCTION)) as shared, running_server(
        options=(*UNSHARED, INSTRUCTION)
    ) as unshared:
        sides = {"shared prefix": shared, "no prompt cache": unshared}
        for stub in sides.values():  # warm both
            rerank_seconds(stub, "Warm up?", passages[:4])
        seconds = {name: [] for name in sides}
        tokens = 0
        for i in range(rounds):
            query = f"Round {i}: who kept the lighthouse, and when was the lamp lit?"
            order = list(sides.items())
            for name, stub in order if i % 2 == 0 else order[::-1]:
                spent, tokens = rerank_seconds(stub, query, passages)
                seconds[name].append(spent)
    rate = {name: DOCUMENTS / statistics.median(s) for name, s in seconds.items()}
    gain = rate["shared prefix"] / rate["no prompt cache"]
    lines = [
        f"14. rerank: {DOCUMENTS} documents of ~{tokens // DOCUMENTS} prompt tokens "
        f"against one query, yes/no reranker, median of {rounds} alternating rounds",
        f"{'side':<20}{'documents/s':>12}{'seconds':>10}",
    ]
    for name, values in seconds.items():
        lines.append(f"{name:<20}{rate[name]:>12.1f}{statistics.median(values):>10.2f}")
    lines.append(f"shared / no prompt cache: {gain:.2f}x")
    report = {"documents_per_second": rate, "seconds": seconds, "gain": gain}
    return report, lines
