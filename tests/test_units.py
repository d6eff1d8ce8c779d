"""Unit tests, in-process: the grammar logits processor, the Score and Embedding
batches and their job queue, and gather_logprobs.

The grammar tests use the default model's real tokenizer; the rest use a tiny
random llama built through mlx-lm's own model code, checked against plain forward
passes.
"""

from concurrent.futures import Future
from types import SimpleNamespace

import llguidance.numpy
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import ConcatenateKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

import mlx_backend.engine.jobs as score_embedding
import mlx_backend.grammar as grammar
from mlx_backend.decoders.speculative import NgramProposer, best_draft_length
from mlx_backend.engine.jobs import (
    EmbeddingBatch,
    EmbeddingRequest,
    JobQueue,
    ScoreBatch,
    ScoreRequest,
    score_continuations,
)
from mlx_backend.errors import Aborted, InvalidArgument
from mlx_backend.grammar import GrammarCompiler, make_grammar_processor
from mlx_backend.models.gguf import save_tokenizer
from mlx_backend.models.loading import default_model_path
from mlx_backend.output.detokenizer import make_token_bytes
from mlx_utils import gather_logprobs
from tests.support import TINY_LLAMA

YES_NO = 'root ::= "yes" | "no"'
SENTENCE = 'root ::= "The answer is " ("yes" | "no") "."'


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


# -- grammar ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # The GGUF's tokenizer built as load_gguf builds it, without the model.
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(metadata, folder)
    eos = metadata["tokenizer.ggml.eos_token_id"].item()
    return load_tokenizer(folder, eos_token_ids=[eos])


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return make_token_bytes(tokenizer)


@pytest.fixture(scope="module")
def vocab(token_bytes) -> int:
    return len(token_bytes.table)


@pytest.fixture(scope="module")
def compiler(tokenizer, token_bytes, vocab):
    return GrammarCompiler(tokenizer, token_bytes, vocab)


def token_of(tokenizer, text: str) -> int:
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


class Decoding:
    """Calls a grammar processor as mlx-lm does: with every token so far (the
    prompt's, then each sampled one) and the next logits."""

    def __init__(self, compiled, eos, vocab: int, width: int | None = None):
        self.state, self._process = make_grammar_processor(compiled, eos, vocab)
        self.tokens = [1, 2, 3]
        # Distinct finite logits, so kept values can be told apart from -inf or 0.
        rng = np.random.default_rng(0)
        self.logits = mx.array(rng.normal(size=(1, width or vocab)), mx.float32)

    def step(self, token: int | None = None) -> np.ndarray:
        if token is not None:
            self.tokens.append(token)
        return np.array(self._process(mx.array(self.tokens), self.logits))[0]


def allowed(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(row)).tolist())


def assert_only_eos(row: np.ndarray, eos: int) -> None:
    assert allowed(row) == {eos}
    assert row[eos] == 0.0
    assert np.all(np.isneginf(np.delete(row, eos)))


def test_grammar_masks_every_token_that_cannot_start_the_answer(
    tokenizer, token_bytes, compiler, vocab
):
    run = Decoding(compiler.compile(YES_NO), tokenizer.eos_token_ids, vocab)
    row = run.step()
    table = token_bytes.table
    # Exactly the tokens that spell a non-empty prefix of "yes" or "no".
    expected = {
        t
        for t, piece in enumerate(table)
        if piece and (b"yes".startswith(piece) or b"no".startswith(piece))
    }
    assert {table[t] for t in expected} == {b"y", b"ye", b"yes", b"n", b"no"}
    assert allowed(row) == expected
    # Allowed logits pass unchanged; every other one is -inf (not NaN).
    logits = np.array(run.logits)[0]
    kept = sorted(expected)
    np.testing.assert_array_equal(row[kept], logits[kept])
    assert np.all(np.isneginf(np.delete(row, kept)))
    assert (run.state.consumed, run.state.complete, run.state.error) == (0, False, None)


def test_grammar_follows_tokens_and_leaves_only_eos_when_complete(
    tokenizer, token_bytes, compiler, vocab
):
    eos = min(tokenizer.eos_token_ids)
    run = Decoding(compiler.compile(YES_NO), tokenizer.eos_token_ids, vocab)
    run.step()
    # After "ye" only an "s" token completes the word.
    row = run.step(token_of(tokenizer, "ye"))
    assert [token_bytes.table[t] for t in allowed(row)] == [b"s"]
    assert not run.state.complete and not run.state.ends_before(1)
    assert_only_eos(run.step(token_of(tokenizer, "s")), eos)
    state = run.state
    assert (state.consumed, state.complete, state.error) == (2, True, None)
    # The token after the two generated ones lies past the grammar, not before.
    assert not state.ends_before(1)
    assert state.ends_before(2) and state.ends_before(3)
    # A complete grammar takes no more tokens (e.g. an IgnoreEOS reply goes on).
    assert_only_eos(run.step(token_of(tokenizer, "maybe")), eos)
    assert (state.consumed, state.error) == (2, None)


