"""Grammars that follow the chat format, end to end on the embedded weights: a
schema constrains the answer after free reasoning, and ToolChoice "required" or a
named function makes the reply a valid call of the offered tools."""

import json

import pytest

import backend_pb2 as pb
from tests.e2e.test_chat_formats import merged
from tests.support import run_concurrently
from tests.unit.test_chat_formats import WEATHER_TOOL
from tests.unit.test_format_grammars import TIME_TOOL

# The weather tool with bounds a small model can't run past in a few tokens.
STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(forcing_server):
    return forcing_server


def load(server, model: str) -> None:
    if server.test_model != model:
        assert server.stub.LoadModel(pb.ModelOptions(Model=model)).success
        server.test_model = model


def chat(**fields) -> pb.PredictOptions:
    return pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content="Weather in Paris?")],
        **fields,
    )


# Each reasoning framing's thought as its model writes it, and the template
# variables that let it think.
THOUGHTS = {
    "json": ("<think>\nSimple question.\n</think>\n\n", {}),
    "open": ("Simple question.\n</think>\n\n", {}),
    "gpt_oss": (
        "<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant"
        "<|channel|>final<|message|>",
        {},
    ),
    "magistral": ("[THINK]Simple question.[/THINK]", {}),
    "command_r7b": ("<|START_THINKING|>Simple question.<|END_THINKING|>", {}),
    "gemma4": (
        "<|channel>thought\nSimple question.<channel|>",
        {"enable_thinking": "true"},
    ),
}


@pytest.mark.parametrize("name", THOUGHTS)
def test_each_reasoning_framing_keeps_its_reasoning_under_a_schema(
    server, folders, chat_models, name
):
    load(server, str(folders[name]))
    tokenizer = chat_models(name)[0]
    thought, kwargs = THOUGHTS[name]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
        "required": ["city"],
    }
    forced = tokenizer.encode(thought, add_special_tokens=False)
    request = chat(
        Grammar=json.dumps(schema),
        Tokens=40,
        Metadata={"forced_prefix": json.dumps(forced), **kwargs},
    )
    unary = merged(server.stub.Predict(request).chat_deltas)
    streamed = merged(
        [d for r in server.stub.PredictStream(request) for d in r.chat_deltas]
    )
    assert unary == streamed
    content, reasoning, calls = unary
    assert reasoning.strip() == "Simple question." and not calls
    assert json.loads(content) in ({"city": "Paris"}, {"city": "Lyon"})


# Two tools of different shapes, as a client declares them: no bounds, and no
# additionalProperties (so no key but theirs).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
EMAIL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": "Send an email",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "urgent": {"type": "boolean"}},
            "required": ["to", "urgent"],
        },
    },
}
SHAPES = {"get_weather": {"city": str}, "send_email": {"to": str, "urgent": bool}}


def fits_its_function(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    shape = SHAPES[name]
    return set(args) == set(shape) and all(
        isinstance(args[key], kind) for key, kind in shape.items()
    )


@pytest.mark.parametrize(
    "model, choice",
    [
        ("plain", '"required"'),
        ("json", json.dumps({"type": "function", "function": {"name": "send_email"}})),
    ],
    ids=["required-bare-json", "named-tool-call-tags"],
)
def test_forced_calls_close_and_fit_their_function_for_20_seeds(
    server, folders, model, choice
):
    # The default model's template has no call format: the model answers with the
    # call's JSON; the Qwen-style template frames calls in <tool_call>. The prompt asks
    # for no tool, sampling at temperature 1 wanders, and 40 tokens are few: a
    # value that runs on is closed in time.
    load(server, str(folders[model]))
    requests = [
        pb.PredictOptions(
            UseTokenizerTemplate=True,
            Messages=[pb.Message(role="user", content="Tell me a joke about cats.")],
            Tools=json.dumps([WEATHER, EMAIL]),
            ToolChoice=choice,
            Temperature=1.0,
            Seed=seed,
            Tokens=40,
            Metadata={"enable_thinking": "false"},
        )
        for seed in range(20)
    ]
    replies = run_concurrently([lambda r=r: server.stub.Predict(r) for r in requests])
    for reply in replies:
        content, _, calls = merged(reply.chat_deltas)
        assert calls and all(fits_its_function(*call) for call in calls), (
            content,
            calls,
        )
        if choice != '"required"':
            assert {name for name, _ in calls} == {"send_email"}


def test_a_call_format_without_a_grammar_refuses_a_forced_call(server, folders):
    import grpc

    options = pb.ModelOptions(
        Model=str(folders["json"]), Options=["tool_parser:function_gemma"]
    )
    assert server.stub.LoadModel(options).success
    server.test_model = None
    request = chat(Tools=json.dumps([WEATHER]), ToolChoice='"required"')
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Predict(request)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details().startswith(
        "ToolChoice: this model's tool calls (function_gemma) have no grammar here"
    )
    # "auto" constrains nothing and is served.
    auto = chat(Tools=json.dumps([WEATHER]), ToolChoice='"auto"', Tokens=8)
    assert server.stub.Predict(auto).tokens > 0


def test_a_named_tool_choice_calls_that_tool(server, folders):
    load(server, str(folders["json"]))
    request = chat(
        Tools=json.dumps([STRICT_WEATHER, TIME_TOOL]),
        ToolChoice=json.dumps({"type": "function", "function": {"name": "get_time"}}),
        Tokens=80,
        Metadata={"enable_thinking": "false"},
    )
    _, _, calls = merged(server.stub.Predict(request).chat_deltas)
    assert [name for name, _ in calls] == ["get_time"]
    assert json.loads(calls[0][1])["zone"] in ("UTC", "CET")
    stream = list(server.stub.PredictStream(request))
    assert merged([d for r in stream for d in r.chat_deltas])[2] == calls


def test_a_tool_choice_naming_an_unknown_tool_is_refused(server, folders):
    import grpc

    load(server, str(folders["json"]))
    request = chat(
        Tools=json.dumps([WEATHER_TOOL]),
        ToolChoice=json.dumps({"type": "function", "function": {"name": "nope"}}),
    )
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Predict(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == (
        "ToolChoice: the function 'nope' is not one of the Tools"
    )
