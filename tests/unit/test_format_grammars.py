"""Grammars that follow the chat format, checked token by token with llguidance on
each family's tokenizer (no model runs): a request's schema constrains the answer
after free reasoning, schemas hold only the keys they declare, and ToolChoice
"required" accepts exactly a call in the family's own framing that fits the
function, after any reasoning."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_backend.formats.grammars import (
    closing_texts,
    has_call_grammar,
    reasoning_prefix,
    tool_call_grammar,
)
from mlx_backend.grammar import GrammarCompiler, make_grammar_processor
from mlx_backend.output.detokenizer import make_token_bytes
from tests.unit.test_chat_formats import WEATHER_TOOL

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
)
THOUGHT = "Cities: Paris < Lyon? </thin no."
# Without additionalProperties, and an object inside.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    },
    "required": ["city"],
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


def accepts(compiled, tokenizer, *texts: str) -> bool:
    """Whether the grammar takes the texts' tokens, each text encoded alone."""
    matcher = compiled.matcher.deep_copy()
    for text in texts:
        for token in tokenizer.encode(text, add_special_tokens=False):
            if not matcher.consume_token(token):
                return False
    return matcher.is_accepting()


@pytest.fixture(scope="module")
def compilers(chat_models):
    made = {}

    def make(name):
        if name not in made:
            tokenizer, chat_format = chat_models(name)
            compiler = GrammarCompiler(
                tokenizer, make_token_bytes(tokenizer), len(tokenizer.vocab)
            )
            made[name] = tokenizer, chat_format, compiler
        return made[name]

    return make


GEMMA_THOUGHT = f"<|channel>thought\n{THOUGHT}<channel|>"


@pytest.mark.parametrize(
    "name, start, reply",
    [
        # <think> in text, optional; and a reply the template opened in it.
        ("json", "content", f'<think>\n{THOUGHT}\n</think>\n\n{{"city": "Paris"}}'),
        ("json", "content", '{"city": "Paris"}'),
        ("open", "reasoning", f'{THOUGHT}\n</think>\n\n{{"city": "Paris"}}'),
        ("deepseek_v3_1", "reasoning", f'{THOUGHT}</think>{{"city": "Paris"}}'),
        ("glm4_7", "reasoning", f'{THOUGHT}</think>{{"city": "Paris"}}'),
        ("minimax_m2", "reasoning", f'{THOUGHT}\n</think>\n\n{{"city": "Paris"}}'),
        ("kimi_k2", "content", f'<think>{THOUGHT}</think>{{"city": "Paris"}}'),
        # Harmony's analysis channel.
        (
            "gpt_oss",
            "header",
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
            '<|channel|>final<|message|>{"city": "Paris"}',
        ),
        # [THINK] special tokens; Command's and Granite's, the answer in their
        # response markers or not; Gemma 4's channel: a special token and text
        # ("<|channel>thought") open it.
        ("magistral", "content", f'[THINK]{THOUGHT}[/THINK]{{"city": "Paris"}}'),
        (
            "command_r7b",
            "content",
            f'<|START_THINKING|>{THOUGHT}<|END_THINKING|>{{"city": "Paris"}}',
        ),
        (
            "command_r7b",
            "content",
            f"<|START_THINKING|>{THOUGHT}<|END_THINKING|>"
            '<|START_RESPONSE|>{"city": "Paris"}<|END_RESPONSE|>',
        ),
        (
            "granite_3_3",
            "content",
            f'<think>{THOUGHT}</think><response>{{"city": "Paris"}}</response>',
        ),
        ("gemma4", "content", f'{GEMMA_THOUGHT}{{"city": "Paris"}}'),
        ("gemma4", "content", '{"city": "Paris"}'),
    ],
)
def test_a_schema_constrains_the_answer_after_free_reasoning(
    compilers, name, start, reply
):
    tokenizer, chat_format, compiler = compilers(name)
    prefix = reasoning_prefix(chat_format, start, compiler.specials)
    assert prefix
    compiled = compiler.compile(SCHEMA, prefix)
    assert accepts(compiled, tokenizer, reply)
    # The answer itself is still held to the schema.
    assert not accepts(compiled, tokenizer, reply.replace('"city"', '"town"'))
    assert not accepts(compiled, tokenizer, reply.replace("}", ', "zone": 1}'))