def test_grammar_admits_a_whole_tokenized_answer(tokenizer, compiler, vocab):
    eos = min(tokenizer.eos_token_ids)
    run = Decoding(compiler.compile(SENTENCE), tokenizer.eos_token_ids, vocab)
    tokens = tokenizer.encode("The answer is yes.", add_special_tokens=False)
    row = run.step()
    for token in tokens:
        assert token in allowed(row)
        assert eos not in allowed(row)
        row = run.step(token)
    assert_only_eos(row, eos)
    assert run.state.consumed == len(tokens) and run.state.complete


def test_grammar_allows_eos_where_the_grammar_may_end(tokenizer, token_bytes, compiler):
    vocab = len(token_bytes.table)
    eos = min(tokenizer.eos_token_ids)
    run = Decoding(compiler.compile('root ::= "a" | "ab"'), [eos], vocab)
    assert {token_bytes.table[t] for t in allowed(run.step())} == {b"a", b"ab"}
    # "a" may end or go on with "b": both stay open and the grammar isn't complete.
    row = run.step(token_of(tokenizer, "a"))
    assert allowed(row) == {eos, token_of(tokenizer, "b")}
    assert not run.state.complete and not run.state.ends_before(1)


def test_a_forbidden_token_is_an_error_and_leaves_only_eos(tokenizer, compiler, vocab):
    eos = min(tokenizer.eos_token_ids)
    run = Decoding(compiler.compile(YES_NO), tokenizer.eos_token_ids, vocab)
    run.step()
    maybe = token_of(tokenizer, "maybe")
    assert_only_eos(run.step(maybe), eos)
    state = run.state
    assert state.error.startswith(f"token {maybe} breaks the grammar")
    # The error is what the reply reads first (complete follows the matcher, which
    # reports itself stopped once it has failed).
    assert state.consumed == 1
    # After an error the matcher takes nothing more; the error stays the first one.
    error = state.error
    assert_only_eos(run.step(token_of(tokenizer, "yes")), eos)
    assert (state.consumed, state.error) == (1, error)


@pytest.mark.parametrize(
    "eos_bit, complete, error",
    [
        (True, True, None),
        (False, False, "no token can continue the output (a dead end)"),
    ],
    ids=["only-eos", "nothing"],
)
def test_a_mask_of_only_eos_completes_and_an_empty_one_is_a_dead_end(
    tokenizer, compiler, vocab, monkeypatch, eos_bit, complete, error
):
    # llguidance reports itself stopped before it gets here; this is the fallback
    # for a matcher whose mask runs out anyway.
    eos = min(tokenizer.eos_token_ids)

    def fill(matcher, bitmask, index=0):
        bitmask[index] = 0
        bitmask[index, eos // 32] = int(eos_bit) << eos % 32

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", fill)
    run = Decoding(compiler.compile(YES_NO), tokenizer.eos_token_ids, vocab)
    assert_only_eos(run.step(), eos)
    assert (run.state.complete, run.state.error) == (complete, error)
    assert run.state.ends_before(0) is complete


def test_logits_wider_than_the_vocabulary_forbid_the_extra_columns(
    tokenizer, token_bytes, compiler, vocab
):
    # Models pad their output layer past the tokenizer's vocabulary.
    run = Decoding(compiler.compile(YES_NO), tokenizer.eos_token_ids, vocab, vocab + 17)
    row = run.step()
    assert row.shape == (vocab + 17,)
    assert {token_bytes.table[t] for t in allowed(row)} == {
        b"y",
        b"ye",
        b"yes",
        b"n",
        b"no",
    }


def test_requests_advance_their_own_copy_of_a_compiled_grammar(
    tokenizer, compiler, vocab
):
    compiled = compiler.compile(YES_NO)
    first = Decoding(compiled, tokenizer.eos_token_ids, vocab)
    second = Decoding(compiled, tokenizer.eos_token_ids, vocab)
    fresh = allowed(first.step())
    first.step(token_of(tokenizer, "yes"))
    assert first.state.complete
    assert allowed(second.step()) == fresh
    assert allowed(Decoding(compiled, tokenizer.eos_token_ids, vocab).step()) == fresh


def test_json_mode_starts_with_an_object(tokenizer, token_bytes, compiler, vocab):
    run = Decoding(compiler.compile("json"), tokenizer.eos_token_ids, vocab)
    pieces = {token_bytes.table[t] for t in allowed(run.step())}
    assert pieces == {b"{", b"{}", b'{"'}


def test_compiled_grammars_are_cached_by_text_least_recent_out(
    tokenizer, token_bytes, vocab, monkeypatch
):
    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_SIZE", 2)
    fresh = GrammarCompiler(tokenizer, token_bytes, vocab)
    a, b, c = (f'root ::= "{word}"' for word in ("alpha", "beta", "gamma"))
    first = fresh.compile(a)
    assert fresh.compile(a) is first and fresh.compilations == 1
    fresh.compile(b)
    fresh.compile(a)  # a becomes the most recent, so c evicts b
    fresh.compile(c)
    assert fresh.compilations == 3
    assert fresh.compile(a) is first and fresh.compilations == 3
    fresh.compile(b)
    assert fresh.compilations == 4


@pytest.mark.parametrize(
    "text, needle",
    [
        ('root ::= ( "a" ', "Grammar: "),
        ("root ::= undefined_rule", "undefined_rule"),
        ('{"type": "objectx"}', "objectx"),
        ("[1, 2]", "Grammar: a JSON schema must be a JSON object"),
    ],
)
def test_invalid_grammars_are_invalid_argument(compiler, text, needle):
    before = compiler.compilations
    with pytest.raises(InvalidArgument) as info:
        compiler.compile(text)
    assert str(info.value).startswith("Grammar: ") and needle in str(info.value)
    assert compiler.compilations == before


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
        np.testing.assert_allclose(keys2, keys, atol=1e-5)
        np.testing.assert_allclose(values2, values, atol=1e-5)


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
            reference_scores(model, PROMPT, candidate), abs=1e-4
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
            reference_scores(model, PROMPT, candidate), abs=1e-4
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
            reference_scores(model, PROMPT, candidate), abs=1e-4
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
            vector, reference_vector(model, tokens, pooling), atol=1e-5
        )


