"""Hostile values for the fuzz tests (tests/e2e/test_fuzz.py): the named ones
and Hypothesis strategies for text (odd unicode, chat-template markup, prompts over
the context), JSON (deep, odd, random; tools, tool choices, tool calls, chat
template kwargs, metadata), grammars, logit biases, numbers and token ids."""

import json
import math

from hypothesis import strategies as st

# SmolLM2's vocabulary; token ids probe both of its edges.
VOCAB_SIZE = 49152

# -- text -----------------------------------------------------------------------------

# Text the tokenizer, the chat template or a parser may trip on.
ODD_TEXT = [
    "",
    " ",
    "\x00",
    "\x00" * 64,
    "\r\n\t\x0b\x0c\x1b[31m\x7f",
    "\u202e\u200b\ufeff\u2028",
    "e\u0301" * 8,
    "🙂👩‍👩‍👧\U0010ffff",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "{{ raise_exception('boom') }}",
    "{% if %}",
    "\\",
    '"',
    "%s%n",
]
# Each is over the model's 8192-token context, so it is refused before any prefill.
LONG_TEXT = ["hello " * 9000, "\x00" * 20000, "x" * 40000, "東京" * 6000]

short_texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT))
texts = st.one_of(short_texts, st.sampled_from(LONG_TEXT))

# -- JSON -----------------------------------------------------------------------------

DEEP_JSON = [
    "[" * 5000,
    '{"1":' * 3000,
    "[" * 500 + "]" * 500,
    '{"a":' * 300 + "1" + "}" * 300,
    "[" * 101 + "]" * 101,
    "[" * 100 + "]" * 100,
]
ODD_JSON = [
    "null",
    "[]",
    "{}",
    "[null]",
    "[1, 2]",
    '"none"',
    "NaN",
    "-Infinity",
    "1e999",
    "[1",
    "{1: 2}",
    "{'a': 1}",
    '{"a": 1} trailing',
    "\ufeff{}",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
json_texts = st.one_of(
    st.sampled_from(DEEP_JSON),
    st.sampled_from(ODD_JSON),
    json_values.map(json.dumps),
    short_texts,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
tools_texts = st.one_of(
    json_texts,
    st.sampled_from(
        [
            json.dumps([TOOL]),
            '[{"type": "function"}]',
            '[{"function": 1}]',
            '[{"type": "function", "function": {"name": null}}]',
        ]
    ),
    st.lists(json_values, max_size=3).map(json.dumps),
)
tool_choices = st.one_of(
    json_texts,
    st.sampled_from(
        ["none", "auto", "required", '"none"', '{"function": {"name": "weather"}}']
    ),
)
# A message's tool_calls: arguments are JSON text inside JSON, parsed a second time.
tool_calls_texts = st.one_of(
    json_texts,
    st.fixed_dictionaries(
        {
            "id": short_texts,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": short_texts, "arguments": json_texts | json_values}
            ),
        }
    ).map(lambda tool_call: json.dumps([tool_call])),
)

# chat_template_kwargs go to apply_chat_template beside its own arguments.
TEMPLATE_KWARGS = [
    '{"return_dict": true}',
    '{"tokenize": false}',
    '{"messages": []}',
    '{"tools": 1}',
    '{"add_generation_prompt": false}',
    '{"continue_final_message": true}',
    '{"return_tensors": "np"}',
    '{"enable_thinking": "maybe"}',
    '{"chat_template": "{{ 1 / 0 }}"}',
    '{"truncation": true, "max_length": 1}',
]
# A request must not swap the model's chat template: this one loops 10**10 times.
ENDLESS_TEMPLATE = json.dumps(
    {
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}"
    }
)
metadata = st.dictionaries(
    st.one_of(
        st.sampled_from(
            [
                "chat_template_kwargs",
                "enable_thinking",
                "reasoning_effort",
                "forced_tokens",
            ]
        ),
        short_texts,
    ),
    st.one_of(
        json_texts,
        st.sampled_from(TEMPLATE_KWARGS),
        st.sampled_from(["true", "false", "yes", "2"]),
    ),
    max_size=3,
)

# -- grammars and logit bias ----------------------------------------------------------

GRAMMARS = [
    "json",
    " json ",
    "JSON",
    'root ::= "yes"',
    "root ::= root",
    'root ::= "a" root',
    "root ::= [",
    "root ::= x",
    'start: "a"',
    "%llguidance {}\nstart: /(a|b)*/",
    "[1, 2]",
    "1",
    '"s"',
    "null",
    "{}",
    '{"type": "string", "maxLength": 3}',
    '{"type": "integer", "minimum": 5, "maximum": 1}',
    '{"$ref": "#"}',
    '{"type": "string", "pattern": "(a"}',
    '{"type": "array", "minItems": 1000000}',
    '{"enum": []}',
    '{"type": "nope"}',
]
# GBNF-ish text: its punctuation, shuffled.
gbnf_texts = st.text(alphabet='root:=|()[]*+?"\\ -a^\n.{}0123456789', max_size=40)
grammar_texts = st.one_of(
    st.sampled_from(GRAMMARS),
    st.sampled_from(DEEP_JSON),
    gbnf_texts,
    gbnf_texts.map(lambda body: "root ::= " + body),
    json_texts,
)

LOGIT_BIASES = [
    '{"0": 100}',
    '{"2": -100}',
    '{"-1": 1}',
    f'{{"{VOCAB_SIZE}": 1}}',
    '{"99999999999999999999": 1}',
    '{"1": 1e400}',
    '{"1": NaN}',
    '{"1": -Infinity}',
    '{"1": 1e300}',
    '{"1": 3.4e38, "2": 3.4e38}',
    '{"1": true}',
    '{"1": "5"}',
    '{"1": [1]}',
    '{"1e3": 1}',
    '{" 7 ": 1}',
    '{"٣": 1}',
]
logit_biases = st.one_of(
    st.sampled_from(LOGIT_BIASES),
    json_texts,
    st.dictionaries(
        st.integers(-5, VOCAB_SIZE + 5).map(str), st.floats(), max_size=4
    ).map(json.dumps),
)

# -- numbers and token ids ------------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, -2.0, -1e-45, 1e30, -1e30, 3.4e38]
hostile_floats = st.one_of(st.sampled_from(HOSTILE_FLOATS), st.floats(width=32))
hostile_ints = st.one_of(
    st.sampled_from([-(2**31), -1, 0, 2**31 - 1, 21, VOCAB_SIZE]), INT32
)
token_ids = st.one_of(
    st.integers(0, VOCAB_SIZE - 1),
    st.sampled_from([-1, VOCAB_SIZE, -(2**31), 2**31 - 1]),
    INT32,
)
embedding_tokens = st.one_of(
    st.lists(token_ids, max_size=32),
    st.just([0] * 9000),  # over the context: refused before any compute
)