def test_gemma4s_reasoning_opens_with_its_special_token_not_text(compilers):
    tokenizer, chat_format, compiler = compilers("gemma4")
    prefix = reasoning_prefix(chat_format, "content", compiler.specials)
    channel = compiler.specials["<|channel>"]
    assert prefix.startswith(f'start: ((<[{channel}]> "thought")')
    compiled = compiler.compile(SCHEMA, prefix)
    # The marker spelled out in text tokens is not the marker.
    rest = 'channel>thought\nHm.<channel|>{"city": "Paris"}'
    assert accepts(compiled, tokenizer, "<|" + rest)
    assert not accepts(compiled, tokenizer, "<|", rest)


@pytest.mark.parametrize(
    "schema, reply, fits",
    [
        # No additionalProperties: the declared keys only, nested objects too.
        (OPEN_SCHEMA, '{"city": "Paris"}', True),
        (OPEN_SCHEMA, '{"city": "Paris", "zone": 1}', False),
        (OPEN_SCHEMA, '{"city": "Paris", "where": {"lat": 1}}', True),
        (OPEN_SCHEMA, '{"city": "Paris", "where": {"lat": 1, "x": 2}}', False),
        # Said in the schema, it stands.
        ({**OPEN_SCHEMA, "additionalProperties": True}, '{"city": "P", "z": 1}', True),
        # A required key the properties don't describe is declared, any value.
        ({**OPEN_SCHEMA, "required": ["city", "id"]}, '{"city": "P", "id": [1]}', True),
        ({**OPEN_SCHEMA, "required": ["city", "id"]}, '{"city": "P"}', False),
        # An object that declares no properties is any object (JSON mode).
        ({"type": "object"}, '{"anything": [1, 2]}', True),
        # Whitespace: a line break and indentation, but no endless run.
        (OPEN_SCHEMA, '{\n  "city": "Paris"\n}', True),
        (OPEN_SCHEMA, '{"city":      "Paris"}', False),
    ],
)
def test_grammar_schemas_hold_only_declared_keys_and_bounded_whitespace(
    compilers, schema, reply, fits
):
    tokenizer, _, compiler = compilers("json")
    assert accepts(compiler.compile(json.dumps(schema)), tokenizer, reply) is fits


def _json_args(args: dict) -> str:
    return json.dumps(args)


def _gemma_args(args: dict) -> str:
    quote = '<|"|>'
    return (
        "{"
        + ",".join(
            f"{k}:{quote}{v}{quote}" if isinstance(v, str) else f"{k}:{json.dumps(v)}"
            for k, v in args.items()
        )
        + "}"
    )


def _python_args(args: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())


