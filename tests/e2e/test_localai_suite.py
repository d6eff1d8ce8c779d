"""LocalAI's backend e2e suite (``tests/e2e-backends``), run as LocalAI runs it.

The suite starts ``BACKEND_BINARY`` (a ``run.sh``) as ``run.sh --addr=127.0.0.1:PORT``,
waits at most 30 s for the port, loads ``BACKEND_TEST_MODEL_FILE`` (here by default
the embedded GGUF copied to ``model.bin``, as the suite names its downloads) and runs
the specs that ``BACKEND_TEST_CAPS`` enables, with the suite's requests and
assertions. ``make e2e-localai`` runs this file against any run.sh and model.
"""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest

import backend_pb2 as pb
import backend_pb2_grpc
from mlx_backend.models.loading import default_model_path
from tests.support import ROOT, backend_environment

# What this backend serves; the suite's own default is health,load,predict,stream.
ALL_CAPS = "health,load,predict,tokenize,stream,logprobs,logit_bias,embeddings,tools"
PORT_DEADLINE = 30.0
PROMPT = os.environ.get("BACKEND_TEST_PROMPT") or "The capital of France is"
STREAM_PROMPT = "Once upon a time"
TOOL_PROMPT = (
    os.environ.get("BACKEND_TEST_TOOL_PROMPT")
    or "What's the weather like in Paris, France?"
)
TOOL_NAME = os.environ.get("BACKEND_TEST_TOOL_NAME") or "get_weather"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Get the current weather for a location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    }
                },
                "required": ["location"],
            },
        },
    }
]
SYSTEM = (
    "You are a helpful assistant. Use the provided tool when the user asks about "
    "weather."
)
# The 135M default model answers in prose: its chat starts with a worked turn that
# called the tool, so the spec tests the backend's parsing, not the model's skill.
TOOL_EXAMPLE = [
    {"role": "user", "content": "What's the weather like in Lyon, France?"},
    {
        "role": "assistant",
        "content": "<tool_call>\n"
        + json.dumps({"name": TOOL_NAME, "arguments": {"location": "Lyon, France"}})
        + "\n</tool_call>",
    },
]
# The default GGUF's chat template doesn't name Hermes-style tool calls.
DEFAULT_MODEL_OPTIONS = "tool_parser:hermes"
SAMPLING = dict(Temperature=0.1, TopK=40, TopP=0.9)


def environment_list(name: str, default: str = "") -> list[str]:
    raw = os.environ.get(name, "").strip() or default
    return [part.strip() for part in raw.split(",") if part.strip()]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def wait_for_port(address: str, process: subprocess.Popen, log: Path) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + PORT_DEADLINE
    while time.monotonic() < deadline:
        if process.poll() is None:
            try:
                socket.create_connection((host, int(port)), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.2)
                continue
        pytest.fail(f"the backend exited with {process.returncode}:\n{log.read_text()}")
    pytest.fail(
        f"the backend did not listen on {address} within {PORT_DEADLINE} s:\n"
        f"{log.read_text()}"
    )


@pytest.fixture(scope="module")
def caps() -> set[str]:
    return {cap.lower() for cap in environment_list("BACKEND_TEST_CAPS", ALL_CAPS)}


@pytest.fixture(scope="module")
def model_file():
    given = os.environ.get("BACKEND_TEST_MODEL_FILE")
    if given:
        yield given, False
        return
    with tempfile.TemporaryDirectory(prefix="backend-e2e-") as folder:
        path = Path(folder) / "model.bin"
        shutil.copyfile(default_model_path(), path)
        yield str(path), True


