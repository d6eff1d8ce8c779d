"""The grammar logits processor (llguidance under mlx-lm's processor protocol)
and the grammar compiler's cache and errors, with the default model's real
tokenizer, built as load_gguf builds it, without the model."""

import json

import llguidance.numpy
import mlx.core as mx
import numpy as np
import pytest

import mlx_backend.grammar as grammar
from mlx_backend.errors import InvalidArgument
from mlx_backend.grammar import GrammarCompiler, make_grammar_processor
from mlx_backend.output.detokenizer import make_token_bytes

YES_NO = 'root ::= "yes" | "no"'
SENTENCE = 'root ::= "The answer is " ("yes" | "no") "."'


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


CITY = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'


@pytest.mark.parametrize("limit", [10, 16, 40])
def test_a_grammar_closes_before_the_token_limit(tokenizer, token_bytes, limit):
    # The "model" writes a string that never ends; near the limit the processor
    # leaves one token, on the grammar's way to its end, then end-of-sequence.
    fresh = GrammarCompiler(tokenizer, token_bytes, len(token_bytes.table))
    state, process = make_grammar_processor(
        fresh.compile(CITY), tokenizer.eos_token_ids, len(token_bytes.table), limit
    )
    eos = min(tokenizer.eos_token_ids)
    wanted = tokenizer.encode(
        '{"city": "Paris' + " is on the river" * 9, add_special_tokens=False
    )
    logits = mx.zeros((1, len(token_bytes.table)))
    history, generated, overridden = [1, 2, 3], [], []
    while True:
        row = np.array(process(mx.array(history), logits))[0]
        finite = allowed(row)
        token = wanted[len(generated)]
        if token not in finite:
            # Closing: one token is left, and it is not the model's.
            assert len(finite) == 1
            (token,) = finite
            overridden.append(len(generated))
        if token == eos:
            break
        generated.append(token)
        history.append(token)
    assert len(generated) < limit
    assert json.loads(tokenizer.decode(generated))["city"].startswith("Paris")
    # It wrote freely until the way to the end took what was left.
    assert overridden and overridden[0] >= limit - 4
    assert overridden == list(range(overridden[0], len(generated) + 1))


def test_a_grammar_far_from_its_limit_is_not_closed(tokenizer, token_bytes, compiler):
    compiled = compiler.compile(CITY)
    state, process = make_grammar_processor(
        compiled, tokenizer.eos_token_ids, len(token_bytes.table), limit=500
    )
    assert state.closing_token(0) is None and state.closing_token(451) is None


def test_looking_for_the_way_to_the_end_is_rare(tokenizer, token_bytes, monkeypatch):
    # A string that must hold 4000 characters can't close in 48 tokens: the
    # looks back off; one that can is looked at a few times before it is taken.
    looks = []
    find_close = grammar.find_close

    def counted(*args):
        looks.append(args[-1])
        return find_close(*args)

    monkeypatch.setattr(grammar, "find_close", counted)
    fresh = GrammarCompiler(tokenizer, token_bytes, len(token_bytes.table))
    story = '{"type": "string", "minLength": 4000}'
    for schema, most in ((story, 4), (CITY, 8)):
        looks.clear()
        state, process = make_grammar_processor(
            fresh.compile(schema), tokenizer.eos_token_ids, len(token_bytes.table), 48
        )
        text = '"' if schema == story else '{"city": "'
        tokens = tokenizer.encode(text + "la " * 60, add_special_tokens=False)
        logits = mx.zeros((1, len(token_bytes.table)))
        history = [1]
        for token in tokens[:40]:
            row = np.array(process(mx.array(history), logits))[0]
            history.append(token if np.isfinite(row[token]) else int(row.argmax()))
        assert 0 < len(looks) <= most, looks