def test_mean_and_last_pooling_differ(model):
    tokens = EMBED_INPUTS[4]
    mean, last = (reference_vector(model, tokens, p) for p in ("mean", "last"))
    assert np.abs(mean - last).max() > 1e-2


# -- the job queue ------------------------------------------------------------

OPTIONS = SimpleNamespace(
    prefill_step_size=8, max_batch_size=4, embedding_pooling="mean"
)


class FakePromptCache:
    """fetch/save callables: always a fresh cache; remembers what it was given."""

    def __init__(self, model):
        self._model = model
        self.fetched: list[tuple] = []
        self.saved: list[tuple] = []

    def fetch(self, prompt):
        self.fetched.append(prompt)
        return make_prompt_cache(self._model), prompt

    def save(self, generation, cache, tokens):
        self.saved.append((generation, cache[0].offset, tuple(tokens)))


def drain(queue, model, options=OPTIONS, before_answer=lambda: None) -> int:
    steps = 0
    while queue:
        queue.step(model, options, before_answer)
        steps += 1
        assert steps < 100
    return steps


def test_queued_embeddings_share_a_job_and_a_score_runs_alone(model):
    store = FakePromptCache(model)
    queue = JobQueue(store.fetch, store.save)
    first, second = EmbeddingRequest((1, 2, 3)), EmbeddingRequest((4, 5, 6, 7, 8))
    score = ScoreRequest(prompt=PROMPT, candidates=CANDIDATES[:2], load_id=3)
    futures = [Future(), Future(), Future()]
    queue.add(first, futures[0])
    queue.add(score, futures[1])
    queue.add(second, futures[2])
    answered = []

    def before_answer():
        answered.append([f.done() for f in futures])

    drain(queue, model, before_answer=before_answer)
    # Both embeddings in one job, ahead of the Score; each job's callers get their
    # results after before_answer.
    assert answered == [[False, False, False], [True, False, True]]
    for future, request in ((futures[0], first), (futures[2], second)):
        np.testing.assert_allclose(
            future.result(timeout=0),
            reference_vector(model, request.tokens, "mean"),
            atol=1e-5,
        )
    for scores, candidate in zip(futures[1].result(timeout=0), CANDIDATES):
        assert scores == pytest.approx(
            reference_scores(model, PROMPT, candidate), abs=1e-4
        )
    assert store.fetched == [PROMPT]
    assert store.saved == [(3, len(PROMPT), PROMPT)]


def test_embedding_jobs_hold_at_most_max_batch_size(model):
    queue = JobQueue(None, None)
    futures = [Future() for _ in range(3)]
    for i, future in enumerate(futures):
        queue.add(EmbeddingRequest((i + 1, i + 2)), future)
    answered = []
    options = SimpleNamespace(**{**vars(OPTIONS), "max_batch_size": 2})
    drain(queue, model, options, lambda: answered.append([f.done() for f in futures]))
    assert answered == [[False, False, False], [True, True, False]]
    assert all(f.done() for f in futures)


