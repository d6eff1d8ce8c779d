"""Rerank over gRPC (LocalAI's /v1/rerank) on the embedded model loaded as a yes/no
reranker: each document's relevance is the probability of "yes" against "no" that
Score gives on the same prompt, results come sorted and cut to top_n with their
texts and the tokens counted, and bad requests get statuses naming the field.
(The 135M model is too small to rank well: only the arithmetic is checked.)"""

import math
import threading
import time

import grpc
import pytest

import backend_pb2 as pb
from mlx_backend.formats.rerank import make_rerank_form
from mlx_backend.models.gguf import load_gguf
from mlx_backend.models.loading import default_model_path
from tests.support import (
    ANSWER,
    chat,
    device_tolerance,
    error_of,
    run_concurrently,
)

CONTEXT = 512
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are rich in potassium.",
    "The Eiffel Tower stands in Paris.",
    "Bananas are rich in potassium.",  # the same text: the same score, by index
]


@pytest.fixture(scope="module")
def reranker(server):
    # A short context: the document cut to it prefills quickly.
    result = server.stub.LoadModel(
        pb.ModelOptions(
            Model="default", ContextSize=CONTEXT, Options=["reranker:yes_no"]
        )
    )
    assert result.success, result.message
    assert "reranker yes_no" in server.logs()
    return server


@pytest.fixture(scope="module")
def form():
    _, tokenizer, _ = load_gguf(default_model_path())
    return make_rerank_form("yes_no", "", tokenizer)


def rerank(stub, top_n: int = 0, documents=DOCUMENTS, query=QUERY):
    return stub.Rerank(pb.RerankRequest(query=query, documents=documents, top_n=top_n))


def test_relevance_is_yes_against_no_as_score_gives_it(reranker, form):
    result = rerank(reranker.stub)
    by_index = {r.index: r.relevance_score for r in result.results}
    prompt_tokens = 0
    for i, document in enumerate(DOCUMENTS):
        text = form.text(QUERY, document)
        scored = reranker.stub.Score(
            pb.ScoreRequest(prompt=text, candidates=["yes", "no"])
        )
        yes, no = (c.log_prob for c in scored.candidates)
        expected = 1 / (1 + math.exp(no - yes))
        assert by_index[i] == pytest.approx(expected, abs=device_tolerance(1e-5))
        prompt_tokens += reranker.stub.TokenizeString(
            pb.PredictOptions(Prompt=text)
        ).length
    assert result.usage.prompt_tokens == prompt_tokens == result.usage.total_tokens


def test_documents_share_the_query_from_the_prompt_cache(reranker, form):
    def reused() -> int:
        status = reranker.stub.Status(pb.HealthMessage())
        return status.memory.breakdown["prompt_cache_reused_tokens"]

    query = "Which of these is about rivers in France?"
    head = reranker.stub.TokenizeString(
        pb.PredictOptions(Prompt=form.text(query, "")[: -len(form.suffix)])
    ).length
    before = reused()
    rerank(reranker.stub, query=query)
    # Every document after the first starts from the judging prompt and the query.
    assert reused() - before >= (len(DOCUMENTS) - 1) * (head - 2)


def test_results_are_sorted_with_their_texts_and_cut_to_top_n(reranker):
    every = rerank(reranker.stub).results
    assert sorted(r.index for r in every) == list(range(len(DOCUMENTS)))
    scores = [r.relevance_score for r in every]
    assert scores == sorted(scores, reverse=True) and 0 < min(scores) < max(scores) < 1
    assert all(r.text == DOCUMENTS[r.index] for r in every)
    # The twin documents tie: the lower index first.
    twins = [r.index for r in every if r.text == DOCUMENTS[1]]
    assert twins == [1, 3]
    assert list(rerank(reranker.stub, top_n=1).results) == every[:1]
    assert list(rerank(reranker.stub, top_n=3).results) == every[:3]
    assert list(rerank(reranker.stub, top_n=10).results) == every


