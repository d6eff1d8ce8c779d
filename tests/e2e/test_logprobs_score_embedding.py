"""End to end over gRPC: logprobs, logit bias, Score, Embedding and metrics."""

import json
import math
import time

import grpc
import pytest

import backend_pb2 as pb
from tests.support import (
    ANSWER,
    ANSWER_PIECES,
    MODEL,
    chat,
    entries_of,
    error_of,
    run_concurrently,
)

# Three-byte characters that SmolLM2's BPE splits across tokens.
MULTIBYTE = "Tokyo is 東京, café ☕ and 🙂."


@pytest.fixture(scope="module")
def server(forcing_server):
    # Named by its path, as LocalAI names a model file.
    result = forcing_server.stub.LoadModel(pb.ModelOptions(Model=MODEL))
    assert result.success, result.message
    return forcing_server


def joined_bytes(entries) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


# -- logprobs -----------------------------------------------------------------


def test_predict_logprobs_cover_the_reply(server):
    reply = server.stub.Predict(chat(Logprobs=3, TopLogprobs=3))
    entries = entries_of(reply)
    assert reply.message.decode() == ANSWER
    assert [e["token"] for e in entries] == ANSWER_PIECES
    assert len(entries) == reply.tokens
    assert joined_bytes(entries) == reply.message
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 3
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        # Greedy picks the best token, so it leads its own alternatives.
        assert top[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
    assert top[0]["bytes"] == list(top[0]["token"].encode())
    assert {t["token"] for t in entries[5]["top_logprobs"]} >= {" Paris"}


def test_logprobs_off_by_default_and_top_zero_lists_no_alternatives(server):
    assert server.stub.Predict(chat()).logprobs == b""
    entries = entries_of(server.stub.Predict(chat(Logprobs=1)))
    assert [e["token"] for e in entries] == ANSWER_PIECES
    assert all(e["top_logprobs"] == [] for e in entries)


def test_stream_logprobs_ride_on_the_message_with_their_tokens(server):
    replies = list(server.stub.PredictStream(chat(Logprobs=2, TopLogprobs=2)))
    whole = entries_of(server.stub.Predict(chat(Logprobs=2, TopLogprobs=2)))
    streamed = []
    for reply in replies:
        entries = entries_of(reply)
        assert joined_bytes(entries) == reply.message
        streamed += entries
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    for a, b in zip(streamed, whole):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_split_multibyte_characters_join_through_bytes(server):
    tokens = server.stub.TokenizeString(pb.PredictOptions(Prompt=MULTIBYTE)).tokens
    request = chat(
        Logprobs=1,
        TopLogprobs=2,
        Metadata={"forced_tokens": json.dumps(list(tokens))},
    )
    for replies in (
        [server.stub.Predict(request)],
        list(server.stub.PredictStream(request)),
    ):
        entries = [e for r in replies for e in entries_of(r)]
        text = b"".join(r.message for r in replies)
        assert text.decode() == MULTIBYTE
        assert len(entries) == len(tokens)
        assert joined_bytes(entries) == MULTIBYTE.encode()
        broken = [e for e in entries if "\ufffd" in e["token"]]
        assert broken, "no token splits a character: the test proves nothing"
        # A forced token is certain; every other token is impossible, which JSON
        # can't write as -Infinity: OpenAI's -9999.0 stands for it.
        assert all(e["logprob"] == 0.0 for e in entries)
        assert all(e["top_logprobs"][1]["logprob"] == -9999.0 for e in entries)


def test_logprobs_are_the_same_alone_and_batched(server):
    questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "What is 2 + 2?",
    ]

    def ask(question):
        reply = server.stub.Predict(
            chat(question, Tokens=12, Logprobs=1, TopLogprobs=4)
        )
        return [(e["token"], e["logprob"]) for e in entries_of(reply)]

    alone = [ask(q) for q in questions]
    together = run_concurrently([lambda q=q: ask(q) for q in questions])
    for solo, batched in zip(alone, together):
        assert [t for t, _ in solo] == [t for t, _ in batched]
        for (_, a), (_, b) in zip(solo, batched):
            assert a == pytest.approx(b, abs=1e-3)


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"TopLogprobs": 21}, "TopLogprobs"),
        ({"TopLogprobs": -1}, "TopLogprobs"),
        ({"Logprobs": -2}, "Logprobs"),
    ],
)
def test_bad_logprobs_fields(server, fields, field_name):
    error = error_of(server.stub.Predict, chat(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in error.details()


def test_logit_bias_ignores_ids_outside_the_vocabulary(server):
    reply = server.stub.Predict(chat(LogitBias=json.dumps({"49152": 100, "-3": 50})))
    assert reply.message.decode() == ANSWER


# -- Score --------------------------------------------------------------------


def test_score_agrees_with_generation_logprobs(server):
    prompt = "The capital of France is"
    reply = server.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=8, Logprobs=1))
    entries = entries_of(reply)
    assert len(entries) == 8
    # The reply continues the prompt, so it is the candidate as it stands.
    continuation = reply.message.decode()
    assert bytes(entries[0]["bytes"])[:1] == b" "
    score = server.stub.Score(
        pb.ScoreRequest(
            prompt=prompt,
            candidates=[continuation],
            include_token_logprobs=True,
            length_normalize=True,
        )
    )
    (candidate,) = score.candidates
    assert candidate.num_tokens == 8
    assert [t.token for t in candidate.tokens] == [e["token"] for e in entries]
    for token, entry in zip(candidate.tokens, entries):
        assert token.log_prob == pytest.approx(entry["logprob"], abs=2e-3)
    total = sum(t.log_prob for t in candidate.tokens)
    assert candidate.log_prob == pytest.approx(total, abs=1e-9)
    assert candidate.length_normalized_log_prob == pytest.approx(total / 8, abs=1e-9)


