"""Classify generated text, as it streams, into answer content, reasoning and tool calls.

The loaded model's ``ChatFormat`` (formats/registry.py) says where reasoning starts
and ends, how tool calls are framed and read, and, for harmony, how channels are
announced. Each request gets an ``OutputParser`` that the engine thread feeds with
every decoded piece. mlx-lm's ``TextStateMachine`` finds the markers and holds back
text that may still turn out to be one, so half a marker never reaches the reply.
"""

import dataclasses
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine

from mlx_backend.formats.base import (
    CONTENT,
    HEADER,
    REASONING,
    TOOL,
    BadToolCall,
    CallPiece,
    ChatFormat,
    openai_call_id,
)
from mlx_backend.formats.readers import NamedCallReader

logger = logging.getLogger(__name__)

# The parser's states: each is one kind of text but "message", harmony's message
# body, whose kind its header decides.
STATE_KINDS = {
    "content": CONTENT,
    "reasoning": REASONING,
    "tool": TOOL,
    "header": HEADER,
    "channel": HEADER,
    "constrain": HEADER,
}


@dataclass(frozen=True)
class ToolCall:
    """A call's delta: the first carries ``id`` and ``name``; ``arguments`` are
    JSON text in chunks that concatenate."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    """Classified text: what one or more generated tokens added to the reply."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def merge_calls(calls: Iterable[ToolCall]) -> tuple[ToolCall, ...]:
    """One delta per call: a call's chunks joined."""
    merged: dict[int, ToolCall] = {}
    for call in calls:
        first = merged.get(call.index)
        if first is None:
            merged[call.index] = call
        else:
            merged[call.index] = ToolCall(
                call.index,
                first.id or call.id,
                first.name or call.name,
                first.arguments + call.arguments,
            )
    return tuple(merged.values())


def merge_deltas(deltas: Iterable[Delta]) -> Delta:
    """One delta holding everything ``deltas`` hold, in order."""
    content, reasoning, calls = [], [], []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        calls.extend(delta.tool_calls)
    return Delta("".join(content), "".join(reasoning), merge_calls(calls))


@dataclass(frozen=True)
class ReplyStart:
    """Where the rendered prompt leaves the reply: a parser state, and for harmony
    the header text so far."""

    state: str = "content"
    header: tuple[tuple[str, str], ...] = ()
    # The prompt closed the reasoning itself (thinking off): the reply is the answer.
    reasoned: bool = False


@dataclass(frozen=True)
class OutputOptions:
    """How one request's output is classified (parsed once from the request)."""

    # Chat-template requests are classified; a raw prompt gets its raw text back.
    classify: bool = False
    # The prompt may end inside thinking or a harmony header.
    start: ReplyStart = ReplyStart()
    # ToolChoice "none" turns tool-call parsing off.
    parse_tool_calls: bool = True
    tools: list | None = None
    # The request's own format where it differs from the model's (a call forced
    # by ToolChoice on a model without a call format).
    chat_format: ChatFormat | None = None


def make_transitions(
    chat_format: ChatFormat, stops: Iterable[str], options: OutputOptions
) -> dict[str, list[tuple[str, str | None]]]:
    """``TextStateMachine`` transitions: markers switch state, stop strings end."""
    content: list = []
    reasoning: list = []
    tool: list = []
    states = {"content": content, "reasoning": reasoning, "tool": tool}
    think = chat_format.reasoning
    framing = chat_format.tools if options.parse_tool_calls else None
    if options.classify and think:
        content.append((think.start, "reasoning"))
        # A closing marker without an opening one is markup as well: strip it.
        content.append((think.end, "content"))
        reasoning.append((think.end, "content"))
    if options.classify and framing and framing.start:
        content.append((framing.start, "tool"))
        if think:
            reasoning.append((framing.start, "tool"))
        if framing.end:
            tool.append((framing.end, "content"))
        else:
            # Without a closing marker (Mistral's) a new marker starts a new region.
            tool.append((framing.start, "tool"))
    channels = chat_format.channels
    if options.classify and channels:
        opens = [(m, "header") for m in channels.starts]
        opens.append((channels.channel, "channel"))
        ends = [(m, "content") for m in channels.ends]
        content.extend(opens + ends)
        states["message"] = opens + ends
        states["header"] = [
            (channels.channel, "channel"),
            (channels.constrain, "constrain"),
            (channels.message, "message"),
        ]
        states["channel"] = [
            (channels.constrain, "constrain"),
            (channels.message, "message"),
        ]
        states["constrain"] = [(channels.message, "message")]
    if options.classify:
        content.extend((marker, "content") for marker in chat_format.structural)
    for edges in states.values():
        edges.extend((stop, None) for stop in stops if stop)
    return states


