"""End to end over gRPC: structured output, reasoning and tool calls in the
replies' ChatDeltas, on a real server.

The chat models (conftest's ``folders``) are a tiny llama with the default
tokenizer, marker tokens and a Qwen-style chat template. The server runs ``ForcingServicer``:
a request's ``Metadata["forced_tokens"]`` makes the model generate exactly the
tokens a test names.
"""

import json
import random
import re

import pytest

import backend_pb2 as pb
from tests.chat_models import CALL_LYON, REPLY, THOUGHT
from tests.support import merge_chat_deltas, run_concurrently

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(forcing_server):
    return forcing_server


def load(server, folders, name: str) -> None:
    """Serve test model ``name`` with forced tokens; a load costs seconds, so the
    model already loaded stays."""
    if server.test_model == name:
        return
    server.test_model = None
    result = server.stub.LoadModel(pb.ModelOptions(Model=str(folders[name])))
    assert result.success, result.message
    server.test_model = name


def weather_chat(tokenizer, reply: str | list[int], **fields) -> pb.PredictOptions:
    tokens = reply if isinstance(reply, list) else tokenizer.encode(reply)
    metadata = {"forced_tokens": json.dumps(tokens), **fields.pop("Metadata", {})}
    return pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content="Weather in Paris and Lyon?")],
        Tools=json.dumps([WEATHER_TOOL]),
        Metadata=metadata,
        **fields,
    )


def summary(chat_deltas) -> tuple:
    """Content, reasoning and calls (index, name, parsed arguments) of proto
    ChatDeltas."""
    content, reasoning, calls = merge_chat_deltas(chat_deltas)
    parsed = tuple((i, name, json.loads(args)) for i, _, name, args in calls)
    return content, reasoning, parsed


EXPECTED_REPLY = (
    "Let me check both cities.\n",
    THOUGHT + "\n",
    (
        (0, "get_weather", {"city": "Paris", "days": 2}),
        (1, "get_weather", {"city": "Lyon"}),
    ),
)


def test_predict_returns_one_classified_delta(server, folders, chat_tokenizer):
    load(server, folders, "json")
    tokens = chat_tokenizer.encode(REPLY)
    reply = server.stub.Predict(weather_chat(chat_tokenizer, tokens))
    assert reply.message.decode() == "Let me check both cities.\n"
    assert len(reply.chat_deltas) == 1
    assert summary(reply.chat_deltas) == EXPECTED_REPLY
    calls = reply.chat_deltas[0].tool_calls
    assert [c.arguments for c in calls] == [
        '{"city": "Paris", "days": 2}',
        '{"city": "Lyon"}',
    ]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert reply.tokens == len(tokens)


def test_stream_carries_each_tokens_deltas(server, folders, chat_tokenizer):
    load(server, folders, "json")
    text = f"<think>\nSunny?\n</think>\n\nHi!<tool_call>\n{CALL_LYON}\n</tool_call>"
    replies = list(server.stub.PredictStream(weather_chat(chat_tokenizer, text)))
    seen = [
        (r.message.decode(), summary(r.chat_deltas))
        for r in replies
        if (r.chat_deltas and not r.chat_deltas[0].tool_calls) or r.message
    ]
    assert seen == [
        ("", ("", "Sun", ())),
        ("", ("", "ny", ())),
        ("", ("", "?", ())),
        ("", ("", "\n", ())),
        ("Hi", ("Hi", "", ())),
        ("!", ("!", "", ())),
    ]
    # The call: its name once its arguments open, then their text token by token.
    calls = [
        (c.index, c.name, c.arguments)
        for r in replies
        for d in r.chat_deltas
        for c in d.tool_calls
    ]
    assert calls[0][:2] == (0, "get_weather")
    assert [name for _, name, _ in calls[1:]] == [""] * (len(calls) - 1)
    assert "".join(args for _, _, args in calls) == '{"city": "Lyon"}'
    assert len(calls) >= 4
    assert replies[-1].tokens == len(chat_tokenizer.encode(text))
    assert replies[-1].prompt_tokens > 0


def test_any_split_streams_what_predict_returns(server, folders, chat_tokenizer):
    load(server, folders, "json")
    rng = random.Random(5)
    requests = []
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(REPLY)), 12))
        pieces = [REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(REPLY)])]
        tokens = [t for p in pieces for t in chat_tokenizer.encode(p)]
        requests.append(weather_chat(chat_tokenizer, tokens))
    # All six in one batch: classification is per request.
    results = run_concurrently(
        [lambda r=r: list(server.stub.PredictStream(r)) for r in requests]
        + [lambda r=r: server.stub.Predict(r) for r in requests]
    )
    for replies, predicted in zip(results[:3], results[3:]):
        streamed = summary([d for r in replies for d in r.chat_deltas])
        assert streamed == EXPECTED_REPLY
        assert "".join(r.message.decode() for r in replies) == EXPECTED_REPLY[0]
        assert summary(predicted.chat_deltas) == streamed


