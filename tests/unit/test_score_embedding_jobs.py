"""The Score and Embedding batches and their job queue, on a tiny random llama
built through mlx-lm's own model code, checked against plain forward passes."""

from concurrent.futures import Future
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import ConcatenateKVCache, make_prompt_cache

import mlx_backend.engine.jobs as score_embedding
from mlx_backend.engine.jobs import (
    RUNNING_JOB,
    EmbeddingBatch,
    JobQueue,
    ScoreBatch,
    score_continuations,
)
from mlx_backend.errors import Aborted
from mlx_backend.request_parsing import EmbeddingRequest, ScoreRequest
from tests.engine_helpers import log_softmax
from tests.support import device_tolerance
from tests.tiny_models import TINY_LLAMA

# Against a whole forward pass alone: logprobs, unit vectors' components, and the
# keys and values of the cache (of magnitude ~1; an H200 gave 0.00036).
SCORE_TOLERANCE = device_tolerance(1e-4, 10)
VECTOR_TOLERANCE = device_tolerance(1e-5)
KV_TOLERANCE = device_tolerance(1e-5)

# -- a tiny model -------------------------------------------------------------

TINY_VOCAB = 97
PROMPT = (11, 5, 42, 7, 88, 3, 19)
CANDIDATES = ((5, 17, 3), (42,), (8, 8, 1, 96, 30))


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    args = llama.ModelArgs.from_dict({**TINY_LLAMA, "vocab_size": TINY_VOCAB})
    tiny = llama.Model(args)
    mx.eval(tiny.parameters())
    return tiny


def reference_scores(model, prompt, candidate) -> list[float]:
    """Candidate's per-token logprobs from one forward pass over everything."""
    logits = model(mx.array([list(prompt) + list(candidate)]))[0]
    logprobs = log_softmax(np.array(logits.astype(mx.float32)))
    start = len(prompt) - 1
    return [float(logprobs[start + i, t]) for i, t in enumerate(candidate)]


def prefilled(model, tokens, cache=None) -> list:
    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def kv_snapshot(cache) -> list:
    return [
        (
            c.offset,
            np.array(c.keys[..., : c.offset, :]),
            np.array(c.values[..., : c.offset, :]),
        )
        for c in cache
    ]


def assert_same_kv(before, after) -> None:
    assert [offset for offset, _, _ in before] == [offset for offset, _, _ in after]
    for (_, keys, values), (_, keys2, values2) in zip(before, after):
        np.testing.assert_allclose(keys2, keys, atol=KV_TOLERANCE)
        np.testing.assert_allclose(values2, values, atol=KV_TOLERANCE)


def run_to_end(work, limit: int = 100) -> list[bool]:
    results = []
    while not results or not results[-1]:
        results.append(work.advance())
        assert len(results) < limit
    return results


def test_the_tiny_model_depends_on_context(model):
    # Else the equalities below could hold with a broken cache or mask.
    here = reference_scores(model, PROMPT, CANDIDATES[2])
    there = reference_scores(model, PROMPT[1:], CANDIDATES[2])
    assert max(abs(a - b) for a, b in zip(here, there)) > 1e-3


# -- Score --------------------------------------------------------------------


@pytest.mark.parametrize(
    "step_size, max_rows, advances",
    [
        # Prefill chunks 2, 2, 2, then the last token; one candidate per advance.
        (2, 1, 4 + 3),
        # Chunks 3, 3, 1; no two candidates fit 3 positions.
        (3, 8, 3 + 3),
        # Chunks 6, 1; the first two candidates share 12 positions, the third not.
        (12, 8, 2 + 2),
        (64, 2, 2 + 2),
        (64, 8, 2 + 1),
    ],
)
def test_score_batch_equals_a_full_forward_pass(model, step_size, max_rows, advances):
    batch = ScoreBatch(
        model, make_prompt_cache(model), PROMPT, CANDIDATES, step_size, max_rows
    )
    assert run_to_end(batch) == [False] * (advances - 1) + [True]
    assert [len(s) for s in batch.scores] == [len(c) for c in CANDIDATES]
    for scores, candidate in zip(batch.scores, CANDIDATES):
        assert scores == pytest.approx(
            reference_scores(model, PROMPT, candidate), abs=SCORE_TOLERANCE
        )
    # The cache holds the prompt and nothing of the candidates, to be saved.
    assert_same_kv(kv_snapshot(prefilled(model, PROMPT)), kv_snapshot(batch.cache))


