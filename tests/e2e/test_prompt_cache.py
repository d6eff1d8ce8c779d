"""End-to-end tests of the prompt cache: greedy replies are the same with it and
without it over repeats, exact hits, trims, penalties and a multi-turn chat, and
each reuses what it should; a cancelled generation leaves its entry; Free and
LoadModel clear it; on a hit the reply and GetMetrics count the prompt tokens. The
worker's default backend serves conftest's ``tiny_llama`` here: what the cache
reuses, not what the weights say, is under test."""

import json
import time

import pytest

import backend_pb2 as pb
from tests.support import chat

SYSTEM = (
    "You are a helpful assistant for a small bakery in Lyon. You answer questions "
    "about bread, pastries, opening hours and prices in short, friendly sentences."
)
QUESTION_WORDS = ("Where", "When")
STORY = "The lighthouse keeper climbed the stairs every night. " * 6
TURNS = [
    "What time do you open on Sunday?",
    "Do you sell croissants?",
    "How much is a baguette?",
]


@pytest.fixture(scope="module")
def server(server, tiny_llama):
    server.model = str(tiny_llama)
    assert load(server)
    return server


def load(server, *options: str) -> bool:
    """A fresh load of the module's model (an empty prompt cache), with ``options``."""
    request = pb.ModelOptions(Model=server.model, Options=list(options))
    return server.stub.LoadModel(request).success


def cache_counters(server) -> dict[str, int]:
    """The prompt cache figures in Status, once the last request has been retired."""
    deadline = time.monotonic() + 5
    while True:
        status = server.stub.Status(pb.HealthMessage())
        if status.state == pb.StatusResponse.READY or time.monotonic() > deadline:
            return dict(status.memory.breakdown)
        time.sleep(0.01)


def conversation(turns: int, answers: list[str]) -> list[pb.Message]:
    messages = [pb.Message(role="system", content=SYSTEM)]
    for question, answer in zip(TURNS[:turns], answers + [None]):
        messages.append(pb.Message(role="user", content=question))
        if answer is not None:
            messages.append(pb.Message(role="assistant", content=answer))
    return messages


def story_chat(question: str, **fields) -> pb.PredictOptions:
    messages = [
        pb.Message(role="system", content=STORY),
        pb.Message(role="user", content=question),
    ]
    return pb.PredictOptions(
        UseTokenizerTemplate=True, Messages=messages, Tokens=12, **fields
    )


def cache_workload(server) -> tuple[list[bytes], list[int]]:
    """Greedy replies to a fixed request sequence, and the cached tokens each reused.

    The sequence makes a repeat, an exact hit, the trim of a longer entry, a
    penalized repeat and a multi-turn conversation in which each turn extends the
    previous one.
    """
    replies, reused = [], []

    def ask(request):
        before = cache_counters(server)["prompt_cache_reused_tokens"]
        replies.append(server.stub.Predict(request).message)
        reused.append(cache_counters(server)["prompt_cache_reused_tokens"] - before)

    ask(story_chat("Where did the keeper climb?"))
    ask(story_chat("Where did the keeper climb?"))  # a longer entry covers it
    ask(pb.PredictOptions(Prompt="Once upon a time", Tokens=12))
    # The previous prompt and reply, token for token: an exact hit.
    ask(pb.PredictOptions(Prompt="Once upon a time" + replies[-1].decode(), Tokens=12))
    ask(story_chat("When did the keeper climb?"))  # trims a longer entry
    # Penalties look back over the prompt, including its cached part.
    ask(story_chat("Where did the keeper climb?", PresencePenalty=1.5, Penalty=1.5))
    answers: list[str] = []
    for turn in range(1, len(TURNS) + 1):
        messages = conversation(turn, answers)
        ask(pb.PredictOptions(UseTokenizerTemplate=True, Messages=messages, Tokens=16))
        answers.append(replies[-1].decode())
    return replies, reused


def test_prompt_cache_keeps_greedy_output_identical(server):
    assert load(server, "max_cache_entries:0")
    try:
        expected, reused = cache_workload(server)
        assert reused == [0] * len(expected)
        assert cache_counters(server)["prompt_cache_entries"] == 0
    finally:
        assert load(server)
    assert all(expected), expected
    replies, reused = cache_workload(server)
    assert replies == expected
    cold, repeat, story, exact, trim, penalized, *turns = reused

    def tokens(request):
        return list(server.stub.TokenizeString(request).tokens)

    where, when = (
        tokens(story_chat(q + " did the keeper climb?")) for q in QUESTION_WORDS
    )
    assert cold == 0 and repeat == penalized == len(where) - 1
    continued = pb.PredictOptions(Prompt="Once upon a time" + expected[2].decode())
    assert exact == len(tokens(continued)) - 1
    # The trimmed entry serves exactly the tokens the two questions share.
    shared = next(i for i, (a, b) in enumerate(zip(where, when)) if a != b)
    assert trim == shared > len(where) - 16
    # Later turns reuse the whole previous turn, its reply included.
    assert turns[2] > turns[1] > turns[0] > 0
    counters = cache_counters(server)
    assert counters["prompt_cache_entries"] >= 1
    assert counters["prompt_cache_bytes"] > 0


def test_a_cancelled_generation_leaves_its_cache(server):
    assert load(server)  # an empty cache
    stream = server.stub.PredictStream(chat("Tell me a story.", Tokens=200))
    for _ in zip(range(3), stream):
        pass
    stream.cancel()
    counters = cache_counters(server)
    assert counters["prompt_cache_entries"] == 1
    before = counters["prompt_cache_reused_tokens"]
    reply = server.stub.Predict(chat("Tell me a story.", Tokens=4))
    reused = cache_counters(server)["prompt_cache_reused_tokens"] - before
    assert reused == reply.prompt_tokens - 1


def test_free_and_load_clear_the_prompt_cache(server):
    server.stub.Predict(chat(Tokens=4))
    assert cache_counters(server)["prompt_cache_entries"] >= 1
    assert load(server)
    assert cache_counters(server)["prompt_cache_entries"] == 0
    server.stub.Predict(chat(Tokens=4))
    assert server.stub.Free(pb.HealthMessage()).success
    try:
        status = server.stub.Status(pb.HealthMessage())
        assert status.memory.breakdown["prompt_cache_entries"] == 0
    finally:
        assert load(server)


def test_prompt_tokens_count_the_whole_prompt_on_a_hit(server):
    first = server.stub.Predict(chat("Say hello.", Tokens=8))
    cold = server.stub.GetMetrics(pb.MetricsRequest())
    again = server.stub.Predict(chat("Say hello.", Tokens=8))
    warm = server.stub.GetMetrics(pb.MetricsRequest())
    assert first.prompt_tokens == again.prompt_tokens > 20
    assert again.message == first.message
    # GetMetrics counts the prompt tokens actually processed: one on a full hit.
    assert cold.prompt_tokens_processed > 1 and warm.prompt_tokens_processed == 1
    assert warm.tokens_generated == again.tokens == 8
    assert warm.tokens_per_second > 0
    # Speculation counts, as JSON: the proto has no fields for them.
    speculation = json.loads(warm.prompt_json_for_slot)
    assert set(speculation) == {"draft_tokens_proposed", "draft_tokens_accepted"}
    assert (
        0
        <= speculation["draft_tokens_accepted"]
        <= speculation["draft_tokens_proposed"]
    )
