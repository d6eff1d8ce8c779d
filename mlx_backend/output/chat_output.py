"""Classify generated text, as it streams, into answer content, reasoning and tool calls.

The markers come from the loaded tokenizer: mlx-lm detects them from the chat
template and the vocabulary. Each request gets an ``OutputParser`` that the
engine thread feeds with every decoded piece. mlx-lm's ``TextStateMachine``
holds back text that may still turn out to be a marker or a stop string, so
half a marker never reaches ``content``.
"""

import dataclasses
import importlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlx_lm import tool_parsers
from mlx_lm.generate import TextStateMachine

logger = logging.getLogger(__name__)

NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object text


@dataclass(frozen=True)
class Delta:
    """Classified text: what one or more generated tokens added to the reply."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def merge_deltas(deltas: Iterable[Delta]) -> Delta:
    """One delta holding everything ``deltas`` hold, in order."""
    content, reasoning, calls = [], [], []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        calls.extend(delta.tool_calls)
    return Delta("".join(content), "".join(reasoning), tuple(calls))


@dataclass(frozen=True)
class OutputMarkers:
    """The reasoning and tool-call markup of the loaded model, from its tokenizer."""

    think_start: str | None = None
    think_end: str | None = None
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    tool_parser: Callable | None = None
    # The mlx-lm tool parser module, e.g. "json_tools" or "qwen3_coder".
    tool_format: str | None = None
    # Markup that separates parts of a reply and is never shown (mlx-lm's XTML).
    structural: tuple[str, ...] = ()


def make_output_markers(tokenizer, tool_parser: str = "") -> OutputMarkers:
    """The markers mlx-lm's ``TokenizerWrapper`` detected for this model, with
    ``tool_parser`` (a module of mlx-lm's ``tool_parsers``, checked by
    ``parse_options``) in place of the tool-call markup it inferred."""
    markers = OutputMarkers(
        think_start=tokenizer.think_start,
        think_end=tokenizer.think_end,
        structural=tuple(tokenizer.structural_markers),
    )
    if tool_parser:
        module = importlib.import_module(f"{tool_parsers.__name__}.{tool_parser}")
        return dataclasses.replace(
            markers,
            tool_call_start=module.tool_call_start,
            tool_call_end=module.tool_call_end,
            tool_parser=module.parse_tool_call,
            tool_format=tool_parser,
        )
    if not tokenizer.has_tool_calling:
        return markers
    return dataclasses.replace(
        markers,
        tool_call_start=tokenizer.tool_call_start,
        tool_call_end=tokenizer.tool_call_end,
        tool_parser=tokenizer.tool_parser,
        tool_format=tokenizer.init_kwargs.get("tool_parser_type"),
    )


@dataclass(frozen=True)
class OutputOptions:
    """How one request's output is classified (parsed once from the request)."""

    # Chat-template requests are classified; a raw prompt gets its raw text back.
    classify: bool = False
    # The rendered prompt ends inside thinking, so the reply starts as reasoning.
    reasoning_open: bool = False
    # ToolChoice "none" turns tool-call parsing off.
    parse_tool_calls: bool = True
    tools: list | None = None


def make_transitions(
    markers: OutputMarkers, stops: Iterable[str], options: OutputOptions
) -> dict[str, list[tuple[str, str | None]]]:
    """``TextStateMachine`` transitions: markers switch state, stop strings end."""
    normal: list = []
    reasoning: list = []
    tool: list = []
    if options.classify and markers.think_start:
        normal.append((markers.think_start, REASONING))
        # A closing marker without an opening one is markup as well: strip it.
        normal.append((markers.think_end, NORMAL))
        reasoning.append((markers.think_end, NORMAL))
    if options.classify and options.parse_tool_calls and markers.tool_parser:
        normal.append((markers.tool_call_start, TOOL))
        if markers.think_start:
            reasoning.append((markers.tool_call_start, TOOL))
        # Without a closing marker (Mistral's) a call runs to the end of the reply.
        if markers.tool_call_end:
            tool.append((markers.tool_call_end, NORMAL))
    if options.classify:
        normal.extend((marker, NORMAL) for marker in markers.structural)
    transitions = {NORMAL: normal, REASONING: reasoning, TOOL: tool}
    for edges in transitions.values():
        edges.extend((stop, None) for stop in stops if stop)
    return transitions


class BadToolCall(ValueError):
    """The tool parser's result is not a call with a name and object arguments."""


def make_tool_calls(parsed, first_index: int) -> list[ToolCall]:
    """``ToolCall``s from a tool parser's result (one call or a list of them)."""
    calls = []
    for offset, call in enumerate(parsed if isinstance(parsed, list) else [parsed]):
        if not isinstance(call, dict):
            raise BadToolCall(f"expected an object, got {type(call).__name__}")
        name = call.get("name")
        if not isinstance(name, str) or not name:
            raise BadToolCall("the call has no function name")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise BadToolCall("the arguments are not a JSON object")
        calls.append(
            ToolCall(
                index=first_index + offset,
                id=str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                name=name,
                arguments=json.dumps(arguments, ensure_ascii=False),
            )
        )
    return calls


class OutputParser:
    """One request's classifier: decoded pieces in, ``Delta``s out."""

    def __init__(
        self,
        markers: OutputMarkers,
        stops: Iterable[str] = (),
        options: OutputOptions = OutputOptions(),
    ):
        self._markers = markers
        self._tools = options.tools
        machine = TextStateMachine(make_transitions(markers, stops, options))
        opened = options.classify and options.reasoning_open and markers.think_start
        self._current = REASONING if opened else NORMAL
        self._state = machine.make_state(self._current)
        self._call_text: list[str] = []
        self._calls = 0
        # Text right after a think marker starts at its first visible character.
        self._trim = bool(opened)

    def feed(self, text: str) -> tuple[Delta, bool]:
        """Classify a decoded piece; the flag is True once a stop string matched."""
        if self._state[0] is None:
            return Delta(), True
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments), self._state[0] is None

    def finish(self) -> Delta:
        """Classify what is still held back: a marker never completed is text."""
        segments = []
        if self._state[0] is not None:  # else a stop string ended the text
            self._state, rest, current = TextStateMachine.flush(self._state)
            segments.append((current, rest))
        # The end closes a tool call still open, unfinished.
        return self._collect(segments + [(None, "")])

    def _collect(self, segments) -> Delta:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for state, text in segments:
            if self._current == TOOL and state != TOOL:
                # A stop string inside a call ends it without its closing marker.
                self._close_call(content, calls, closed=state is not None)
            if state != self._current:
                self._trim = REASONING in (state, self._current)
            self._current = state
            if self._trim and state in (NORMAL, REASONING):
                text = text.lstrip()
                self._trim = not text
            if state == TOOL:
                self._call_text.append(text)
            elif state == REASONING:
                reasoning.append(text)
            elif state == NORMAL:
                content.append(text)
        return Delta("".join(content), "".join(reasoning), tuple(calls))

    def _close_call(self, content: list, calls: list, closed: bool) -> None:
        text = "".join(self._call_text)
        self._call_text = []
        try:
            parsed = make_tool_calls(
                self._markers.tool_parser(text, self._tools), self._calls
            )
        except Exception as e:
            # Never drop what the model wrote: the raw markup becomes content.
            logger.warning(
                "could not parse a %d-character tool call (%s: %s); "
                "returning it as content",
                len(text),
                type(e).__name__,
                e,
            )
            end = self._markers.tool_call_end if closed else ""
            content.append(f"{self._markers.tool_call_start}{text}{end or ''}")
            return
        self._calls += len(parsed)
        calls.extend(parsed)