def test_score_ranks_candidates_and_fills_only_what_was_asked(server):
    score = server.stub.Score(
        pb.ScoreRequest(
            prompt="The capital of France is",
            candidates=[" Paris", " London", " a banana sandwich"],
        )
    )
    paris, london, banana = score.candidates
    assert paris.log_prob > london.log_prob > banana.log_prob
    assert [c.num_tokens for c in score.candidates] == [1, 1, 3]
    assert all(not c.tokens for c in score.candidates)
    assert all(c.length_normalized_log_prob == 0 for c in score.candidates)


def cache_reused(server) -> int:
    status = server.stub.Status(pb.HealthMessage())
    return status.memory.breakdown["prompt_cache_reused_tokens"]


def test_score_reuses_the_prompt_cache(server):
    request = pb.ScoreRequest(
        prompt="Here is a list of fruits that are good for breakfast:",
        candidates=[" apples", " bananas and oranges", " oats"],
    )
    first = server.stub.Score(request)
    before = cache_reused(server)
    second = server.stub.Score(request)
    prompt_tokens = len(
        server.stub.TokenizeString(pb.PredictOptions(Prompt=request.prompt)).tokens
    )
    # All but the last prompt token, which runs again for its logits.
    assert cache_reused(server) - before == prompt_tokens - 1
    for a, b in zip(first.candidates, second.candidates):
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)


def test_score_batches_candidates_of_different_lengths_exactly(server):
    prompt = "My favourite animal is"
    candidates = [" the cat", " a very large elephant from Africa", " dogs"]
    together = server.stub.Score(
        pb.ScoreRequest(prompt=prompt, candidates=candidates)
    ).candidates
    for candidate, scored in zip(candidates, together):
        (alone,) = server.stub.Score(
            pb.ScoreRequest(prompt=prompt, candidates=[candidate])
        ).candidates
        assert scored.log_prob == pytest.approx(alone.log_prob, abs=1e-3)