@pytest.fixture(scope="module")
def stub():
    binary = Path(os.environ.get("BACKEND_BINARY") or ROOT / "run.sh")
    assert binary.name == "run.sh", "BACKEND_BINARY must point at a run.sh"
    address = f"127.0.0.1:{free_port()}"
    with tempfile.NamedTemporaryFile(prefix="backend-e2e-", suffix=".log") as log:
        process = subprocess.Popen(
            [str(binary), f"--addr={address}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=backend_environment(),
        )
        try:
            wait_for_port(address, process, Path(log.name))
            with grpc.insecure_channel(address) as channel:
                yield backend_pb2_grpc.BackendStub(channel)
        finally:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def load_result(stub, model_file, caps) -> pb.Result:
    path, default = model_file
    options = environment_list(
        "BACKEND_TEST_OPTIONS", DEFAULT_MODEL_OPTIONS if default else ""
    )
    return stub.LoadModel(
        pb.ModelOptions(
            Model=path,
            ModelFile=path,
            ContextSize=int(os.environ.get("BACKEND_TEST_CTX_SIZE") or 512),
            Threads=int(os.environ.get("BACKEND_TEST_THREADS") or 4),
            NGPULayers=0,
            MMap=True,
            NBatch=128,
            Embeddings="embeddings" in caps,
            Options=options,
            CacheTypeKey=os.environ.get("BACKEND_TEST_CACHE_TYPE_K", ""),
            CacheTypeValue=os.environ.get("BACKEND_TEST_CACHE_TYPE_V", ""),
        ),
        timeout=600,
    )


@pytest.fixture
def loaded(stub, load_result):
    if not load_result.success:
        pytest.fail(f"LoadModel failed: {load_result.message}")
    return stub


def needs(caps: set[str], cap: str) -> None:
    if cap not in caps:
        pytest.skip(f"{cap} capability not enabled")


def test_health(stub, caps):
    needs(caps, "health")
    assert stub.Health(pb.HealthMessage(), timeout=10).message


def test_loads_the_model(load_result, caps):
    needs(caps, "load")
    assert load_result.success, f"LoadModel failed: {load_result.message}"


def test_predict(loaded, caps):
    needs(caps, "predict")
    reply = loaded.Predict(pb.PredictOptions(Prompt=PROMPT, Tokens=20, **SAMPLING))
    assert reply.message, "Predict produced empty output"
    assert 0 < reply.tokens <= 20


def test_tokenize_string(loaded, caps):
    needs(caps, "tokenize")
    reply = loaded.TokenizeString(pb.PredictOptions(Prompt=PROMPT), timeout=60)
    assert reply.tokens, "TokenizeString returned no tokens for a non-empty prompt"
    assert reply.length == len(reply.tokens)


def test_predict_stream(loaded, caps):
    needs(caps, "stream")
    request = pb.PredictOptions(Prompt=STREAM_PROMPT, Tokens=20, **SAMPLING)
    chunks = [r.message for r in loaded.PredictStream(request, timeout=120)]
    chunks = [c for c in chunks if c]
    assert chunks, "no stream chunks received"
    # The suite's guard against a duplicated first content token.
    if len(chunks) >= 2:
        assert chunks[0] != chunks[1], f"first content token was duplicated: {chunks}"


def test_logprobs(loaded, caps):
    needs(caps, "logprobs")
    request = pb.PredictOptions(
        Prompt=PROMPT, Tokens=10, Logprobs=1, TopLogprobs=1, **SAMPLING
    )
    reply = loaded.Predict(request, timeout=120)
    assert reply.message, "Predict produced empty output"
    assert reply.logprobs, "Reply.logprobs was empty when requested"
    content = json.loads(reply.logprobs)["content"]
    assert 0 < len(content) <= reply.tokens
    assert all(len(entry["top_logprobs"]) == 1 for entry in content)


def test_logit_bias(loaded, caps):
    needs(caps, "logit_bias")
    request = pb.PredictOptions(
        Prompt=PROMPT, Tokens=10, LogitBias='{"1":-100}', **SAMPLING
    )
    reply = loaded.Predict(request, timeout=120)
    assert reply.message, "Predict produced empty output with logit_bias"


def test_embedding(loaded, caps):
    needs(caps, "embeddings")
    reply = loaded.Embedding(pb.PredictOptions(Embeddings=PROMPT), timeout=60)
    assert reply.embeddings, "Embedding returned empty vector"
    assert reply.dim == len(reply.embeddings)


def test_tool_call_in_chat_deltas(loaded, caps, model_file):
    needs(caps, "tools")
    _, default = model_file
    messages = [
        {"role": "system", "content": SYSTEM},
        *(TOOL_EXAMPLE if default else []),
        {"role": "user", "content": TOOL_PROMPT},
    ]
    request = pb.PredictOptions(
        Messages=[pb.Message(**m) for m in messages],
        Tools=json.dumps(TOOLS),
        ToolChoice="auto",
        UseTokenizerTemplate=True,
        Tokens=200,
        Temperature=0.1,
    )
    reply = loaded.Predict(request, timeout=300)
    calls = [call for delta in reply.chat_deltas for call in delta.tool_calls]
    assert calls, f"Predict did not return any ToolCallDelta. raw={reply.message!r}"
    assert TOOL_NAME in [call.name for call in calls], calls
    if default:
        (call,) = calls
        assert json.loads(call.arguments) == {"location": "Paris, France"}
