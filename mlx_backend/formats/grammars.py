"""Grammars that follow a chat format: free reasoning before a constrained answer,
and calls of the offered tools in the family's own framing (ToolChoice
"required" or a named function).

Both are llguidance Lark, derived from the format's own description (its
``Reasoning``, ``Channels`` and ``ToolFraming``). A marker's special tokens are
named by id (``<[200005]>``), the rest of it is quoted text. A call's arguments
hold the keys the tool declares and no other (``schemas.strict_schema``).
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mlx_backend.formats.base import Channels, ChatFormat, ToolFraming, tool_names
from mlx_backend.formats.registry import (
    DEEPSEEK_SECTION,
    DEEPSEEK_SEPARATOR,
    MISTRAL_SEPARATOR,
    RESPONSE_MARKERS,
)
from mlx_backend.schemas import strict_schema

# The rule a reasoning grammar hands the answer to: the request's own grammar.
ANSWER = "answer"
# Whitespace between a format's markers and what they hold: a few characters.
GAP = r"/[ \t\r\n]{0,4}/"
# Gemma 4's string delimiter.
GEMMA_QUOTE = '<|"|>'
# Keywords of a schema whose value is no plain string.
COMPOUND = {"properties", "items", "anyOf", "oneOf", "allOf", "$ref"}
# Any argument name, where a tool declares none.
KEY = "/[A-Za-z_][A-Za-z0-9_]*/"
# Characters written escaped inside a Lark /regex/.
_ESCAPED = {
    **{c: f"\\{c}" for c in r"\.^$|?*+()[]{}/-"},
    **{"\n": r"\n", "\r": r"\r", "\t": r"\t"},
}


class Lark:
    """One grammar's rules as they are made: markers, free text up to a marker,
    JSON values; each helper returns the expression that matches it."""

    def __init__(self, specials: Mapping[str, int]):
        self.specials = specials
        self.rules: dict[str, str] = {}
        self._free: dict[str, str] = {}

    def rule(self, kind: str, body: str) -> str:
        name = f"{kind}{len(self.rules)}"
        self.rules[name] = body
        return name

    def marker(self, text: str) -> str:
        if not text:
            return '""'
        pieces = [
            f"<[{self.specials[p]}]>" if special else json.dumps(p)
            for p, special in _pieces(text, self.specials)
        ]
        return pieces[0] if len(pieces) == 1 else f"({' '.join(pieces)})"

    def text_until(self, end: str) -> str:
        """Any text, then ``end``: special tokens never occur in text, so the
        text stops at one; a text marker stops it explicitly."""
        if end not in self._free:
            pieces = _pieces(end, self.specials)
            if pieces[0][1]:
                self.rules.setdefault("TEXT", "/(?s:.*)/")
                self._free[end] = f"TEXT {self.marker(end)}"
            else:
                # A lazy lexeme ends at the marker's first occurrence, and the
                # token that completes it may go on into what follows.
                text = pieces[0][0]
                name = f"free{len(self.rules)}"
                self.rules[f"{name}[lazy]"] = f"/(?s:.*){_regex(text)}/"
                rest = end[len(text) :]
                self._free[end] = name + (f" {self.marker(rest)}" if rest else "")
        return self._free[end]

    def json(self, schema: dict) -> str:
        return self.rule("json", f"%json {json.dumps(strict_schema(schema))}")

    def render(self, start: str) -> str:
        lines = [f"start: {start}"]
        lines += [f"{name}: {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


def _regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join(_ESCAPED.get(c) or c for c in text)


def _pieces(text: str, specials: Mapping[str, int]) -> list[tuple[str, bool]]:
    """``text`` split into special tokens (longest first) and the text between."""
    inside = sorted((s for s in specials if s and s in text), key=len, reverse=True)
    pieces, plain, at = [], 0, 0
    while at < len(text):
        hit = next((s for s in inside if text.startswith(s, at)), None)
        if hit is None:
            at += 1
            continue
        if plain < at:
            pieces.append((text[plain:at], False))
        pieces.append((hit, True))
        at = plain = at + len(hit)
    if plain < len(text):
        pieces.append((text[plain:], False))
    return pieces


def _analysis(lark: Lark, channels: Channels) -> str:
    """Harmony's analysis message up to the next assistant header."""
    m = lark.marker
    return (
        f'{m(channels.channel)} "analysis" {m(channels.message)} '
        f'{lark.text_until(channels.ends[0])} {m(channels.starts[0])} "assistant"'
    )