def test_score_batch_continues_a_cached_prompt_prefix(model):
    cache = prefilled(model, PROMPT[:4])
    batch = ScoreBatch(model, cache, PROMPT[4:], CANDIDATES, 2, 8)
    run_to_end(batch)
    assert batch.cache is cache and cache[0].offset == len(PROMPT)
    for scores, candidate in zip(batch.scores, CANDIDATES):
        assert scores == pytest.approx(
            reference_scores(model, PROMPT, candidate), abs=SCORE_TOLERANCE
        )


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda model: make_prompt_cache(model),  # KVCache: one merged batch
        lambda model: [ConcatenateKVCache() for _ in model.layers],  # no merge
    ],
    ids=["merged", "copied"],
)
def test_score_continuations_leave_the_prompt_cache_alone(model, make_cache):
    cache = make_cache(model)
    logits = model(mx.array([list(PROMPT)]), cache=cache)[0, -1]
    first = mx.array(log_softmax(np.array(logits)))
    mx.eval([c.state for c in cache])
    before = kv_snapshot(cache)
    scores = score_continuations(model, cache, first, CANDIDATES)
    assert_same_kv(before, kv_snapshot(cache))
    for row, candidate in zip(scores, CANDIDATES):
        assert row == pytest.approx(
            reference_scores(model, PROMPT, candidate), abs=SCORE_TOLERANCE
        )


# -- Embedding ----------------------------------------------------------------

# Around the 16-token chunks that a small step size gives: 1, 16, 17, 40 tokens.
EMBED_INPUTS = (
    tuple(range(1, 41)),
    (7,),
    tuple(range(50, 66)),
    tuple(range(60, 77)),
    (3, 1, 4, 1, 5),
)


