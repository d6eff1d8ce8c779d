"""End to end over gRPC: constrained decoding with GBNF grammars and JSON schemas."""

import json
import re
from functools import partial

import grpc
import pytest

import backend_pb2 as pb
from mlx_backend.output.detokenizer import make_token_bytes
from tests.support import (
    ANSWER,
    MODEL,
    PERSON_SCHEMA,
    chat,
    check_person,
    error_of,
    run_concurrently,
)

# A small language: a shopping list of known items with counts.
SHOPPING_GBNF = r"""
root ::= "Buy " item (", " item)* "."
item ::= count " " fruit
count ::= [1-9]
fruit ::= "apples" | "pears" | "plums"
"""
SHOPPING = re.compile(
    r"Buy [1-9] (apples|pears|plums)(, [1-9] (apples|pears|plums))*\."
)

YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'
QUESTION_YES = "Is Paris in France? Answer yes or no."


@pytest.fixture(scope="module")
def server(forcing_server):
    result = forcing_server.stub.LoadModel(pb.ModelOptions(Model=MODEL))
    assert result.success, result.message
    return forcing_server


def grammar_chat(question: str, grammar: str, seed: int = 0, **fields):
    return chat(question, Grammar=grammar, Temperature=0.8, Seed=seed, **fields)


def counters(server) -> dict:
    return server.stub.Status(pb.HealthMessage()).memory.breakdown


@pytest.mark.parametrize(
    "question, temperature",
    [
        ('Output {"ok": true} and nothing else.', 0.8),
        ('Reply with JSON only: {"answer": <the capital of France>}', 0.4),
    ],
)
def test_json_mode_output_always_parses(server, question, temperature):
    # SmolLM2 rambles on open questions; these prompts let it finish an object.
    # The seeds run at once, as a batch (seeded sampling draws the same either way).
    requests = [
        chat(question, Grammar="json", Temperature=temperature, Seed=seed)
        for seed in range(4)
    ]
    for reply in run_concurrently([partial(server.stub.Predict, r) for r in requests]):
        assert isinstance(json.loads(reply.message), dict), reply.message


def test_json_schema_output_validates_across_seeds(server):
    schema = json.dumps(PERSON_SCHEMA)
    texts = set()
    requests = [
        grammar_chat("Describe a person as JSON.", schema, seed, Tokens=80)
        for seed in range(5)
    ]
    for reply in run_concurrently([partial(server.stub.Predict, r) for r in requests]):
        check_person(reply.message)
        texts.add(reply.message)
    assert len(texts) > 1, "every seed gave the same text: sampling is not exercised"


def test_gbnf_output_matches_the_language(server):
    requests = [
        grammar_chat("What should I buy at the market?", SHOPPING_GBNF, seed)
        for seed in range(4)
    ]
    for reply in run_concurrently([partial(server.stub.Predict, r) for r in requests]):
        assert SHOPPING.fullmatch(reply.message.decode()), reply.message


def test_a_finished_grammar_ends_the_reply_even_with_eos_banned(server):
    for request in (
        chat(Grammar=YES_NO),
        chat(Grammar=YES_NO, IgnoreEOS=True, Tokens=50),
    ):
        reply = server.stub.Predict(request)
        assert reply.message.decode() in ("The answer is yes.", "The answer is no.")
        # Ended with the grammar: far below the 50-token limit.
        assert reply.tokens <= 8
    streamed = list(server.stub.PredictStream(chat(Grammar=YES_NO)))
    assert b"".join(r.message for r in streamed) == reply.message


