"""Structured output: reasoning and tool calls classified while tokens stream.

The real default weights are exported as an MLX folder whose tokenizer renames
four unused special tokens to ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` and carries a Qwen-style chat template, so mlx-lm detects the
markers and the tool parser as it would for a Qwen model. The servers run
conftest's ``ForcingServicer``: a request's ``Metadata["forced_tokens"]`` makes the
model generate exactly the tokens a test names.
"""

import json
import logging
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path
from mlx_backend.output.chat_output import (
    Delta,
    OutputOptions,
    make_output_markers,
    merge_deltas,
)
from mlx_backend.output.detokenizer import TokenBytes
from mlx_backend.output.reply_pipeline import ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest
from python_utils import parse_options
from tests.support import Server, run_concurrently

MARKER_TOKENS = {3: "<think>", 4: "</think>", 5: "<tool_call>", 6: "</tool_call>"}

# Qwen2.5/Qwen3-style: JSON calls in <tool_call>, reasoning in <think>.
JSON_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

# The same, but the assistant turn opens inside thinking (Qwen3 2507 Thinking).
OPEN_THINK_TEMPLATE = JSON_TEMPLATE.replace(
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n",
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n",
)

# Qwen3-Coder: XML-style calls, <tool_call>\n<function=NAME>\n<parameter=K>\nV\n...
CODER_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
<tool_call>
<function={{ tool_call.function.name }}>
{%- for key, value in tool_call.function.arguments.items() %}
<parameter={{ key }}>
{{ value }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

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

THOUGHT = "The user wants the weather. I should call the tool."
CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
CALL_LYON = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
REPLY = (
    f"<think>\n{THOUGHT}\n</think>\n\nLet me check both cities."
    f"<tool_call>\n{CALL_PARIS}\n</tool_call>\n<tool_call>\n{CALL_LYON}\n</tool_call>"
)


def make_chat_folder(base: Path, folder: Path, template: str) -> Path:
    """The exported default model with marker tokens and ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        (folder / name).symlink_to(base / name)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for entry in tokenizer["added_tokens"]:
        if entry["id"] in MARKER_TOKENS:
            del vocab[entry["content"]]
            entry["content"] = MARKER_TOKENS[entry["id"]]
            entry["special"] = False  # as in Qwen: the markers decode as text
            vocab[entry["content"]] = entry["id"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    base = export_mlx_folder(default_model_path(), root / "base")
    templates = {
        "json": JSON_TEMPLATE,
        "open": OPEN_THINK_TEMPLATE,
        "coder": CODER_TEMPLATE,
    }
    return {
        name: make_chat_folder(base, root / name, template)
        for name, template in templates.items()
    }


@pytest.fixture(scope="module")
def tokenizer(folders):
    return load_tokenizer(folders["json"])


# -- the parser, fed by the real tokenizer's streaming detokenizer -----------------


def classify(tokenizer, pieces: list[str], stops=(), **options) -> list[Delta]:
    """Deltas for a reply generated as the tokens of each piece in turn, through the
    engine's reply pipeline: one per token, then the held-back rest."""
    tokens = [t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False)]
    request = GenerationRequest(
        prompt=(),
        max_tokens=len(tokens) + 1,
        stop=tuple(stops),
        ignore_eos=True,
        output=OutputOptions(classify=True, **options),
    )
    # No logprobs are asked for, so no token bytes are needed.
    reply = ReplyPipeline(
        request, tokenizer, make_output_markers(tokenizer), TokenBytes(())
    )
    deltas = []
    for token in tokens:
        event = reply.add(token)
        deltas.append(event.delta if event else Delta())
        if reply.finished:
            return deltas
    deltas.append(reply.finish("stop").delta)
    return deltas


def without_ids(delta: Delta) -> tuple:
    calls = tuple((c.index, c.name, json.loads(c.arguments)) for c in delta.tool_calls)
    return delta.content, delta.reasoning, calls


def test_markers_come_from_the_tokenizer(folders, tokenizer):
    markers = make_output_markers(tokenizer)
    assert (markers.think_start, markers.think_end) == ("<think>", "</think>")
    assert (markers.tool_call_start, markers.tool_call_end) == (
        "<tool_call>",
        "</tool_call>",
    )
    assert markers.tool_format == "json_tools"
    assert make_output_markers(load_tokenizer(folders["coder"])).tool_format == (
        "qwen3_coder"
    )