def test_long_scores_run_between_decode_steps(server, tiny_llama):
    # On the tiny llama: the interleaving is under test, not the weights.
    def load():
        result = server.stub.LoadModel(pb.ModelOptions(Model=str(tiny_llama)))
        assert result.success, result.message

    # A prompt of several prefill chunks, and candidates too long for one group.
    prompt = "The old lighthouse keeper wrote in his log every night. " * 50
    candidates = [
        f" Night {i}: the sea was calm and the lamp burned bright." * 6
        for i in range(5)
    ]
    request = pb.ScoreRequest(prompt=prompt, candidates=candidates)
    streamed = chat(Tokens=64, IgnoreEOS=True)
    load()
    try:
        expected = server.stub.Predict(streamed).message.decode()
        stream = server.stub.PredictStream(streamed)
        score = server.stub.Score(request)
        assert "".join(r.message.decode() for r in stream) == expected
        # A reload empties the prompt cache, so the prompt is prefilled afresh.
        load()
        alone = [
            server.stub.Score(
                pb.ScoreRequest(prompt=prompt, candidates=[c])
            ).candidates[0]
            for c in candidates
        ]
    finally:
        server.stub.LoadModel(pb.ModelOptions(Model=MODEL))
    assert [c.num_tokens for c in score.candidates] == [c.num_tokens for c in alone]
    for together, solo in zip(score.candidates, alone):
        assert together.log_prob == pytest.approx(solo.log_prob, abs=1e-2)


@pytest.mark.parametrize(
    "request_fields, code, needle",
    [
        ({"prompt": "Hi", "candidates": []}, "INVALID_ARGUMENT", "candidates"),
        (
            {"prompt": "Hi", "candidates": ["a", ""]},
            "INVALID_ARGUMENT",
            "candidates[1]",
        ),
        ({"prompt": "", "candidates": ["a"]}, "INVALID_ARGUMENT", "prompt"),
        (
            {"prompt": "Hi", "candidates": ["a"], "ModelIdentity": "other-model"},
            "NOT_FOUND",
            "model identity mismatch",
        ),
    ],
)
def test_score_errors(server, request_fields, code, needle):
    error = error_of(server.stub.Score, pb.ScoreRequest(**request_fields))
    assert error.code() == getattr(grpc.StatusCode, code)
    assert needle in error.details()


# -- Embedding ----------------------------------------------------------------


def embed(server, text=None, tokens=None) -> pb.EmbeddingResult:
    if tokens is not None:
        return server.stub.Embedding(pb.PredictOptions(EmbeddingTokens=tokens))
    return server.stub.Embedding(pb.PredictOptions(Embeddings=text))


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def test_embedding_shape_and_determinism(server):
    text = "The cat sat on the mat."
    result = embed(server, text)
    tokens = server.stub.TokenizeString(pb.PredictOptions(Prompt=text)).tokens
    assert result.dim == len(result.embeddings) == 576
    assert result.tokens == 1
    assert result.prompt_tokens == len(tokens)
    assert result.layout == pb.EMBEDDING_LAYOUT_FINAL
    assert math.sqrt(sum(x * x for x in result.embeddings)) == pytest.approx(1.0)
    assert list(embed(server, text).embeddings) == list(result.embeddings)
    by_tokens = embed(server, tokens=list(tokens)).embeddings
    assert list(by_tokens) == pytest.approx(list(result.embeddings), abs=1e-6)


@pytest.mark.parametrize(
    "anchor, close, far",
    [
        (
            "The cat is sleeping on the sofa.",
            "A kitten naps on the couch.",
            "Interest rates rose by half a percent.",
        ),
        (
            "How do I bake bread at home?",
            "What is a good recipe for homemade bread?",
            "The train to Berlin leaves at noon.",
        ),
        (
            "The football match ended in a draw.",
            "The soccer game finished with a tied score.",
            "Photosynthesis turns light into chemical energy.",
        ),
    ],
)
def test_embeddings_of_close_texts_are_closer(server, anchor, close, far):
    a, c, f = (embed(server, t).embeddings for t in (anchor, close, far))
    assert cosine(a, c) > cosine(a, f)