@pytest.mark.parametrize(
    "grammar, needle",
    [
        ('root ::= ( "a" ', "Grammar: "),
        ("root ::= undefined_rule", "undefined_rule"),
        ('{"type": "objectx"}', "objectx"),
        ("[1, 2]", "JSON schema must be a JSON object"),
        # Impossible: refused before a token is generated, never a reply of token 0.
        ('{"type": "string", "minLength": 5, "maxLength": 2}', "Unsatisfiable"),
        (
            '{"type": "object", "properties": {"a": {"type": "string"}}, '
            '"required": ["b"], "additionalProperties": false}',
            "required property 'b' is unsatisfiable",
        ),
    ],
)
def test_invalid_grammars_are_invalid_argument(server, grammar, needle):
    error = error_of(server.stub.Predict, chat(Grammar=grammar))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Grammar" in error.details() and needle in error.details()


def test_grammars_are_compiled_once_per_text(server):
    grammar = 'root ::= "Only " ("this" | "that") "."'
    before = counters(server)["grammars_compiled"]
    for _ in range(3):
        server.stub.Predict(chat(Grammar=grammar))
    assert counters(server)["grammars_compiled"] == before + 1


def test_a_dead_end_ends_the_request_with_an_error(server):
    # The forced tokens (a testing aid that overrides the mask) break the grammar.
    tokens = server.stub.TokenizeString(pb.PredictOptions(Prompt="maybe")).tokens
    request = chat(Grammar=YES_NO, Metadata={"forced_tokens": json.dumps(list(tokens))})
    for call in (server.stub.Predict, server.stub.PredictStream):
        error = error_of(call, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Grammar: generation stopped after 0 tokens" in error.details()
        assert "breaks the grammar" in error.details()
    assert server.stub.Predict(chat()).message.decode() == ANSWER


def test_a_step_with_every_allowed_token_masked_is_an_error_not_token_0(
    server, tokenizer
):
    # LogitBias -1e39 is finite, but -inf in float32: it masks every token the
    # grammar allows first (those that spell a start of "The answer is ...").
    # Sampling that row would give token 0 and go on; the request ends with
    # INVALID_ARGUMENT instead, alone or in a batch, greedy or sampled, and the
    # server keeps serving.
    table = make_token_bytes(tokenizer).table
    firsts = [
        t for t, piece in enumerate(table) if piece and b"The a".startswith(piece)
    ]
    bias = json.dumps({str(t): -1e39 for t in firsts})
    masked = [
        grammar_chat(QUESTION_YES, YES_NO, LogitBias=bias),
        chat(QUESTION_YES, Grammar=YES_NO, LogitBias=bias),
    ]
    expected = (
        "Grammar: generation stopped after 0 tokens: no token was left to sample: "
        "the other logits processors masked every token the grammar allows"
    )
    for request in masked:
        for call in (server.stub.Predict, server.stub.PredictStream):
            error = error_of(call, request)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == expected
    # In a batch beside a plain request, which is served as alone.
    outcomes = run_concurrently(
        [
            lambda: error_of(server.stub.Predict, masked[0]),
            lambda: server.stub.Predict(chat()).message.decode(),
        ]
    )
    assert outcomes[0].details() == expected and outcomes[1] == ANSWER


def test_grammar_requests_inside_a_batch(server):
    before = counters(server)
    schema = json.dumps(PERSON_SCHEMA)
    calls = [
        lambda: server.stub.Predict(chat(Tokens=20)),
        lambda: server.stub.Predict(
            grammar_chat("Describe a person as JSON.", schema, 7, Tokens=80)
        ),
        lambda: server.stub.Predict(chat(Tokens=20)),
        lambda: server.stub.Predict(
            grammar_chat("What should I buy?", SHOPPING_GBNF, 3, Tokens=60)
        ),
    ]
    plain, person, plain_again, shopping = run_concurrently(calls)
    assert plain.message.decode() == plain_again.message.decode() == ANSWER
    check_person(person.message)
    assert SHOPPING.fullmatch(shopping.message.decode())
    after = counters(server)
    steps = after["batch_decode_steps"] - before["batch_decode_steps"]
    tokens = after["batch_decode_tokens"] - before["batch_decode_tokens"]
    assert tokens / steps > 1.5, "the requests did not share decode steps"