def test_a_prompt_that_opens_thinking_streams_reasoning_first(
    server, folders, chat_tokenizer
):
    load(server, folders, "open")
    request = weather_chat(chat_tokenizer, f"{THOUGHT}\n</think>\n\nIt is sunny.")
    prompt = server.stub.TokenizeString(request).tokens
    assert chat_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    reply = server.stub.Predict(request)
    assert summary(reply.chat_deltas) == ("It is sunny.", THOUGHT + "\n", ())
    # With thinking off the template closes it, and the reply is content.
    off = weather_chat(
        chat_tokenizer, "It is sunny.", Metadata={"enable_thinking": "false"}
    )
    assert summary(server.stub.Predict(off).chat_deltas) == ("It is sunny.", "", ())


def test_qwen3_coder_tool_calls(server, folders, chat_models):
    load(server, folders, "coder")
    coder = chat_models("coder")[0]
    call = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    reply = server.stub.Predict(weather_chat(coder, "Checking." + call))
    # The tool schema makes "days" an integer.
    assert summary(reply.chat_deltas) == (
        "Checking.",
        "",
        ((0, "get_weather", {"city": "Paris", "days": 3}),),
    )


@pytest.mark.parametrize(
    "call, why",
    [
        ('{"name": "get_time", "arguments": {}}', "'get_time' is not one of the"),
        ('{"name": "get_weather", "arguments": "{oops"}', "the arguments are not"),
        ('{"name": get_weather}', "the call's name is not a string"),
    ],
)
def test_a_bad_tool_call_is_content_and_logged(
    server, folders, chat_tokenizer, call, why
):
    load(server, folders, "json")
    raw = f"<tool_call>\n{call}\n</tool_call>"
    reply = server.stub.Predict(weather_chat(chat_tokenizer, "Hm. " + raw))
    assert summary(reply.chat_deltas) == ("Hm. " + raw, "", ())
    assert reply.message.decode() == "Hm. " + raw
    assert f"a tool call could not be read ({why}" in server.logs()


def test_tool_choice_none_offers_no_tools_and_parses_none(
    server, folders, chat_tokenizer
):
    load(server, folders, "json")
    text = f"<tool_call>{CALL_LYON}</tool_call>"
    offered = weather_chat(chat_tokenizer, text)
    declined = weather_chat(chat_tokenizer, text, ToolChoice='"none"')
    assert "get_weather" in chat_tokenizer.decode(
        server.stub.TokenizeString(offered).tokens
    )
    assert "get_weather" not in chat_tokenizer.decode(
        server.stub.TokenizeString(declined).tokens
    )
    assert summary(server.stub.Predict(declined).chat_deltas) == (text, "", ())
    auto = weather_chat(chat_tokenizer, text, ToolChoice='"auto"')
    assert summary(server.stub.Predict(auto).chat_deltas)[2] == (
        (0, "get_weather", {"city": "Lyon"}),
    )


def test_stop_strings_and_eos_end_classified_text(server, folders, chat_tokenizer):
    load(server, folders, "json")
    stopped = server.stub.Predict(
        weather_chat(chat_tokenizer, REPLY, StopPrompts=["cities"])
    )
    assert summary(stopped.chat_deltas) == ("Let me check both ", THOUGHT + "\n", ())
    # The forced script ends with EOS: nothing follows the second call.
    assert server.stub.Predict(
        weather_chat(chat_tokenizer, REPLY, Tokens=500)
    ).tokens == len(chat_tokenizer.encode(REPLY))


def test_a_raw_prompt_keeps_its_raw_text(server, folders, chat_tokenizer):
    load(server, folders, "json")
    request = pb.PredictOptions(
        Prompt="Weather?",
        Metadata={"forced_tokens": json.dumps(chat_tokenizer.encode(REPLY))},
    )
    reply = server.stub.Predict(request)
    assert reply.message.decode() == REPLY
    assert summary(reply.chat_deltas) == (REPLY, "", ())


# LocalAI's Go templates render the conversation themselves and send it as Prompt.
RENDERED = (
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n<|im_start|>assistant\n"
)


def forced_prompt(tokenizer, prompt: str, reply: str, **fields) -> pb.PredictOptions:
    tokens = json.dumps(tokenizer.encode(reply))
    return pb.PredictOptions(
        Prompt=prompt, Metadata={"forced_tokens": tokens}, **fields
    )