def reference_vector(model, tokens, pooling: str) -> np.ndarray:
    """The pooled, normalized hidden states of ``tokens`` run alone, unpadded."""
    hidden = score_embedding.hidden_state_model(model)(mx.array([list(tokens)]))[0]
    hidden = np.array(hidden.astype(mx.float32)).astype(np.float64)
    pooled = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
    return pooled / np.linalg.norm(pooled)


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("step_size, advances", [(1, 3), (64, 3), (4096, 1)])
def test_embedding_batch_equals_each_input_alone(model, pooling, step_size, advances):
    # Chunks of max(16, step_size // 5) positions over 40: 16, 16, 8; or all at once.
    batch = EmbeddingBatch(model, EMBED_INPUTS, pooling, step_size)
    assert run_to_end(batch) == [False] * (advances - 1) + [True]
    vectors = np.array(batch.vectors())
    assert vectors.shape == (len(EMBED_INPUTS), 32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for vector, tokens in zip(vectors, EMBED_INPUTS):
        np.testing.assert_allclose(
            vector, reference_vector(model, tokens, pooling), atol=VECTOR_TOLERANCE
        )


def test_mean_and_last_pooling_differ(model):
    tokens = EMBED_INPUTS[4]
    mean, last = (reference_vector(model, tokens, p) for p in ("mean", "last"))
    assert np.abs(mean - last).max() > 1e-2


# -- the job queue ------------------------------------------------------------

OPTIONS = SimpleNamespace(
    prefill_step_size=8, max_batch_size=4, embedding_pooling="mean"
)


class FakePromptStore:
    """A prompt store of load 3: always a fresh cache; remembers what it was given."""

    load_id = 3

    def __init__(self, model):
        self._model = model
        self.fetched: list[tuple] = []
        self.saved: list[tuple] = []

    def fetch(self, prompt):
        self.fetched.append(prompt)
        return make_prompt_cache(self._model), prompt

    def keep(self, cache, tokens, holders=1):
        self.saved.append((self.load_id, cache[0].offset, tuple(tokens)))


def served(model, options=OPTIONS, store=None) -> SimpleNamespace:
    """What the job queue reads of a served model."""
    info = SimpleNamespace(options=options)
    return SimpleNamespace(model=model, info=info, store=store)


def drain(queue, model, options=OPTIONS, before_answer=lambda: None, store=None):
    steps = 0
    while queue:
        queue.step(served(model, options, store), before_answer)
        steps += 1
        assert steps < 100
    return steps


def test_queued_embeddings_share_a_job_and_a_score_runs_alone(model):
    store = FakePromptStore(model)
    queue = JobQueue()
    first, second = EmbeddingRequest((1, 2, 3)), EmbeddingRequest((4, 5, 6, 7, 8))
    score = ScoreRequest(prompt=PROMPT, candidates=CANDIDATES[:2], load_id=3)
    futures = [Future(), Future(), Future()]
    queue.add(first, futures[0])
    queue.add(score, futures[1])
    queue.add(second, futures[2])
    answered = []

    def before_answer():
        answered.append([f.done() for f in futures])

    drain(queue, model, before_answer=before_answer, store=store)
    # Both embeddings in one job, ahead of the Score; each job's callers get their
    # results after before_answer.
    assert answered == [[False, False, False], [True, False, True]]
    for future, request in ((futures[0], first), (futures[2], second)):
        np.testing.assert_allclose(
            future.result(timeout=0),
            reference_vector(model, request.tokens, "mean"),
            atol=VECTOR_TOLERANCE,
        )
    for scores, candidate in zip(futures[1].result(timeout=0), CANDIDATES):
        assert scores == pytest.approx(
            reference_scores(model, PROMPT, candidate), abs=SCORE_TOLERANCE
        )
    assert store.fetched == [PROMPT]
    assert store.saved == [(3, len(PROMPT), PROMPT)]


def test_embedding_jobs_hold_at_most_max_batch_size(model):
    queue = JobQueue()
    futures = [Future() for _ in range(3)]
    for i, future in enumerate(futures):
        queue.add(EmbeddingRequest((i + 1, i + 2)), future)
    answered = []
    options = SimpleNamespace(**{**vars(OPTIONS), "max_batch_size": 2})
    drain(queue, model, options, lambda: answered.append([f.done() for f in futures]))
    assert answered == [[False, False, False], [True, True, False]]
    assert all(f.done() for f in futures)


def test_a_failing_job_fails_its_futures_and_the_queue_goes_on(model, monkeypatch):
    class BrokenStore:
        def fetch(self, prompt):
            raise RuntimeError("no cache for you")

    queue = JobQueue()
    score, embedding = Future(), Future()
    queue.add(ScoreRequest(prompt=PROMPT, candidates=CANDIDATES), score)
    queue.add(EmbeddingRequest((1, 2, 3)), embedding)
    answered = []
    queue.step(served(model, store=BrokenStore()), lambda: answered.append(True))
    error = score.exception(timeout=0)
    assert type(error) is RuntimeError and str(error) == "no cache for you"
    assert not embedding.done() and queue

    # A job that fails inside advance(): every caller of the batch gets the error.
    def broken_advance(self):
        raise RuntimeError("out of memory")

    more = Future()
    queue.add(EmbeddingRequest((4, 5)), more)
    with monkeypatch.context() as patch:
        patch.setattr(EmbeddingBatch, "advance", broken_advance)
        queue.step(served(model), lambda: answered.append(True))
    errors = [embedding.exception(timeout=0), more.exception(timeout=0)]
    assert [str(e) for e in errors] == ["out of memory"] * 2
    assert errors[0] is not errors[1]
    assert not queue and answered == []

    last = Future()
    queue.add(EmbeddingRequest((1, 2, 3)), last)
    drain(queue, model, before_answer=lambda: answered.append(True))
    assert answered == [True]
    np.testing.assert_allclose(
        last.result(timeout=0),
        reference_vector(model, (1, 2, 3), "mean"),
        atol=VECTOR_TOLERANCE,
    )


def test_abort_fails_the_running_job_and_every_waiting_request(model):
    store = FakePromptStore(model)
    queue = JobQueue()
    futures = [Future(), Future()]
    queue.add(ScoreRequest(prompt=tuple(range(1, 30)), candidates=((3,),)), futures[0])
    queue.add(EmbeddingRequest((1, 2)), futures[1])
    options = SimpleNamespace(**{**vars(OPTIONS), "prefill_step_size": 4})
    queue.step(served(model, options, store), lambda: pytest.fail("nothing yet"))
    assert store.fetched and not futures[0].done()

    queue.abort(Aborted("the model was replaced"))
    assert not queue
    for future in futures:
        error = future.exception(timeout=0)
        assert type(error) is Aborted and str(error) == "the model was replaced"
    assert store.saved == []

    after = Future()
    queue.add(EmbeddingRequest((1, 2)), after)
    drain(queue, model)
    assert len(after.result(timeout=0)) == 32


def test_a_withdrawn_request_is_dropped_and_the_rest_answered(model):
    store = FakePromptStore(model)
    queue = JobQueue()
    score, waiting, kept, left = Future(), Future(), Future(), Future()
    queue.add(ScoreRequest(prompt=tuple(range(1, 30)), candidates=((3,),)), score)
    queue.add(EmbeddingRequest((1, 2)), waiting)
    # Longer than an advance's 16 positions.
    queue.add(EmbeddingRequest(tuple(range(3, 43))), kept)
    queue.add(EmbeddingRequest(tuple(range(5, 45))), left)
    options = SimpleNamespace(**{**vars(OPTIONS), "prefill_step_size": 4})
    queue.step(served(model, options, store), lambda: None)
    assert queue.withdraw(waiting) == 0
    assert queue.withdraw(score) == RUNNING_JOB
    assert queue.withdraw(score) is None  # already gone
    for future in score, waiting:
        error = future.exception(timeout=0)
        assert type(error) is Aborted and str(error) == "the request was cancelled"
    # The Score was never finished: nothing of it is kept.
    assert store.saved == []
    # One caller of a running batch withdrawn: the batch goes on for the other.
    queue.step(served(model, options, store), lambda: None)
    assert queue.withdraw(kept) is None
    drain(queue, model, options)
    assert type(kept.exception(timeout=0)) is Aborted
    np.testing.assert_allclose(
        left.result(timeout=0),
        reference_vector(model, tuple(range(5, 45)), "mean"),
        atol=VECTOR_TOLERANCE,
    )
