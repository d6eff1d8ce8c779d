"""Part 14 of ``make bench``: Rerank. Documents per second for 100 documents of about
200 tokens against one query on a yes/no reranker, three ways: one Rerank, whose
documents are judged in batches after the judging prompt and the query prefilled
once; each document its own Score of "yes" and "no" on its whole prompt, which
shares that prefix through the prompt cache (how Rerank ran before it batched); and
the same Scores without a prompt cache, every document prefilled whole. Rounds
alternate the order of the sides; each round has a query of its own, so nothing
finds it cached from the round before.
"""

import statistics
import time

import backend_pb2 as pb
from bench.overhead import LONG_TEXT
from mlx_backend.formats.rerank import make_rerank_form
from mlx_backend.models.gguf import load_gguf
from mlx_backend.models.loading import default_model_path

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


def scores_seconds(stub, prompts: list[str]) -> float:
    """Every prompt's Score of the two answers, sent at once."""
    start = time.perf_counter()
    futures = [
        stub.Score.future(pb.ScoreRequest(prompt=p, candidates=["yes", "no"]))
        for p in prompts
    ]
    for future in futures:
        future.result()
    return time.perf_counter() - start


def bench_rerank(running_server, rounds: int) -> tuple[dict, list[str]]:
    passages = documents()
    _, tokenizer, _ = load_gguf(default_model_path())
    instruction = INSTRUCTION.partition(":")[2]
    form = make_rerank_form("yes_no", instruction, tokenizer)
    with running_server(options=(*SHARED, INSTRUCTION)) as shared, running_server(
        options=(*UNSHARED, INSTRUCTION)
    ) as unshared:
        rerank_seconds(shared, "Warm up?", passages[:4])
        scores_seconds(unshared, [form.text("Warm up?", p) for p in passages[:4]])

        counted = []

        def reranked(query: str) -> float:
            spent, tokens = rerank_seconds(shared, query, passages)
            counted.append(tokens)
            return spent

        def sides(query: str) -> dict:
            prompts = [form.text(query, p) for p in passages]
            return {
                "one Rerank": lambda: reranked(query),
                "Scores, shared": lambda: scores_seconds(shared, prompts),
                "Scores, no cache": lambda: scores_seconds(unshared, prompts),
            }

        seconds = {name: [] for name in sides("")}
        for i in range(rounds):
            query = f"Round {i}: who kept the lighthouse, and when was the lamp lit?"
            order = list(sides(query).items())
            for name, run in order if i % 2 == 0 else order[::-1]:
                seconds[name].append(run())
    rate = {name: DOCUMENTS / statistics.median(s) for name, s in seconds.items()}
    worst = {name: DOCUMENTS / max(s) for name, s in seconds.items()}
    lines = [
        f"14. rerank: {DOCUMENTS} documents of ~{counted[0] // DOCUMENTS} prompt tokens "
        f"against one query, yes/no reranker, {rounds} alternating rounds",
        f"{'side':<20}{'documents/s':>12}{'worst':>8}{'seconds':>10}",
    ]
    for name, values in seconds.items():
        lines.append(
            f"{name:<20}{rate[name]:>12.1f}{worst[name]:>8.1f}"
            f"{statistics.median(values):>10.2f}"
        )
    base = rate["Scores, no cache"]
    lines.append(
        "against Scores without a cache: "
        + ", ".join(f"{name} {rate[name] / base:.2f}x" for name in list(rate)[:2])
    )
    report = {"documents_per_second": rate, "worst": worst, "seconds": seconds}
    return report, lines