def test_a_raw_prompt_with_tools_is_classified(server, folders, chat_tokenizer):
    load(server, folders, "json")
    tools = json.dumps([WEATHER_TOOL])
    request = forced_prompt(chat_tokenizer, RENDERED, REPLY, Tools=tools)
    # ToolChoice none parses no calls: the markup stays text, the reasoning does not.
    text = f"<think>Hmm.</think><tool_call>\n{CALL_LYON}\n</tool_call>"
    unparsed = forced_prompt(
        chat_tokenizer, RENDERED, text, Tools=tools, ToolChoice="none"
    )
    reply, replies, plain = run_concurrently(
        [
            lambda: server.stub.Predict(request),
            lambda: list(server.stub.PredictStream(request)),
            lambda: server.stub.Predict(unparsed),
        ]
    )
    assert reply.message.decode() == EXPECTED_REPLY[0]
    assert summary(reply.chat_deltas) == EXPECTED_REPLY
    assert "".join(r.message.decode() for r in replies) == EXPECTED_REPLY[0]
    assert summary([d for r in replies for d in r.chat_deltas]) == EXPECTED_REPLY
    assert summary(plain.chat_deltas) == (
        f"<tool_call>\n{CALL_LYON}\n</tool_call>",
        "Hmm.",
        (),
    )


def test_a_raw_prompt_that_ends_inside_thinking_is_classified(
    server, folders, chat_tokenizer
):
    load(server, folders, "json")
    opened = RENDERED + "<think>\n"
    reply = server.stub.Predict(
        forced_prompt(chat_tokenizer, opened, f"{THOUGHT}\n</think>\n\nSunny.")
    )
    assert summary(reply.chat_deltas) == ("Sunny.", THOUGHT + "\n", ())
    assert reply.message.decode() == "Sunny."
    # After a closed think block, a completion without Tools stays raw text.
    closed = opened + "Hmm.\n</think>\n\n"
    text = "Sunny.<tool_call>"
    reply = server.stub.Predict(forced_prompt(chat_tokenizer, closed, text))
    assert summary(reply.chat_deltas) == (text, "", ())


LYON_CALL = {"name": "get_weather", "arguments": '{"city": "Lyon"}'}


def test_tool_call_history_renders(server, folders, chat_tokenizer):
    load(server, folders, "json")
    history = [
        pb.Message(role="user", content="Weather in Lyon?"),
        pb.Message(
            role="assistant",
            content="",
            reasoning_content="Use the tool.",
            tool_calls=json.dumps([{"id": "call_7", "function": LYON_CALL}]),
        ),
        pb.Message(role="tool", content="sunny", tool_call_id="call_7"),
    ]
    request = pb.PredictOptions(UseTokenizerTemplate=True, Messages=history)
    rendered = chat_tokenizer.decode(server.stub.TokenizeString(request).tokens)
    assert rendered == (
        "<|im_start|>user\nWeather in Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response id="call_7">\nsunny\n</tool_response>'
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_model_metadata(server, folders):
    load(server, folders, "json")
    metadata = server.stub.ModelMetadata(pb.ModelOptions())
    assert metadata.supports_thinking
    assert metadata.rendered_template == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    markers = metadata.tool_format
    assert (markers.format_type, markers.section_start, markers.section_end) == (
        "json+<think>",
        "<tool_call>",
        "</tool_call>",
    )
    assert (markers.reasoning_start, markers.reasoning_end) == ("<think>", "</think>")
    server.test_model = None
    assert server.stub.LoadModel(pb.ModelOptions(Model="default")).success
    plain = server.stub.ModelMetadata(pb.ModelOptions())
    assert not plain.supports_thinking and plain.tool_format.format_type == ""
    assert plain.rendered_template.endswith("<|im_start|>assistant\n")


# A grammar that makes the model call the tool, as LocalAI's strict mode does.
TOOL_CALL_GBNF = r"""
root ::= "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" city "\"}}\n</tool_call>"
city ::= "Paris" | "Lyon"
"""


def test_a_grammar_forced_tool_call_is_classified(server, folders):
    load(server, folders, "json")
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content="Weather in Paris or Lyon?")],
        Tools=json.dumps([WEATHER_TOOL]),
        Grammar=TOOL_CALL_GBNF,
        # The prompt closes the thinking the random weights would stay in.
        Metadata={"enable_thinking": "false"},
    )
    reply = server.stub.Predict(request)
    content, reasoning, calls = summary(reply.chat_deltas)
    assert (content, reasoning, reply.message) == ("", "", b"")
    ((index, name, arguments),) = calls
    assert (index, name) == (0, "get_weather")
    assert arguments in ({"city": "Paris"}, {"city": "Lyon"})
    streamed = list(server.stub.PredictStream(request))
    assert summary([d for r in streamed for d in r.chat_deltas])[2] == calls