def test_the_tool_parser_option_replaces_the_inferred_markup(folders):
    coder = load_tokenizer(folders["coder"])
    hermes = make_output_markers(
        coder, parse_options(["tool_parser:hermes"]).tool_parser
    )
    assert (hermes.tool_call_start, hermes.tool_call_end, hermes.tool_format) == (
        "<tool_call>",
        "</tool_call>",
        "json_tools",
    )
    call = hermes.tool_parser('{"name": "get_weather", "arguments": {"city": "Nice"}}')
    assert call == {"name": "get_weather", "arguments": {"city": "Nice"}}
    assert make_output_markers(coder, "pythonic").tool_format == "pythonic"
    with pytest.raises(
        InvalidArgument,
        match=r"^Options: tool_parser must be one of "
        r".*json_tools, .*pythonic, .* or hermes, not 'vllm'$",
    ):
        parse_options(["tool_parser:vllm"])


def test_reasoning_content_and_two_tool_calls(tokenizer):
    whole = merge_deltas(classify(tokenizer, [REPLY]))
    assert without_ids(whole) == (
        "Let me check both cities.\n",
        THOUGHT + "\n",
        (
            (0, "get_weather", {"city": "Paris", "days": 2}),
            (1, "get_weather", {"city": "Lyon"}),
        ),
    )
    ids = [call.id for call in whole.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == 2


def test_each_call_is_emitted_when_its_closing_marker_arrives(tokenizer):
    deltas = classify(tokenizer, [f"<tool_call>\n{CALL_LYON}\n", "</tool_call>", "ok"])
    with_calls = [i for i, d in enumerate(deltas) if d.tool_calls]
    closing = len(tokenizer.encode(f"<tool_call>\n{CALL_LYON}\n"))
    assert with_calls == [closing]
    assert all(not d.content for d in deltas[:closing])
    assert merge_deltas(deltas).content == "ok"


@pytest.mark.parametrize("marker", ["<think>", "</think>", "<tool_call>"])
def test_a_marker_split_into_characters_never_leaks(tokenizer, marker):
    # Each character its own token: the marker is held back until resolved.
    pieces = ["Hi "] + list("<think>") + ["hmm"] + list("</think>") + ["Done"]
    if marker == "<tool_call>":
        pieces = ["Hi "] + list(f"<tool_call>{CALL_LYON}</tool_call>") + ["Done"]
    deltas = classify(tokenizer, pieces)
    assert all("<" not in d.content for d in deltas)
    whole = merge_deltas(deltas)
    assert whole.content == "Hi Done"


def test_a_partial_marker_that_never_completes_is_text(tokenizer):
    whole = merge_deltas(classify(tokenizer, ["a <thin", "g> b <tool_c"]))
    assert without_ids(whole) == ("a <thing> b <tool_c", "", ())


def test_a_reply_that_opens_inside_thinking(tokenizer):
    whole = merge_deltas(
        classify(tokenizer, [THOUGHT, "</think>\n\nSunny."], reasoning_open=True)
    )
    assert without_ids(whole) == ("Sunny.", THOUGHT, ())


def test_a_lone_closing_marker_is_stripped(tokenizer):
    whole = merge_deltas(classify(tokenizer, ["Sure.</think> Sunny."]))
    assert whole.content == "Sure. Sunny."


def test_a_bad_tool_call_comes_back_as_content(tokenizer, caplog):
    raw = '<tool_call>\n{"name": "get_weather", "arguments": [1, 2}\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="mlx_backend"):
        whole = merge_deltas(classify(tokenizer, ["Hmm. ", raw, " Sorry."]))
    assert without_ids(whole) == (f"Hmm. {raw} Sorry.", "", ())
    assert "could not parse a" in caplog.text


def test_an_unfinished_tool_call_is_parsed_at_the_end(tokenizer):
    whole = merge_deltas(classify(tokenizer, [f"<tool_call>\n{CALL_LYON}\n"]))
    assert without_ids(whole) == ("", "", ((0, "get_weather", {"city": "Lyon"}),))


def test_tool_parsing_off_leaves_the_markup_as_content(tokenizer):
    text = f"<tool_call>{CALL_LYON}</tool_call>"
    whole = merge_deltas(classify(tokenizer, [text], parse_tool_calls=False))
    assert without_ids(whole) == (text, "", ())


@pytest.mark.parametrize(
    "stop, expected",
    [
        ("cities", ("Let me check both ", THOUGHT + "\n", ())),
        ("wants", ("", "The user ", ())),
    ],
)
def test_stop_strings_end_the_text_in_every_state(tokenizer, stop, expected):
    assert without_ids(merge_deltas(classify(tokenizer, [REPLY], [stop]))) == expected


def test_a_stop_string_inside_a_call_leaves_it_unfinished(tokenizer):
    whole = merge_deltas(classify(tokenizer, [REPLY], ['"Lyon"']))
    unfinished = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    assert without_ids(whole) == (
        f"Let me check both cities.\n{unfinished}",
        THOUGHT + "\n",
        ((0, "get_weather", {"city": "Paris", "days": 2}),),
    )


BLOCKS = [
    "Hello there. ",
    "Ünïcödé ✓ 日本 ",
    f"<think>\n{THOUGHT}\n</think>\n\n",
    f"<tool_call>\n{CALL_PARIS}\n</tool_call>",
    f"<tool_call>{CALL_LYON}</tool_call>\n",
    '<tool_call>{"name": oops}</tool_call>',
    "a < b and <thin ",
    "</think>",
    "<tool_",
]


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    opened=st.booleans(),
)
def test_any_token_split_streams_what_the_whole_text_gives(
    tokenizer, blocks, cuts, opened
):
    text = "".join(blocks)
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    streamed = classify(tokenizer, pieces, reasoning_open=opened)
    whole = merge_deltas(classify(tokenizer, [text], reasoning_open=opened))
    assert without_ids(merge_deltas(streamed)) == without_ids(whole)
    # Markup never reaches content, except a call that failed to parse.
    content = whole.content.replace('<tool_call>{"name": oops}</tool_call>', "")
    assert "<think>" not in content and "</think>" not in content
    assert "</tool_call>" not in content