def test_200_documents_beside_two_streams(reranker):
    """The documents run a chunk at a time between decode steps: while they are
    judged, the streams go on (no pause near as long as the judging) and keep
    their greedy text, and every document is ranked."""
    documents = [f"Note {i}: the market opens at {i % 12 + 1}." for i in range(200)]
    decoding = threading.Event()

    def stream():
        texts, times = [], []
        for reply in reranker.stub.PredictStream(chat(Tokens=60, IgnoreEOS=True)):
            texts.append(reply.message.decode())
            times.append(time.monotonic())
            decoding.set()
        return "".join(texts), times

    def documents_ranked():
        decoding.wait(60)
        start = time.monotonic()
        result = rerank(reranker.stub, documents=documents)
        return result, start, time.monotonic()

    (first, a), (second, b), (result, start, end) = run_concurrently(
        [stream, stream, documents_ranked]
    )
    assert first == second and first.startswith(ANSWER)
    for times in a, b:
        # Up to the judging's end, or the stream's if it ended first.
        inside = [start] + [t for t in times if start < t < end]
        inside.append(min(end, times[-1]))
        assert len(inside) > 4
        pause = max(later - t for t, later in zip(inside, inside[1:]))
        assert pause < (end - start) / 3
    assert sorted(r.index for r in result.results) == list(range(200))


def test_a_document_over_the_context_is_cut(reranker):
    long = "Paris is lovely in spring. " * (CONTEXT // 4)
    result = rerank(reranker.stub, documents=[long, DOCUMENTS[1]])
    assert {r.index for r in result.results} == {0, 1}
    assert result.results[0].text in (long, DOCUMENTS[1])
    assert "documents[0]:" in reranker.logs() and "cut to fit" in reranker.logs()


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(query="", documents=DOCUMENTS), "query"),
        (dict(query="  ", documents=DOCUMENTS), "query"),
        (dict(query=QUERY, documents=[]), "documents"),
        (dict(query=QUERY, documents=DOCUMENTS, top_n=-1), "top_n"),
    ],
)
def test_bad_requests_name_the_field(reranker, fields, field):
    error = error_of(reranker.stub.Rerank, pb.RerankRequest(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}:")


def test_the_model_identity_is_checked(reranker):
    named = pb.RerankRequest(query=QUERY, documents=DOCUMENTS, ModelIdentity="default")
    assert len(reranker.stub.Rerank(named).results) == len(DOCUMENTS)
    other = pb.RerankRequest(query=QUERY, documents=DOCUMENTS, ModelIdentity="other")
    error = error_of(reranker.stub.Rerank, other)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().startswith("model identity mismatch:")


def test_a_model_that_is_no_reranker_says_how_to_make_it_one(reranker):
    stub = reranker.stub
    try:
        assert stub.LoadModel(pb.ModelOptions(Model="default")).success
        error = error_of(stub.Rerank, pb.RerankRequest(query=QUERY, documents=["a"]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "reranker:" in error.details()
        bad = stub.LoadModel(pb.ModelOptions(Model="default", Options=["reranker:no"]))
        assert not bad.success and "reranker must be one of" in bad.message
        # LocalAI's `reranking: true` in a model's config makes it a yes/no reranker.
        assert stub.LoadModel(pb.ModelOptions(Model="default", Reranking=True)).success
        assert rerank(stub, top_n=1).results[0].index in range(len(DOCUMENTS))
    finally:
        assert stub.LoadModel(
            pb.ModelOptions(
                Model="default", ContextSize=CONTEXT, Options=["reranker:yes_no"]
            )
        ).success


def test_a_cancelled_rerank_is_dropped(reranker):
    """A client that gives up (LocalAI's request ended) frees the engine: the
    judging stops, and the next Rerank is answered."""
    long = "Paris is lovely in spring, and the river runs past the old quays. " * 24
    documents = [f"{i}: {long}" for i in range(256)]
    dropped = reranker.logs().count("a cancelled job is dropped")
    call = reranker.stub.Rerank.future(
        pb.RerankRequest(query=QUERY, documents=documents)
    )
    reranker.wait_for_log("judging 256 documents")
    call.cancel()
    reranker.wait_for_log("a cancelled job is dropped", 30, times=dropped + 1)
    assert call.cancelled()
    result = rerank(reranker.stub, top_n=1)
    assert result.results[0].index in range(len(DOCUMENTS))