def _raw(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# Each family's call of get_weather with the given arguments, as its model writes it.
CALLS = {
    "json": lambda a: '<tool_call>\n{"name": "get_weather", "arguments": '
    f"{_json_args(a)}}}\n</tool_call>",
    "llama3_3": lambda a: f'{{"name": "get_weather", "parameters": {_json_args(a)}}}',
    "mistral_small_3_2": lambda a: f"[TOOL_CALLS]get_weather[ARGS]{_json_args(a)}",
    "magistral": lambda a: f"[TOOL_CALLS]get_weather[ARGS]{_json_args(a)}",
    "deepseek_v3_1": lambda a: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
    f"<｜tool▁sep｜>{_json_args(a)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "gpt_oss": lambda a: "<|channel|>commentary to=functions.get_weather "
    f"<|constrain|>json<|message|>{_json_args(a)}",
    "phi_4_mini": lambda a: '<|tool_call|>[{"name": "get_weather", "arguments": '
    f"{_json_args(a)}}}]<|/tool_call|>",
    "granite_3_3": lambda a: '<|tool_call|>[{"name": "get_weather", "arguments": '
    f"{_json_args(a)}}}]",
    "command_r7b": lambda a: '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": '
    f'"get_weather", "parameters": {_json_args(a)}}}]<|END_ACTION|>',
    "llama4": lambda a: f"[get_weather({_python_args(a)})]",
    "lfm2": lambda a: f"<|tool_call_start|>[get_weather({_python_args(a)})]"
    "<|tool_call_end|>",
    "qwen3_coder": lambda a: "<tool_call>\n<function=get_weather>\n"
    + "".join(f"<parameter={k}>\n{_raw(v)}\n</parameter>\n" for k, v in a.items())
    + "</function>\n</tool_call>",
    "glm4_7": lambda a: "<tool_call>get_weather"
    + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{_raw(v)}</arg_value>" for k, v in a.items()
    )
    + "</tool_call>",
    "minimax_m2": lambda a: '<minimax:tool_call>\n<invoke name="get_weather">\n'
    + "".join(f'<parameter name="{k}">{_raw(v)}</parameter>\n' for k, v in a.items())
    + "</invoke>\n</minimax:tool_call>",
    "kimi_k2": lambda a: "<|tool_calls_section_begin|><|tool_call_begin|>"
    f"functions.get_weather:0<|tool_call_argument_begin|>{_json_args(a)}"
    "<|tool_call_end|><|tool_calls_section_end|>",
    "gemma4": lambda a: f"<|tool_call>call:get_weather{_gemma_args(a)}<tool_call|>",
}
# What a reasoning family's reply thinks first, where the prompt does not open it.
THINKING = {
    "json": f"<think>\n{THOUGHT}\n</think>\n\n",
    "magistral": f"[THINK]{THOUGHT}[/THINK]",
    "command_r7b": f"<|START_THINKING|>{THOUGHT}<|END_THINKING|>",
    "gpt_oss": f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant",
    "kimi_k2": f"<think>{THOUGHT}</think>",
    "glm4_7": f"<think>{THOUGHT}</think>",
    "minimax_m2": f"<think>{THOUGHT}</think>\n\n",
    "gemma4": GEMMA_THOUGHT,
}


def required_call_grammar(compilers, name, tools=(WEATHER_TOOL,), function=None):
    tokenizer, chat_format, compiler = compilers(name)
    start = "header" if chat_format.channels else "content"
    lark = tool_call_grammar(
        chat_format, list(tools), function, start, compiler.specials
    )
    assert lark is not None and has_call_grammar(chat_format)
    return tokenizer, compiler.compile(lark, lark=True)


@pytest.mark.parametrize("name", CALLS)
def test_a_required_call_is_the_familys_framing_and_fits_the_function(compilers, name):
    tokenizer, compiled = required_call_grammar(compilers, name)
    call = CALLS[name]
    assert accepts(compiled, tokenizer, call({"city": "Paris"}))
    assert accepts(compiled, tokenizer, call({"city": "Paris", "days": 2}))
    # An unknown key, a wrong type, a missing required key, another tool, text.
    assert not accepts(compiled, tokenizer, call({"city": "Paris", "zone": "UTC"}))
    assert not accepts(compiled, tokenizer, call({"city": "Paris", "days": "two"}))
    assert not accepts(compiled, tokenizer, call({"days": 2}))
    assert not accepts(
        compiled, tokenizer, call({"city": "Paris"}).replace("get_weather", "get_time")
    )
    assert not accepts(compiled, tokenizer, "It is sunny.")
    if name in THINKING:
        # A reasoning model may think before it calls.
        assert accepts(compiled, tokenizer, THINKING[name] + call({"city": "Lyon"}))


@pytest.mark.parametrize("name", ["json", "qwen3_coder", "gemma4", "lfm2"])
def test_a_named_function_is_the_only_call_allowed(compilers, name):
    tokenizer, compiled = required_call_grammar(
        compilers, name, (WEATHER_TOOL, TIME_TOOL), "get_time"
    )
    call = CALLS[name]({"zone": "UTC"}).replace("get_weather", "get_time")
    assert accepts(compiled, tokenizer, call)
    assert not accepts(compiled, tokenizer, CALLS[name]({"city": "Paris"}))
    assert not accepts(compiled, tokenizer, call.replace("UTC", "PST"))