# -- end to end: a real server, the real weights, forced tokens ------------------


@pytest.fixture(scope="module")
def server(folders):
    srv = Server(forcing=True)
    yield srv
    srv.stop()


def load(server, folders, name: str) -> None:
    """Serve test model ``name`` with forced tokens; a load costs seconds, so the
    model already loaded stays."""
    if getattr(server, "test_model", None) == name:
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
    """Content, reasoning and calls (index, name, arguments) of proto ChatDeltas."""
    content = "".join(d.content for d in chat_deltas)
    reasoning = "".join(d.reasoning_content for d in chat_deltas)
    calls = tuple(
        (c.index, c.name, json.loads(c.arguments))
        for d in chat_deltas
        for c in d.tool_calls
    )
    return content, reasoning, calls


EXPECTED_REPLY = (
    "Let me check both cities.\n",
    THOUGHT + "\n",
    (
        (0, "get_weather", {"city": "Paris", "days": 2}),
        (1, "get_weather", {"city": "Lyon"}),
    ),
)


def test_predict_returns_one_classified_delta(server, folders, tokenizer):
    load(server, folders, "json")
    tokens = tokenizer.encode(REPLY)
    reply = server.stub.Predict(weather_chat(tokenizer, tokens))
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


def test_stream_carries_each_tokens_deltas(server, folders, tokenizer):
    load(server, folders, "json")
    text = f"<think>\nSunny?\n</think>\n\nHi!<tool_call>\n{CALL_LYON}\n</tool_call>"
    replies = list(server.stub.PredictStream(weather_chat(tokenizer, text)))
    seen = [
        (r.message.decode(), summary(r.chat_deltas))
        for r in replies
        if r.chat_deltas or r.message
    ]
    assert seen == [
        ("", ("", "Sun", ())),
        ("", ("", "ny", ())),
        ("", ("", "?", ())),
        ("", ("", "\n", ())),
        ("Hi", ("Hi", "", ())),
        ("!", ("!", "", ())),
        ("", ("", "", ((0, "get_weather", {"city": "Lyon"}),))),
    ]
    assert replies[-1].tokens == len(tokenizer.encode(text))
    assert replies[-1].prompt_tokens > 0


def test_any_split_streams_what_predict_returns(server, folders, tokenizer):
    load(server, folders, "json")
    rng = random.Random(5)
    requests = []
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(REPLY)), 12))
        pieces = [REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(REPLY)])]
        tokens = [t for p in pieces for t in tokenizer.encode(p)]
        requests.append(weather_chat(tokenizer, tokens))
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
    server, folders, tokenizer
):
    load(server, folders, "open")
    request = weather_chat(tokenizer, f"{THOUGHT}\n</think>\n\nIt is sunny.")
    prompt = server.stub.TokenizeString(request).tokens
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    reply = server.stub.Predict(request)
    assert summary(reply.chat_deltas) == ("It is sunny.", THOUGHT + "\n", ())
    # With thinking off the template closes it, and the reply is content.
    off = weather_chat(tokenizer, "It is sunny.", Metadata={"enable_thinking": "false"})
    assert summary(server.stub.Predict(off).chat_deltas) == ("It is sunny.", "", ())