def _reasoning(lark: Lark, chat_format: ChatFormat, start: str) -> str | None:
    """The reasoning a reply may open with (optional) or must finish, then the
    answer; None when the format has no reasoning or the reply can't start it
    (``start`` "answer": the prompt closed it)."""
    if start == "answer":
        return None
    channels = chat_format.channels
    if channels is not None:
        if start != "header":
            return None
        m = lark.marker
        final = f'{m(channels.channel)} "final" {m(channels.message)}'
        return f"({_analysis(lark, channels)})? {final}"
    reasoning = chat_format.reasoning
    if reasoning is None:
        return None
    think = f"{lark.text_until(reasoning.end)} {GAP}"
    if start == "reasoning":
        return think
    return f"({lark.marker(reasoning.start)} {think})?"


def reasoning_prefix(
    chat_format: ChatFormat, start: str, specials: Mapping[str, int]
) -> str:
    """Lark rules for a reply that may reason freely, then ``@answer``; "" when the
    format has no reasoning or the reply can't start it."""
    lark = Lark(specials)
    head = _reasoning(lark, chat_format, start)
    if head is None:
        return ""
    answer = f"@{ANSWER}"
    framing = chat_format.tools
    if framing is not None and framing.name in RESPONSE_MARKERS:
        # Command and Granite may wrap the answer in their response markers.
        opening, closing = map(lark.marker, RESPONSE_MARKERS[framing.name])
        answer = f"({opening})? {answer} ({closing})?"
    return lark.render(f"{head} {answer}")


def _parameters(tool: dict) -> dict:
    function = tool.get("function", tool)
    schema = function.get("parameters") or {"type": "object"}
    return schema if isinstance(schema, dict) else {"type": "object"}


def _chosen(tools: list, name: str | None) -> list[tuple[str, dict]]:
    """(name, arguments schema) of each tool the call may be, in order."""
    chosen = []
    for tool in tools:
        (tool_name,) = tool_names([tool]) or ("",)
        if tool_name and name in (None, tool_name):
            chosen.append((tool_name, _parameters(tool)))
    return chosen


@dataclass(frozen=True)
class CallSyntax:
    """How a framing writes one call: ``write(grammar, framing, (name, schema)
    each)`` gives its Lark; ``closers`` end its free values (as text)."""

    write: Callable[[Lark, ToolFraming | None, list[tuple[str, dict]]], str]
    closers: tuple[str, ...] = ()


def _json_calls(
    name_key: str = "name",
    args_key: str = "arguments",
    marked: bool = False,
    listed: bool = False,
    padding: str = "",
    with_id: bool = False,
) -> CallSyntax:
    """A call as one JSON object, bare or between the framing's markers (with
    ``padding`` inside them), alone or in a list; ``with_id``: Command's id."""

    def syntax(lark, framing, chosen):
        extra = {"tool_call_id": {"type": "string"}} if with_id else {}
        variants = [
            {
                "type": "object",
                "properties": {**extra, name_key: {"const": name}, args_key: schema},
                "required": [*extra, name_key, args_key],
            }
            for name, schema in chosen
        ]
        call = lark.json(variants[0] if len(variants) == 1 else {"anyOf": variants})
        parts = [call]
        if listed:
            parts = ['"["', *parts, '"]"']
        if padding:
            parts = [json.dumps(padding), *parts, json.dumps(padding)]
        if marked:
            parts = [lark.marker(framing.start), *parts]
            parts += [lark.marker(framing.end)] if framing.end else []
        return " ".join(parts)

    return CallSyntax(syntax)


