"""Structured output: reasoning and tool calls classified while tokens stream,
through the engine's reply pipeline with the real tokenizer's streaming detokenizer.

The ``json`` chat folder's tokenizer is the default model's with four unused
special tokens renamed to ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` and a Qwen-style chat template, so mlx-lm detects the markers and
the tool parser as it would for a Qwen model (conftest's ``folders`` and
``chat_models``). No model runs: the parser is fed the tokens of given text.
"""

import json
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.registry import make_chat_format
from mlx_backend.output.chat_output import (
    Delta,
    OutputOptions,
    ReplyStart,
    merge_deltas,
)
from mlx_backend.output.detokenizer import TokenBytes
from mlx_backend.output.reply_pipeline import ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest
from python_utils import parse_options
from tests.chat_models import CALL_LYON, CALL_PARIS, REPLY, THOUGHT

# -- the parser, fed by the real tokenizer's streaming detokenizer -----------------


@pytest.fixture(scope="module")
def json_chat(chat_models):
    """The ``json`` chat model's shared tokenizer and chat format."""
    return chat_models("json")


def classify(chat, pieces: list[str], stops=(), opened=False, **options) -> list[Delta]:
    """Deltas for a reply generated as the tokens of each piece in turn, through the
    engine's reply pipeline (``chat``: a tokenizer and its chat format): one per
    token, then the held-back rest."""
    tokenizer, chat_format = chat
    tokens = [t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False)]
    if opened:
        options["start"] = ReplyStart("reasoning")
    request = GenerationRequest(
        prompt=(),
        max_tokens=len(tokens) + 1,
        stop=tuple(stops),
        ignore_eos=True,
        output=OutputOptions(classify=True, **options),
    )
    # No logprobs are asked for, so no token bytes are needed.
    reply = ReplyPipeline(request, tokenizer, chat_format, TokenBytes(()))
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


def test_the_format_comes_from_the_template_and_the_vocabulary(
    chat_models, chat_tokenizer
):
    chat_format = make_chat_format(chat_tokenizer, {})
    assert (chat_format.reasoning.start, chat_format.reasoning.end) == (
        "<think>",
        "</think>",
    )
    assert (chat_format.tools.start, chat_format.tools.end) == (
        "<tool_call>",
        "</tool_call>",
    )
    assert chat_format.name == "json+<think>"
    assert chat_format.detected_by == "tool calls by mlx-lm, reasoning by mlx-lm"
    coder = make_chat_format(chat_models("coder")[0], {})
    assert coder.tools.name == "qwen3_coder"


def test_the_tool_parser_option_replaces_the_detected_framing(chat_models):
    coder = chat_models("coder")[0]
    options = parse_options(["tool_parser:hermes", "reasoning:none"])
    hermes = make_chat_format(coder, {}, options.tool_parser, options.reasoning)
    assert (hermes.tools.start, hermes.tools.end, hermes.tools.name) == (
        "<tool_call>",
        "</tool_call>",
        "json",
    )
    assert hermes.reasoning is None
    assert hermes.detected_by == "tool calls by option, reasoning by option"
    assert make_chat_format(coder, {}, "pythonic").tools.name == "pythonic"
    with pytest.raises(
        InvalidArgument,
        match=r"^Options: tool_parser must be one of json, llama3_json, .*harmony, "
        r"none, .*pythonic, .*not 'vllm'$",
    ):
        parse_options(["tool_parser:vllm"])
    with pytest.raises(
        InvalidArgument,
        match=r"^Options: reasoning must be one of think, mistral, command, harmony, "
        r"none, not 'deep'$",
    ):
        parse_options(["reasoning:deep"])


def test_reasoning_content_and_two_tool_calls(json_chat):
    whole = merge_deltas(classify(json_chat, [REPLY]))
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


def test_a_call_streams_its_name_then_its_arguments(json_chat):
    pieces = ["<tool_call>\n", '{"name": "get_weather", "arguments": ']
    pieces += ['{"city": ', '"Lyon"}}\n', "</tool_call>", "ok"]
    deltas = classify(json_chat, pieces)
    calls = [(c.index, c.name, c.arguments) for d in deltas for c in d.tool_calls]
    # The name goes out once the arguments open; then each token's part of them.
    assert calls[0][:2] == (0, "get_weather") and calls[0][2].startswith("{")
    assert all(index == 0 and not name for index, name, _ in calls[1:])
    assert "".join(arguments for _, _, arguments in calls) == '{"city": "Lyon"}'
    assert len(calls) > 3
    assert merge_deltas(deltas).content == "ok"
    (whole,) = merge_deltas(deltas).tool_calls
    assert (whole.name, whole.arguments) == ("get_weather", '{"city": "Lyon"}')