def test_qwen3_coder_tool_calls(server, folders):
    load(server, folders, "coder")
    coder = load_tokenizer(folders["coder"])
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


def test_a_bad_tool_call_is_content_and_logged(server, folders, tokenizer):
    load(server, folders, "json")
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    reply = server.stub.Predict(weather_chat(tokenizer, "Hm. " + raw))
    assert summary(reply.chat_deltas) == ("Hm. " + raw, "", ())
    assert reply.message.decode() == "Hm. " + raw
    assert "could not parse a" in server.logs()


def test_tool_choice_none_offers_no_tools_and_parses_none(server, folders, tokenizer):
    load(server, folders, "json")
    text = f"<tool_call>{CALL_LYON}</tool_call>"
    offered = weather_chat(tokenizer, text)
    declined = weather_chat(tokenizer, text, ToolChoice='"none"')
    assert "get_weather" in tokenizer.decode(server.stub.TokenizeString(offered).tokens)
    assert "get_weather" not in tokenizer.decode(
        server.stub.TokenizeString(declined).tokens
    )
    assert summary(server.stub.Predict(declined).chat_deltas) == (text, "", ())
    auto = weather_chat(tokenizer, text, ToolChoice='"auto"')
    assert summary(server.stub.Predict(auto).chat_deltas)[2] == (
        (0, "get_weather", {"city": "Lyon"}),
    )


def test_stop_strings_and_eos_end_classified_text(server, folders, tokenizer):
    load(server, folders, "json")
    stopped = server.stub.Predict(
        weather_chat(tokenizer, REPLY, StopPrompts=["cities"])
    )
    assert summary(stopped.chat_deltas) == ("Let me check both ", THOUGHT + "\n", ())
    # The forced script ends with EOS: nothing follows the second call.
    assert server.stub.Predict(
        weather_chat(tokenizer, REPLY, Tokens=500)
    ).tokens == len(tokenizer.encode(REPLY))


def test_a_raw_prompt_keeps_its_raw_text(server, folders, tokenizer):
    load(server, folders, "json")
    request = pb.PredictOptions(
        Prompt="Weather?",
        Metadata={"forced_tokens": json.dumps(tokenizer.encode(REPLY))},
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


def test_a_raw_prompt_with_tools_is_classified(server, folders, tokenizer):
    load(server, folders, "json")
    tools = json.dumps([WEATHER_TOOL])
    request = forced_prompt(tokenizer, RENDERED, REPLY, Tools=tools)
    # ToolChoice none parses no calls: the markup stays text, the reasoning does not.
    text = f"<think>Hmm.</think><tool_call>\n{CALL_LYON}\n</tool_call>"
    unparsed = forced_prompt(tokenizer, RENDERED, text, Tools=tools, ToolChoice="none")
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
    server, folders, tokenizer
):
    load(server, folders, "json")
    opened = RENDERED + "<think>\n"
    reply = server.stub.Predict(
        forced_prompt(tokenizer, opened, f"{THOUGHT}\n</think>\n\nSunny.")
    )
    assert summary(reply.chat_deltas) == ("Sunny.", THOUGHT + "\n", ())
    assert reply.message.decode() == "Sunny."
    # After a closed think block, a completion without Tools stays raw text.
    closed = opened + "Hmm.\n</think>\n\n"
    text = "Sunny.<tool_call>"
    reply = server.stub.Predict(forced_prompt(tokenizer, closed, text))
    assert summary(reply.chat_deltas) == (text, "", ())


LYON_CALL = {"name": "get_weather", "arguments": '{"city": "Lyon"}'}


def test_tool_call_history_renders(server, folders, tokenizer):
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
    rendered = tokenizer.decode(server.stub.TokenizeString(request).tokens)
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
        "json_tools",
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
    )
    reply = server.stub.Predict(request)
    content, reasoning, calls = summary(reply.chat_deltas)
    assert (content, reasoning, reply.message) == ("", "", b"")
    ((index, name, arguments),) = calls
    assert (index, name) == (0, "get_weather")
    assert arguments in ({"city": "Paris"}, {"city": "Lyon"})
    streamed = list(server.stub.PredictStream(request))
    assert summary([d for r in streamed for d in r.chat_deltas])[2] == calls