def test_a_failing_job_fails_its_futures_and_the_queue_goes_on(model, monkeypatch):
    def broken_fetch(prompt):
        raise RuntimeError("no cache for you")

    queue = JobQueue(broken_fetch, None)
    score, embedding = Future(), Future()
    queue.add(ScoreRequest(prompt=PROMPT, candidates=CANDIDATES), score)
    queue.add(EmbeddingRequest((1, 2, 3)), embedding)
    answered = []
    queue.step(model, OPTIONS, lambda: answered.append(True))
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
        queue.step(model, OPTIONS, lambda: answered.append(True))
    errors = [embedding.exception(timeout=0), more.exception(timeout=0)]
    assert [str(e) for e in errors] == ["out of memory"] * 2
    assert errors[0] is not errors[1]
    assert not queue and answered == []

    last = Future()
    queue.add(EmbeddingRequest((1, 2, 3)), last)
    drain(queue, model, before_answer=lambda: answered.append(True))
    assert answered == [True]
    np.testing.assert_allclose(
        last.result(timeout=0), reference_vector(model, (1, 2, 3), "mean"), atol=1e-5
    )


def test_abort_fails_the_running_job_and_every_waiting_request(model):
    store = FakePromptCache(model)
    queue = JobQueue(store.fetch, store.save)
    futures = [Future(), Future()]
    queue.add(ScoreRequest(prompt=tuple(range(1, 30)), candidates=((3,),)), futures[0])
    queue.add(EmbeddingRequest((1, 2)), futures[1])
    options = SimpleNamespace(**{**vars(OPTIONS), "prefill_step_size": 4})
    queue.step(model, options, lambda: pytest.fail("nothing is done yet"))
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


# -- gather_logprobs ----------------------------------------------------------


@pytest.fixture(scope="module")
def logprob_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    return log_softmax(rng.normal(size=(4, 50))).astype(np.float32)


@pytest.mark.parametrize("top", [1, 5, 50])
def test_gather_logprobs_matches_numpy(logprob_rows, top):
    tokens = [3, 0, 49, 17]
    result = gather_logprobs([mx.array(r) for r in logprob_rows], tokens, top)
    assert len(result) == len(tokens)
    for row, token, (value, best) in zip(logprob_rows, tokens, result):
        assert value == pytest.approx(float(row[token]), abs=1e-6)
        order = np.argsort(-row, kind="stable")[:top].tolist()
        assert [i for i, _ in best] == order
        assert [v for _, v in best] == pytest.approx(row[order].tolist(), abs=1e-6)


def test_gather_logprobs_top_zero_lists_no_alternatives(logprob_rows):
    result = gather_logprobs([mx.array(r) for r in logprob_rows[:2]], [7, 8], 0)
    assert [best for _, best in result] == [[], []]
    assert [v for v, _ in result] == pytest.approx(
        [float(logprob_rows[0, 7]), float(logprob_rows[1, 8])], abs=1e-6
    )


def test_gather_logprobs_of_one_row_in_model_precision(logprob_rows):
    row = mx.array(logprob_rows[2]).astype(mx.float16)
    exact = np.array(row.astype(mx.float32))
    ((value, best),) = gather_logprobs([row], [9], 3)
    assert value == float(exact[9])
    assert [i for i, _ in best] == np.argsort(-exact, kind="stable")[:3].tolist()


def test_ngram_proposer_prefers_the_longest_latest_match():
    proposer = NgramProposer(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # The 3-gram (1, 2, 3) was followed by 4; the 2-gram (2, 3) last by 7.
    assert proposer.propose(tokens, 3) == [4, 5, 9]
    tokens += [6, 2, 3]
    assert proposer.propose(tokens, 2) == [6, 2]
    assert proposer.propose(tokens + [42], 4) == []
    # Near the end the continuation is what there is.
    assert NgramProposer(1, 1).propose([5, 6, 5], 4) == [6, 5]


@pytest.mark.parametrize(
    "rate, costs, available, expected",
    [
        (0.9, (1.0, 1.1, 1.2, 1.3), 3, 3),
        (0.9, (1.0, 1.1, 1.2, 1.3), 1, 1),
        (0.05, (1.0, 1.1, 1.2, 1.3), 3, 0),
        # Passes over several tokens cost as much as that many single ones.
        (0.9, (1.0, 2.0, 3.0, 4.0), 3, 0),
        (0.5, (1.0, 1.1, 1.2, 3.0), 3, 2),
        (0.9, (1.0, 1.1), 5, 1),
        # A small gain does not pay for leaving the pipelined batch.
        (0.3, (1.0, 1.05), 1, 0),
    ],
)
def test_best_draft_length(rate, costs, available, expected):
    assert best_draft_length(rate, costs, available) == expected