def _named_calls(separator: str, section: tuple[str, str] | None = None) -> CallSyntax:
    """Mistral's and DeepSeek V3.1's: the markers, the name, a separator, then the
    arguments' JSON."""

    def syntax(lark, framing, chosen):
        sep = lark.marker(separator)
        calls = " | ".join(
            f"{json.dumps(name)} {sep} {lark.json(schema)}" for name, schema in chosen
        )
        body = f"{lark.marker(framing.start)} ({calls})"
        if framing.end:
            body += f" {lark.marker(framing.end)}"
        if section:
            body = f"{lark.marker(section[0])} {body} {lark.marker(section[1])}"
        return body

    return CallSyntax(syntax)


def _members(lark: Lark, schema: dict, pair: Callable, sep: str) -> str:
    """The declared keys of an arguments object in their order, each written by
    ``pair(key, schema)``, every required one present, ``sep`` between two; an
    object that declares none takes any keys (``pair(KEY, {})``)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        if schema.get("additionalProperties") is False:
            return '""'
        item = lark.rule("arg", pair(KEY, {}))
        return f"({item} ({sep} {item})*)?"
    required = set(schema.get("required") or ())
    keys = list(properties)
    # first[i] / later[i]: keys i.. when none / some came before.
    first, later = ['""'] * (len(keys) + 1), ['""'] * (len(keys) + 1)
    for i in range(len(keys) - 1, -1, -1):
        item = pair(keys[i], properties[keys[i]])
        with_it = lark.rule("arg", item)
        options_first = [f"{with_it} {later[i + 1]}"]
        options_later = [f"{sep} {with_it} {later[i + 1]}"]
        if keys[i] not in required:
            options_first.append(first[i + 1])
            options_later.append(later[i + 1])
        first[i] = lark.rule("args", " | ".join(options_first))
        later[i] = lark.rule("args", " | ".join(options_later))
    return first[0]


def _key(key: str) -> str:
    """A declared key as text; ``KEY`` (any name) as itself."""
    return key if key is KEY else json.dumps(key)


def _pythonic(lark, framing, chosen) -> str:
    """A Python list of calls, ``[get_weather(city="Paris")]``: bare where a
    reply may open with it (Llama 4), else in the framing's markers (LFM2). The
    values are JSON literals, which the readers take (true, null)."""

    def pair(key, schema):
        return f'{_key(key)} "=" {lark.json(schema)}'

    call = lark.rule(
        "call",
        " | ".join(
            f'{json.dumps(name + "(")} {_members(lark, schema, pair, "/, ?/")} ")"'
            for name, schema in chosen
        ),
    )
    body = f'"[" {call} (/, ?/ {call})* "]"'
    if "[" not in framing.reply_opens:
        body = f"{lark.marker(framing.start)} {body} {lark.marker(framing.end)}"
    return body


def _is_text(schema: dict) -> bool:
    """A string-typed value, which XML framings write as raw text."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0] if len(kind) == 1 else "mixed"
    if kind is None and "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    if kind is None and "const" in schema:
        return isinstance(schema["const"], str)
    # Untyped values are raw text too, as the readers keep them.
    return kind == "string" or kind is None and not schema.keys() & COMPOUND