def test_concurrent_embeddings_batch_with_generation(server):
    texts = ["Short one.", "A somewhat longer sentence about the sea.", "Hi", "x " * 40]
    alone = [list(embed(server, t).embeddings) for t in texts]
    before = server.stub.Status(pb.HealthMessage()).memory.breakdown
    calls = [lambda: server.stub.Predict(chat(Tokens=16))] + [
        lambda t=t: embed(server, t) for t in texts
    ]
    reply, *together = run_concurrently(calls)
    assert reply.message.decode() == ANSWER
    for solo, batched in zip(alone, together):
        assert list(batched.embeddings) == pytest.approx(solo, abs=1e-4)
    after = server.stub.Status(pb.HealthMessage()).memory.breakdown
    assert after["batch_decode_steps"] > before["batch_decode_steps"]


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({}, "Embeddings"),
        ({"EmbeddingTokens": [1, 49152]}, "EmbeddingTokens[1]"),
        ({"Embeddings": "hi", "ModelIdentity": "other-model"}, "model identity"),
    ],
)
def test_embedding_errors(server, fields, needle):
    error = error_of(server.stub.Embedding, pb.PredictOptions(**fields))
    expected = "NOT_FOUND" if "ModelIdentity" in fields else "INVALID_ARGUMENT"
    assert error.code() == getattr(grpc.StatusCode, expected)
    assert needle in error.details()


def test_last_token_pooling_option(server):
    texts = ["Hello", "Hello there, how are you today?", "The sea is calm."]
    mean = [list(embed(server, t).embeddings) for t in texts]
    bad = server.stub.LoadModel(
        pb.ModelOptions(Model=MODEL, Options=["embedding_pooling:max"])
    )
    assert not bad.success and "embedding_pooling" in bad.message
    try:
        result = server.stub.LoadModel(
            pb.ModelOptions(
                Model=MODEL,
                Options=["embedding_pooling:last"],
            )
        )
        assert result.success, result.message
        last = [list(embed(server, t).embeddings) for t in texts]
        together = run_concurrently([lambda t=t: embed(server, t) for t in texts])
    finally:
        server.stub.LoadModel(pb.ModelOptions(Model=MODEL))
    # One token: its mean is itself. Longer texts pool differently.
    assert last[0] == pytest.approx(mean[0], abs=1e-5)
    assert cosine(last[1], mean[1]) < 0.99
    for solo, batched in zip(last, together):
        assert list(batched.embeddings) == pytest.approx(solo, abs=1e-4)


# -- metrics ------------------------------------------------------------------


def test_metrics_and_timings_describe_the_last_request(server):
    # A raw prompt that shares no prefix with earlier ones: nothing of it is cached.
    request = pb.PredictOptions(Prompt="Zebras are striped because", Tokens=10)
    started = time.perf_counter()
    reply = server.stub.Predict(request)
    wall_ms = (time.perf_counter() - started) * 1000
    metrics = server.stub.GetMetrics(pb.MetricsRequest())
    assert metrics.tokens_generated == reply.tokens > 0
    assert metrics.slot_id == 0
    assert metrics.prompt_tokens_processed == reply.prompt_tokens
    assert reply.timing_prompt_processing > 0 and reply.timing_token_generation > 0
    assert reply.timing_prompt_processing + reply.timing_token_generation < wall_ms
    assert metrics.tokens_per_second == pytest.approx(
        reply.tokens / (reply.timing_token_generation / 1000), rel=1e-3
    )
    # The same prompt again comes from the prompt cache: one token runs again.
    final = list(server.stub.PredictStream(request))[-1]
    assert server.stub.GetMetrics(pb.MetricsRequest()).prompt_tokens_processed == 1
    assert final.prompt_tokens == reply.prompt_tokens
    assert final.timing_prompt_processing > 0 and final.timing_token_generation > 0


def test_metrics_slot_of_a_request_next_to_a_running_one(server):
    long_stream = server.stub.PredictStream(chat(Tokens=48, IgnoreEOS=True))
    next(long_stream)  # the long request holds slot 0 now
    reply = server.stub.Predict(chat(Tokens=2))
    assert server.stub.GetMetrics(pb.MetricsRequest()).slot_id == 1
    assert reply.tokens == 2
    *_, last = long_stream
    assert last.tokens == 48
    assert server.stub.GetMetrics(pb.MetricsRequest()).slot_id == 0