# A tool that declares no parameters takes any keys; one that forbids them, none.
FREE_TOOL = {"type": "function", "function": {"name": "note", "parameters": {}}}
CLOSED_TOOL = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {
            "type": "object",
            "properties": {},
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("name", ["json", "lfm2", "qwen3_coder", "gemma4", "glm4_7"])
def test_a_tool_without_declared_parameters_takes_any_keys(compilers, name):
    tokenizer, compiled = required_call_grammar(compilers, name, (FREE_TOOL,))
    call = CALLS[name]
    for args in ({}, {"text": "milk"}, {"text": "milk", "count": 2}):
        assert accepts(
            compiled, tokenizer, call(args).replace("get_weather", "note")
        ), args
    tokenizer, compiled = required_call_grammar(compilers, name, (CLOSED_TOOL,))
    assert accepts(compiled, tokenizer, call({}).replace("get_weather", "ping"))
    assert not accepts(
        compiled, tokenizer, call({"text": "milk"}).replace("get_weather", "ping")
    )


def write_until_closed(compiled, tokenizer, text: str, limit: int) -> tuple[str, int]:
    """What a "model" that keeps writing ``text`` gets under ``compiled`` with
    ``limit`` tokens: the reply, and where the grammar first overrode it."""
    vocab = len(tokenizer.vocab)
    _, process = make_grammar_processor(compiled, tokenizer.eos_token_ids, vocab, limit)
    wanted = tokenizer.encode(text, add_special_tokens=False)
    logits, history, generated, overridden = mx.zeros((1, vocab)), [1], [], None
    for token in wanted:
        row = np.array(process(mx.array(history), logits))[0]
        finite = set(np.flatnonzero(np.isfinite(row)).tolist())
        if token not in finite:
            assert len(finite) == 1
            (token,) = finite
            overridden = len(generated) if overridden is None else overridden
        if token in tokenizer.eos_token_ids:
            return tokenizer.decode(generated), overridden
        generated.append(token)
        history.append(token)
    raise AssertionError(f"the grammar never closed: {tokenizer.decode(generated)!r}")


ENDLESS = " and so on" * 40


@pytest.mark.parametrize(
    "name, start, text, answer",
    [
        # Reasoning that never ends is closed, then the answer is written.
        ("json", "content", f"<think>\nHm{ENDLESS}", '{"city": ""}'),
        ("gemma4", "content", f"<|channel>thought\nHm{ENDLESS}", '{"city": ""}'),
        ("open", "reasoning", f"Hm{ENDLESS}", '{"city": ""}'),
    ],
)
def test_reasoning_that_runs_on_is_closed_and_answered_in_time(
    compilers, name, start, text, answer
):
    tokenizer, chat_format, compiler = compilers(name)
    prefix = reasoning_prefix(chat_format, start, compiler.specials)
    compiled = compiler.compile(SCHEMA, prefix, closers=closing_texts(chat_format))
    reply, overridden = write_until_closed(compiled, tokenizer, text, 40)
    assert overridden >= 24
    end = chat_format.reasoning.end
    thought, rest = reply.split(end) if end in reply else ("", reply)
    assert json.loads(rest) == json.loads(answer)


@pytest.mark.parametrize("name", ["json", "qwen3_coder", "glm4_7", "gemma4", "lfm2"])
def test_a_forced_call_whose_value_runs_on_closes_in_time(compilers, name):
    tokenizer, chat_format, compiler = compilers(name)
    lark = tool_call_grammar(
        chat_format, [WEATHER_TOOL], None, "answer", compiler.specials
    )
    compiled = compiler.compile(lark, lark=True, closers=closing_texts(chat_format))
    call = CALLS[name]({"city": "Paris" + ENDLESS})
    cut = call[: call.index(" and so on") + 30]
    reply, overridden = write_until_closed(compiled, tokenizer, cut + ENDLESS, 48)
    assert overridden is not None
    # The reply is a whole call of the tool: its framing closes it.
    assert accepts(compiled, tokenizer, reply)
    assert "Paris and so on" in reply