class _Out:
    """What one call of the parser classifies."""

    def __init__(self):
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def delta(self) -> Delta:
        return Delta(
            "".join(self.content), "".join(self.reasoning), merge_calls(self.calls)
        )


class OutputParser:
    """One request's classifier: decoded pieces in, ``Delta``s out."""

    def __init__(
        self,
        chat_format: ChatFormat,
        stops: Iterable[str] = (),
        options: OutputOptions = OutputOptions(),
    ):
        self._format = chat_format
        self._options = options
        classify = options.classify
        self._framing = chat_format.tools if options.parse_tool_calls else None
        self._machine = TextStateMachine(make_transitions(chat_format, stops, options))
        start = options.start if classify else ReplyStart()
        self._state = self._machine.make_state(start.state)
        self._current: str | None = start.state
        self._header = {part: [text] for part, text in start.header}
        self._kind = self._kind_of(start.state)
        # Text right after a think marker starts at its first visible character.
        self._trim = self._kind == REASONING
        self._reader = None
        self._calls = 0  # calls sent before the open region
        self._region_sent = False
        self._region_failed = False
        self._region_marker = ""
        opens = self._framing.reply_opens if self._framing else ""
        # The reply's leading text, held until it shows whether it opens calls.
        self._opening: list[str] | None = None
        if classify and opens and options.tools and self._kind == CONTENT:
            self._opening = []

    def feed(self, text: str) -> tuple[Delta, bool]:
        """Classify a decoded piece; the flag is True once a stop string matched."""
        if self._state[0] is None:
            return Delta(), True
        if self._opening is not None:
            self._opening.append(text)
            text = "".join(self._opening)
            first = text.lstrip()[:1]
            if not first:
                return Delta(), False
            self._opening = None
            if first in self._framing.reply_opens:
                self._state = self._machine.make_state("tool")
                self._current = "tool"
                self._kind = TOOL
                self._begin_region("")
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments), self._state[0] is None

    def finish(self) -> Delta:
        """Classify what is still held back: a marker never completed is text."""
        out = _Out()
        if self._opening is not None:
            out.content.append("".join(self._opening))
            self._opening = None
        if self._state[0] is not None:  # else a stop string ended the text
            self._state, rest, _ = TextStateMachine.flush(self._state)
            self._text(rest, out)
        # The end closes a tool call still open, unfinished.
        if self._kind == TOOL:
            self._close_region(out, None)
        self._kind = CONTENT
        return out.delta()

    def reply_start(self) -> ReplyStart:
        """Where a reply that continued this text would start."""
        if self._kind == REASONING:
            return ReplyStart("reasoning")
        if self._kind == HEADER:
            header = tuple((part, "".join(text)) for part, text in self._header.items())
            return ReplyStart(self._current, header)
        return ReplyStart()

    def _kind_of(self, state: str | None) -> str:
        if state == "message":
            return self._message_kind()
        return STATE_KINDS.get(state, CONTENT)

    def _collect(self, segments) -> Delta:
        out = _Out()
        for i, (state, text) in enumerate(segments):
            if i:  # every segment after the first follows a marker
                self._transition(state, out)
            if text:
                self._text(text, out)
        return out.delta()

    def _transition(self, state: str | None, out: _Out) -> None:
        before = self._kind
        if before == TOOL:
            self._close_region(out, state)
        if state in STATE_KINDS and STATE_KINDS[state] == HEADER and before != HEADER:
            self._header = {}
        kind = self._kind_of(state)
        if kind != before:
            self._trim = REASONING in (kind, before)
        self._current, self._kind = state, kind
        if kind == TOOL:
            self._begin_region(self._framing.start if state == "tool" else "")

    def _text(self, text: str, out: _Out) -> None:
        kind = self._kind
        if kind == HEADER:
            self._header.setdefault(self._current, []).append(text)
            return
        if self._trim and kind != TOOL:
            text = text.lstrip()
            self._trim = not text
        if not text:
            return
        if kind == TOOL:
            self._feed_region(text, out)
        elif kind == REASONING:
            out.reasoning.append(text)
        else:
            out.content.append(text)

    # Harmony: the header says what a message's body is.

    def _header_text(self) -> str:
        return " ".join("".join(parts) for parts in self._header.values())

    def _message_kind(self) -> str:
        channels = self._format.channels
        header = self._header_text()
        if channels.recipient_prefix in header:
            return TOOL if self._options.parse_tool_calls else CONTENT
        channel = "".join(self._header.get("channel", ())).split()
        if channel and channel[0] in channels.reasoning_channels:
            return REASONING
        return CONTENT

    def _recipient(self) -> str:
        prefix = re.escape(self._format.channels.recipient_prefix)
        match = re.search(prefix + r"([^\s<]+)", self._header_text())
        return match.group(1) if match else ""

    # Tool-call regions: from a start marker (or the reply's start) to the end.

    def _begin_region(self, marker: str) -> None:
        tools = self._options.tools
        if self._format.channels is not None:
            self._reader = NamedCallReader(tools, name=self._recipient())
        else:
            self._reader = self._framing.make_reader(tools)
        self._region_marker = marker
        self._region_sent = False
        self._region_failed = False

    def _feed_region(self, text: str, out: _Out) -> None:
        if self._region_failed:
            out.content.append(text)
            return
        try:
            self._send(self._reader.feed(text), out)
        except BadToolCall as e:
            self._fail(e, out)

    def _close_region(self, out: _Out, state: str | None) -> None:
        if not self._region_failed:
            try:
                self._send(self._reader.close(), out)
            except BadToolCall as e:
                self._fail(e, out)
        framing = self._framing
        if self._region_failed and state == "content" and framing and framing.end:
            out.content.append(framing.end)
        self._calls += self._reader.calls
        self._reader = None

    def _fail(self, error: BadToolCall, out: _Out) -> None:
        pending = self._reader.pending()
        # Never drop what the model wrote: the call's text becomes content.
        logger.warning(
            "a tool call could not be read (%s); %d characters of it are returned "
            "as content",
            error,
            len(pending),
        )
        if not self._region_sent:
            out.content.append(self._region_marker)
        out.content.append(pending)
        self._region_failed = True

    def _send(self, pieces: list[CallPiece], out: _Out) -> None:
        make_id = self._framing.make_id if self._framing else openai_call_id
        for piece in pieces:
            index = self._calls + piece.call
            if piece.name is None:
                out.calls.append(ToolCall(index, arguments=piece.arguments))
                continue
            call_id = piece.id or make_id()
            out.calls.append(ToolCall(index, call_id, piece.name, piece.arguments))
            self._region_sent = True


def find_reply_start(chat_format: ChatFormat, prompt_tail: str) -> ReplyStart:
    """Where a prompt ending in ``prompt_tail`` leaves the reply: inside thinking,
    in a harmony header, or (anything else) in content."""
    parser = OutputParser(chat_format, (), OutputOptions(classify=True))
    parser.feed(prompt_tail)
    start = parser.reply_start()
    reasoning = chat_format.reasoning
    if reasoning and prompt_tail.rstrip().endswith(reasoning.end.rstrip()):
        return dataclasses.replace(start, reasoned=True)
    return start
