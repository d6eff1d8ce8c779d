"""End-to-end tests of what a serving backend refuses, and of LoadModel while it
serves: malformed fields and messages are INVALID_ARGUMENT and name the field, the
context size and the model identity are enforced, a failed load keeps the model
serving, and load options are request defaults."""

import math
import re
from pathlib import Path

import grpc
import pytest

import backend_pb2 as pb
from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path
from tests.support import ANSWER, QUESTION, chat, error_of

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