def _xml_value(lark: Lark, schema: dict, close: str) -> str:
    """A value then ``close``: raw text for strings, JSON for any other type."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if _is_text(schema):
        if choices:
            words = " | ".join(json.dumps(v) for v in choices)
            return f"({words}) {lark.marker(close)}"
        return lark.text_until(close)
    return f"{lark.json(schema)} {lark.marker(close)}"


def _xml_calls(head: str, pair: str, tail: str, sep: str = "") -> CallSyntax:
    """XML framings: ``head`` and ``tail`` around one call, each argument as
    ``pair`` (``{key}`` and ``{value}`` filled in), ``{name}`` the tool's."""

    def syntax(lark, framing, chosen):
        m = lark.marker

        def write(key, schema):
            before, after = pair.split("{value}")
            opening, closing = before.split("{key}")
            value = _xml_value(lark, schema, after)
            return f"{m(opening)} {_key(key)} {m(closing)} {value}"

        calls = []
        for name, schema in chosen:
            members = _members(lark, schema, write, m(sep))
            calls.append(f"{m(head.replace('{name}', name))} {members} {m(tail)}")
        start = lark.marker(framing.start)
        return f"{start} ({' | '.join(calls)}) {lark.marker(framing.end)}"

    return CallSyntax(syntax, (pair.split("{value}")[1], tail))


def _kimi(lark, framing, chosen) -> str:
    """Kimi K2: ``functions.NAME:0`` then the arguments' JSON, in call markers."""
    m = lark.marker
    calls = " | ".join(
        f'{json.dumps("functions." + name + ":")} /[0-9]{{1,3}}/ '
        f"{m('<|tool_call_argument_begin|>')} {lark.json(schema)}"
        for name, schema in chosen
    )
    call = f"{m('<|tool_call_begin|>')} ({calls}) {m('<|tool_call_end|>')}"
    return f"{m(framing.start)} {call} {m(framing.end)}"


def _gemma_value(lark: Lark, schema) -> str:
    """A value as Gemma 4 writes it: strings in ``<|"|>``, bare keys."""
    quote = lark.marker(GEMMA_QUOTE)
    if not isinstance(schema, dict):
        schema = {}
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices:
        return "(" + " | ".join(_gemma_literal(lark, v) for v in choices) + ")"
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list) and options:
        return "(" + " | ".join(_gemma_value(lark, o) for o in options) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        return (
            "("
            + " | ".join(_gemma_value(lark, {**schema, "type": k}) for k in kind)
            + ")"
        )
    if kind == "string":
        return f"{quote} {lark.text_until(GEMMA_QUOTE)}"
    if kind in ("integer", "number"):
        return lark.json(schema)
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind == "array":
        item = lark.rule("item", _gemma_value(lark, schema.get("items", {})))
        return f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object" or kind is None and "properties" in schema:

        def pair(key, value):
            return f'{_key(key)} ":" {_gemma_value(lark, value)}'

        return f'"{{" {_members(lark, schema, pair, json.dumps(","))} "}}"'
    _gemma_any(lark)
    return "gemma_any"


def _gemma_literal(lark: Lark, value) -> str:
    if isinstance(value, str):
        quote = lark.marker(GEMMA_QUOTE)
        return f"{quote} {json.dumps(value)} {quote}"
    return json.dumps(json.dumps(value))


def _gemma_any(lark: Lark) -> None:
    """Rules for any value, and any object, as Gemma 4 writes them."""
    if "gemma_any" in lark.rules:
        return
    quote = lark.marker(GEMMA_QUOTE)
    key = f'{KEY} ":" gemma_any'
    lark.rules["gemma_object"] = f'"{{" ({key} ("," {key})*)? "}}"'
    lark.rules["gemma_any"] = " | ".join(
        [
            f"{quote} {lark.text_until(GEMMA_QUOTE)}",
            lark.json({"type": "number"}),
            '"true" | "false" | "null"',
            '"[" (gemma_any ("," gemma_any)*)? "]"',
            "gemma_object",
        ]
    )


def _gemma(lark, framing, chosen) -> str:
    """Gemma 4: ``call:NAME{key:value,...}`` in its call markers."""
    calls = " | ".join(
        f'{json.dumps("call:" + name)} {_gemma_value(lark, {**schema, "type": "object"})}'
        for name, schema in chosen
    )
    return f"{lark.marker(framing.start)} ({calls}) {lark.marker(framing.end)}"


