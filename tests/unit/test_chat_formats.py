"""Every chat format the registry knows, on each family's real chat template and
marker tokens (tests/chat_models.py ``FAMILIES``): the format chosen, the prompt's
end read right, and the family's exact reply classified the same token by token
as whole, with no marker left in the text. No model runs."""

import json

import pytest

import backend_pb2 as pb
from mlx_backend.output.chat_output import (
    Delta,
    OutputOptions,
    OutputParser,
    find_reply_start,
    merge_deltas,
)
from mlx_backend.output.detokenizer import TokenBytes
from mlx_backend.output.reply_pipeline import ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest, adapt_messages
from python_utils import TemplateArgs, convert_messages, render_chat
from tests.chat_models import FAMILIES, PARIS

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CASES = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name, family in FAMILIES.items()
    for i in range(len(family.replies))
]


@pytest.fixture(scope="module")
def loaded(chat_models):
    """Each family's tokenizer, with the format's end tokens, and chat format."""

    def load(name):
        tokenizer, chat_format = chat_models(name)
        assert set(chat_format.end_tokens) <= set(
            tokenizer.convert_ids_to_tokens(list(tokenizer.eos_token_ids))
        )
        return tokenizer, chat_format

    return load


def render(tokenizer, chat_format, messages, **kwargs) -> list[int]:
    tools = [WEATHER_TOOL]
    messages = adapt_messages(messages, tools, chat_format)
    return render_chat(tokenizer, messages, TemplateArgs(tools=tools, extra=kwargs))


def reply_options(tokenizer, chat_format, prompt) -> OutputOptions:
    start = find_reply_start(chat_format, tokenizer.decode(prompt[-32:]))
    return OutputOptions(classify=True, start=start, tools=[WEATHER_TOOL])


def classify(tokenizer, chat_format, prompt, tokens) -> list[Delta]:
    """The reply's deltas token by token, through the engine's reply pipeline."""
    options = reply_options(tokenizer, chat_format, prompt)
    request = GenerationRequest(
        prompt=tuple(prompt), max_tokens=len(tokens) + 1, output=options
    )
    reply = ReplyPipeline(request, tokenizer, chat_format, TokenBytes(()))
    deltas = []
    for token in tokens:
        event = reply.add(token)
        deltas.append(event.delta if event else Delta())
        if reply.finished:
            return deltas
    deltas.append(reply.finish("stop").delta)
    return deltas


def classify_at_once(tokenizer, chat_format, prompt, tokens) -> Delta:
    """The reply's whole text parsed in one piece."""
    options = reply_options(tokenizer, chat_format, prompt)
    parser = OutputParser(chat_format, (), options)
    delta, _ = parser.feed(tokenizer.decode(tokens))
    return merge_deltas([delta, parser.finish()])


def summary(delta: Delta) -> tuple:
    calls = tuple((c.name, c.arguments) for c in delta.tool_calls)
    assert [c.index for c in delta.tool_calls] == list(range(len(calls)))
    return delta.content, delta.reasoning, calls


@pytest.mark.parametrize("name", FAMILIES)
def test_the_registry_chooses_the_familys_format(loaded, name):
    _, chat_format = loaded(name)
    assert chat_format.name == FAMILIES[name].format


@pytest.mark.parametrize("name, i", CASES)
def test_the_familys_reply_is_classified_exactly(loaded, name, i):
    tokenizer, chat_format = loaded(name)
    expected = FAMILIES[name].replies[i]
    messages = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    prompt = render(tokenizer, chat_format, messages, **expected.kwargs)
    tokens = tokenizer.encode(expected.text, add_special_tokens=False)
    eos = [t for t in tokens if t in tokenizer.eos_token_ids]
    tokens = tokens[: tokens.index(eos[0])] if eos else tokens
    streamed = classify(tokenizer, chat_format, prompt, tokens)
    whole = merge_deltas(streamed)
    assert summary(whole) == (expected.content, expected.reasoning, expected.calls)
    # The stream ends the same as the whole text parsed at once.
    at_once = classify_at_once(tokenizer, chat_format, prompt, tokens)
    assert summary(at_once) == summary(whole)
    markers = [m for m in FAMILIES[name].tokens if m in expected.text]
    for delta in streamed:
        for marker in markers:
            assert marker not in delta.content and marker not in delta.reasoning
    # A call's name comes first and alone; its arguments follow in chunks.
    for call in whole.tool_calls:
        chunks = [c for d in streamed for c in d.tool_calls if c.index == call.index]
        assert chunks[0].name == call.name and chunks[0].id
        assert all(not c.name and not c.id for c in chunks[1:])


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_round_trip_renders_and_the_prompt_ends_where_the_reply_starts(
    loaded, name
):
    tokenizer, chat_format = loaded(name)
    call_id = "a1B2c3D4e"  # Mistral's templates take nine alphanumerics only
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": PARIS[0], "arguments": PARIS[1]},
    }
    messages = convert_messages(
        [
            pb.Message(role="user", content="Weather in Paris?"),
            pb.Message(role="assistant", content="", tool_calls=json.dumps([call])),
            pb.Message(role="tool", content="Sunny, 24C", tool_call_id=call_id),
        ]
    )
    prompt = tokenizer.decode(render(tokenizer, chat_format, messages))
    assert "Sunny, 24C" in prompt
    rendered = FAMILIES[name].rendered_argument
    if rendered is not None:
        assert rendered in prompt and PARIS[0] in prompt
    # The model's turn starts in content (or a harmony header, or thinking the
    # template opened), not in a call.
    start = find_reply_start(chat_format, prompt[-200:])
    assert start.state in ("content", "header", "reasoning")