@pytest.mark.parametrize("marker", ["<think>", "</think>", "<tool_call>"])
def test_a_marker_split_into_characters_never_leaks(json_chat, marker):
    # Each character its own token: the marker is held back until resolved.
    pieces = ["Hi "] + list("<think>") + ["hmm"] + list("</think>") + ["Done"]
    if marker == "<tool_call>":
        pieces = ["Hi "] + list(f"<tool_call>{CALL_LYON}</tool_call>") + ["Done"]
    deltas = classify(json_chat, pieces)
    assert all("<" not in d.content for d in deltas)
    whole = merge_deltas(deltas)
    assert whole.content == "Hi Done"


def test_a_partial_marker_that_never_completes_is_text(json_chat):
    whole = merge_deltas(classify(json_chat, ["a <thin", "g> b <tool_c"]))
    assert without_ids(whole) == ("a <thing> b <tool_c", "", ())


def test_a_reply_that_opens_inside_thinking(json_chat):
    whole = merge_deltas(
        classify(json_chat, [THOUGHT, "</think>\n\nSunny."], opened=True)
    )
    assert without_ids(whole) == ("Sunny.", THOUGHT, ())


def test_a_lone_closing_marker_is_stripped(json_chat):
    whole = merge_deltas(classify(json_chat, ["Sure.</think> Sunny."]))
    assert whole.content == "Sure. Sunny."


def test_a_bad_tool_call_comes_back_as_content(json_chat, caplog):
    raw = '<tool_call>\n{"name": "get_weather", "arguments": [1, 2}\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="mlx_backend"):
        whole = merge_deltas(classify(json_chat, ["Hmm. ", raw, " Sorry."]))
    assert without_ids(whole) == (f"Hmm. {raw} Sorry.", "", ())
    assert "a tool call could not be read (the arguments are not a JSON object)" in (
        caplog.text
    )


def test_an_unfinished_tool_call_is_parsed_at_the_end(json_chat):
    whole = merge_deltas(classify(json_chat, [f"<tool_call>\n{CALL_LYON}\n"]))
    assert without_ids(whole) == ("", "", ((0, "get_weather", {"city": "Lyon"}),))


def test_tool_parsing_off_leaves_the_markup_as_content(json_chat):
    text = f"<tool_call>{CALL_LYON}</tool_call>"
    whole = merge_deltas(classify(json_chat, [text], parse_tool_calls=False))
    assert without_ids(whole) == (text, "", ())


@pytest.mark.parametrize(
    "stop, expected",
    [
        ("cities", ("Let me check both ", THOUGHT + "\n", ())),
        ("wants", ("", "The user ", ())),
    ],
)
def test_stop_strings_end_the_text_in_every_state(json_chat, stop, expected):
    assert without_ids(merge_deltas(classify(json_chat, [REPLY], [stop]))) == expected


def test_a_stop_string_inside_a_call_leaves_it_unfinished(json_chat, caplog):
    with caplog.at_level(logging.WARNING, logger="mlx_backend"):
        whole = merge_deltas(classify(json_chat, [REPLY], ['"Lyon"']))
    # The second call's name and the start of its arguments had gone out.
    assert (whole.content, whole.reasoning) == (
        "Let me check both cities.\n",
        THOUGHT + "\n",
    )
    calls = [(c.index, c.name, c.arguments) for c in whole.tool_calls]
    assert calls == [
        (0, "get_weather", '{"city": "Paris", "days": 2}'),
        (1, "get_weather", '{"city": '),
    ]
    assert "a tool call could not be read (the call is cut short)" in caplog.text


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
    json_chat, blocks, cuts, opened
):
    text = "".join(blocks)
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    streamed = classify(json_chat, pieces, opened=opened)
    whole = merge_deltas(classify(json_chat, [text], opened=opened))
    assert without_ids(merge_deltas(streamed)) == without_ids(whole)
    # Markup never reaches content, except a call that failed to parse.
    content = whole.content.replace('<tool_call>{"name": oops}</tool_call>', "")
    assert "<think>" not in content and "</think>" not in content
    assert "</tool_call>" not in content