# By framing name (None: a model without a call format answers with bare JSON).
CALL_SYNTAX: dict[str | None, CallSyntax] = {
    None: _json_calls(),
    "json": _json_calls(marked=True, padding="\n"),
    "llama3_json": _json_calls(args_key="parameters"),
    "phi4_mini": _json_calls(marked=True, listed=True),
    "granite": _json_calls(marked=True, listed=True),
    "command": _json_calls(
        "tool_name", "parameters", marked=True, listed=True, with_id=True
    ),
    "mistral": _named_calls(MISTRAL_SEPARATOR),
    "deepseek_v31": _named_calls(DEEPSEEK_SEPARATOR, DEEPSEEK_SECTION),
    "llama4": CallSyntax(_pythonic),
    "pythonic": CallSyntax(_pythonic),
    "qwen3_coder": _xml_calls(
        "\n<function={name}>\n",
        "<parameter={key}>\n{value}\n</parameter>\n",
        "</function>\n",
    ),
    "glm47": _xml_calls(
        "{name}", "<arg_key>{key}</arg_key><arg_value>{value}</arg_value>", ""
    ),
    "minimax_m2": _xml_calls(
        '\n<invoke name="{name}">\n',
        '<parameter name="{key}">{value}</parameter>\n',
        "</invoke>\n",
    ),
    "kimi_k2": CallSyntax(_kimi),
    "gemma4": CallSyntax(_gemma, (GEMMA_QUOTE,)),
}
CALL_SYNTAX["laguna"] = CALL_SYNTAX["glm47"]


def has_call_grammar(chat_format: ChatFormat) -> bool:
    """Whether a forced call ("required", a named function) can be constrained."""
    if chat_format.channels is not None:
        return True
    framing = chat_format.tools
    return (framing.name if framing else None) in CALL_SYNTAX


def closing_texts(chat_format: ChatFormat) -> tuple[str, ...]:
    """The texts that end the free regions of the format's grammars (reasoning, a
    harmony message, a call's values and markers), which a reply that must close
    before its token limit writes (``grammar.find_close``)."""
    texts = []
    if chat_format.reasoning is not None:
        texts.append(chat_format.reasoning.end)
    channels = chat_format.channels
    if channels is not None:
        texts += [channels.ends[0], channels.starts[0], channels.channel]
    framing = chat_format.tools
    syntax = CALL_SYNTAX.get(framing.name if framing else None)
    if syntax is not None:
        texts += syntax.closers
    if framing is not None:
        texts += [framing.end, *RESPONSE_MARKERS.get(framing.name, ())[1:]]
    return tuple(dict.fromkeys(t for t in texts if t))


def tool_call_grammar(
    chat_format: ChatFormat,
    tools: list,
    name: str | None,
    start: str,
    specials: Mapping[str, int],
) -> str | None:
    """A Lark grammar for a call of ``tools`` (of ``name`` alone, if given) in the
    format's framing, after any reasoning; None where the framing has no grammar
    (``has_call_grammar``) or no tool is named."""
    chosen = _chosen(tools, name)
    if not chosen or not has_call_grammar(chat_format):
        return None
    lark = Lark(specials)
    channels = chat_format.channels
    if channels is not None:
        m = lark.marker
        calls = " | ".join(
            f'{json.dumps(tool + " ")} {m(channels.constrain)} "json" '
            f"{m(channels.message)} {lark.json(schema)}"
            for tool, schema in chosen
        )
        head = f'{m(channels.channel)} "commentary to=functions."'
        return lark.render(f"({_analysis(lark, channels)})? {head} ({calls})")
    framing = chat_format.tools
    call = CALL_SYNTAX[framing.name if framing else None].write(lark, framing, chosen)
    # A reasoning model may think first; one the prompt opened in reasoning
    # finishes it first.
    head = _reasoning(lark, chat_format, start)
    return lark.render(call if head is None else f"{head} {call}")
