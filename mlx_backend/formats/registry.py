"""The format registry: which chat format the loaded model speaks.

Each family is recognised by its chat template, its vocabulary or its
``config.json`` model type. Tool-call framing and reasoning markers are chosen
separately, so families that share one (Magistral: Mistral's calls with
``[THINK]``) compose; harmony (gpt-oss) is a format of its own. Where none of
ours applies, mlx-lm's detection stands. The ``tool_parser`` and ``reasoning``
load options override what is detected.
"""

import importlib
import pkgutil
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from functools import partial

from mlx_lm import tool_parsers

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.base import (
    Channels,
    ChatFormat,
    Reasoning,
    ToolFraming,
    mistral_call_id,
)
from mlx_backend.formats.readers import (
    JsonCallReader,
    NamedCallReader,
    PythonicOrJsonReader,
    WholeCallReader,
)

THINK = Reasoning("<think>", "</think>")
MISTRAL_THINK = Reasoning("[THINK]", "[/THINK]")
COMMAND_THINK = Reasoning("<|START_THINKING|>", "<|END_THINKING|>")
REASONINGS = {"think": THINK, "mistral": MISTRAL_THINK, "command": COMMAND_THINK}

# What separates a call's name from its arguments (Mistral, DeepSeek V3.1).
MISTRAL_SEPARATOR = "[ARGS]"
DEEPSEEK_SEPARATOR = "<｜tool▁sep｜>"
_MISTRAL_HEAD = re.compile(r"([\w.-]+)(?:\s*\[CALL_ID\]\s*(\w+))?")
_DEEPSEEK_HEAD = re.compile(r"([\w.-]+)")
DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")


def _module_parser(module: str) -> Callable:
    return importlib.import_module(f"{tool_parsers.__name__}.{module}").parse_tool_call


def _module_reader(module: str):
    return partial(WholeCallReader, parse=_module_parser(module))


_pythonic = _module_parser("pythonic")


FRAMINGS = {
    framing.name: framing
    for framing in (
        # Qwen2.5/3, Hermes 2/3, Granite 4: <tool_call>{"name", "arguments"}</tool_call>
        ToolFraming("json", JsonCallReader, "<tool_call>", "</tool_call>"),
        # Llama 3.1/3.3 answer with the call's JSON; 3.2 may open it with <|python_tag|>.
        ToolFraming("llama3_json", JsonCallReader, "<|python_tag|>", reply_opens="{"),
        # Llama 4: a Python list of calls, [get_weather(city="Paris")], or JSON.
        ToolFraming(
            "llama4",
            partial(PythonicOrJsonReader, parse_pythonic=_pythonic),
            "<|python_start|>",
            "<|python_end|>",
            reply_opens="[{",
        ),
        ToolFraming(
            "deepseek_v31",
            partial(NamedCallReader, separator=DEEPSEEK_SEPARATOR, head=_DEEPSEEK_HEAD),
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
        ),
        # [TOOL_CALLS]name[ARGS]{...}, name[CALL_ID]id[ARGS]{...} or a JSON list.
        ToolFraming(
            "mistral",
            partial(
                NamedCallReader,
                separator=MISTRAL_SEPARATOR,
                head=_MISTRAL_HEAD,
                json_lists=True,
            ),
            "[TOOL_CALLS]",
            make_id=mistral_call_id,
        ),
        # Granite 3.x: <|tool_call|>[{"name": ..., "arguments": ...}]
        ToolFraming("granite", JsonCallReader, "<|tool_call|>"),
        # Phi-4-mini: <|tool_call|>[...]<|/tool_call|>, the closing tag often missing.
        ToolFraming("phi4_mini", JsonCallReader, "<|tool_call|>", "<|/tool_call|>"),
        # Command R7B / Command A: a JSON list of {"tool_name", "parameters"}.
        ToolFraming("command", JsonCallReader, "<|START_ACTION|>", "<|END_ACTION|>"),
    )
}
FRAMING_ALIASES = {
    "hermes": "json",
    "json_tools": "json",
    "qwen": "json",
    "llama4_pythonic": "llama4",
}
HARMONY = "harmony"


@dataclass(frozen=True)
class Signals:
    """What a family is recognised by."""

    template: str = ""
    # The texts that are one token.
    vocab: Container[str] = frozenset()
    model_type: str = ""

    def shows(self, *texts: str) -> bool:
        """Whether every one of ``texts`` is in the template or the vocabulary."""
        return all(t in self.template for t in texts) or all(
            t in self.vocab for t in texts
        )


def _by(signals: Signals, *texts: str) -> str:
    return (
        "chat template" if all(t in signals.template for t in texts) else "vocabulary"
    )


# (framing, markers): the first family whose markers the template or the
# vocabulary shows frames the calls.
TOOL_RULES = (
    ("deepseek_v31", (DEEPSEEK_SECTION[0],)),
    ("command", ("<|START_ACTION|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ("<|start_header_id|>", "<|python_tag|>")),
    ("llama4", ("<|header_start|>", "<|eot|>")),
    ("phi4_mini", ("<|tool|>", "<|/tool|>")),
    ("granite", ("<|start_of_role|>", "<|tool_call|>")),
)
REASONING_RULES = (
    ("mistral", (MISTRAL_THINK.start, MISTRAL_THINK.end)),
    ("command", (COMMAND_THINK.start, COMMAND_THINK.end)),
    # Granite 3.2+ thinks in <think> text and answers in <response>.
    ("think", ("<think>", "<response>")),
)
# Markup around an answer, stripped: Command's and Granite's.
RESPONSE_MARKERS = {
    "command": ("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    "granite": ("<response>", "</response>"),
}
END_TOKENS = ("<|eom_id|>", "<|eot_id|>", "<|eom|>", "<|eot|>", "<|END_OF_TURN_TOKEN|>")


def is_harmony(signals: Signals) -> bool:
    return signals.model_type == "gpt_oss" or signals.shows(
        "<|channel|>", "<|message|>", "<|start|>"
    )


def mlx_lm_tool_parsers() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(tool_parsers.__path__))


def check_format_options(tool_parser: str, reasoning: str) -> tuple[str, str]:
    """The ``tool_parser`` and ``reasoning`` options by their canonical names."""
    tool_parser = FRAMING_ALIASES.get(tool_parser, tool_parser)
    known = [*FRAMINGS, HARMONY, "none", *mlx_lm_tool_parsers()]
    if tool_parser and tool_parser not in known:
        raise InvalidArgument(
            f"Options: tool_parser must be one of {', '.join(known)}, "
            f"not {tool_parser!r}"
        )
    known = [*REASONINGS, HARMONY, "none"]
    if reasoning and reasoning not in known:
        raise InvalidArgument(
            f"Options: reasoning must be one of {', '.join(known)}, not {reasoning!r}"
        )
    return tool_parser, reasoning


class TokenTexts(Container[str]):
    """The texts that are one token of ``tokenizer``, asked of it one by one: its
    whole vocabulary, built anew at each ask, took 30 ms of a load."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __contains__(self, text: object) -> bool:
        try:
            token = self._tokenizer.convert_tokens_to_ids(text)
        except (KeyError, ValueError):
            # Remote-code tokenizers (tiktoken's) may raise for an unknown token.
            return False
        unknown = self._tokenizer.unk_token_id
        return token is not None and (
            token != unknown or text == self._tokenizer.unk_token
        )


def make_signals(tokenizer, config: Mapping) -> Signals:
    template = tokenizer.chat_template if tokenizer.has_chat_template else ""
    return Signals(
        template=template if isinstance(template, str) else "",
        vocab=TokenTexts(tokenizer),
        model_type=str(config.get("model_type", "")),
    )


def make_chat_format(
    tokenizer, config: Mapping, tool_parser: str = "", reasoning: str = ""
) -> ChatFormat:
    """The loaded model's chat format: detected, or named by the load options
    (checked by ``check_format_options``)."""
    signals = make_signals(tokenizer, config)
    named = HARMONY in (tool_parser, reasoning)
    if named or not (tool_parser or reasoning) and is_harmony(signals):
        if named:
            by = "option"
        elif signals.model_type == "gpt_oss":
            by = "model type"
        else:
            by = _by(signals, "<|channel|>", "<|message|>")
        return ChatFormat(
            name=HARMONY,
            detected_by=f"channels by {by}",
            channels=Channels(),
            end_tokens=_present(signals, ("<|call|>", "<|return|>")),
        )
    tools, tools_by = _tool_framing(tokenizer, signals, tool_parser)
    think, think_by = _reasoning(tokenizer, signals, reasoning)
    structural = tuple(tokenizer.structural_markers)
    if tools is not None and tools.name == "deepseek_v31":
        structural += DEEPSEEK_SECTION
    if tools is not None:
        structural += RESPONSE_MARKERS.get(tools.name, ())
    parts = [p for p in (tools and tools.name, think and think.start) if p]
    detected = [
        f"{what} by {by}"
        for what, by in (("tool calls", tools_by), ("reasoning", think_by))
        if by
    ]
    return ChatFormat(
        name="+".join(parts) if parts else "plain",
        detected_by=", ".join(detected),
        reasoning=think,
        tools=tools,
        structural=structural,
        end_tokens=_present(signals, END_TOKENS),
        tools_in_system=tools is not None and tools.name == "phi4_mini",
        arguments_as_text=tools is not None and tools.name == "deepseek_v31",
    )


def adopt_chat_format(
    tokenizer, config: Mapping, tool_parser: str = "", reasoning: str = ""
) -> ChatFormat:
    """``make_chat_format``, with the format's end tokens added to the tokenizer's
    end-of-sequence tokens, so that a reply stops at them."""
    chat_format = make_chat_format(tokenizer, config, tool_parser, reasoning)
    for token in chat_format.end_tokens:
        tokenizer.add_eos_token(token)
    return chat_format


def _present(signals: Signals, tokens: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(t for t in tokens if t in signals.vocab)


def _tool_framing(
    tokenizer, signals: Signals, option: str
) -> tuple[ToolFraming | None, str]:
    if option == "none":
        return None, "option"
    if option:
        if option in FRAMINGS:
            return FRAMINGS[option], "option"
        return _mlx_lm_framing(option), "option"
    for name, markers in TOOL_RULES:
        if signals.shows(*markers):
            return FRAMINGS[name], _by(signals, *markers)
    inferred = tokenizer.init_kwargs.get("tool_parser_type")
    if tokenizer.has_tool_calling and inferred:
        return _mlx_lm_framing(inferred), "mlx-lm"
    if "<tool_call>" in signals.template:
        return FRAMINGS["json"], "chat template"
    return None, ""


def _mlx_lm_framing(module: str) -> ToolFraming:
    """One of mlx-lm's parsers; its JSON and Mistral formats are read by ours,
    which stream and know Mistral's call ids."""
    if module == "json_tools":
        return FRAMINGS["json"]
    if module == "mistral":
        return FRAMINGS["mistral"]
    parser = importlib.import_module(f"{tool_parsers.__name__}.{module}")
    return ToolFraming(
        name=module,
        make_reader=_module_reader(module),
        start=parser.tool_call_start,
        end=parser.tool_call_end,
    )


def _reasoning(
    tokenizer, signals: Signals, option: str
) -> tuple[Reasoning | None, str]:
    if option == "none":
        return None, "option"
    if option:
        return REASONINGS[option], "option"
    for name, markers in REASONING_RULES:
        if signals.shows(*markers):
            return REASONINGS[name], _by(signals, *markers)
    if tokenizer.think_start:
        return Reasoning(tokenizer.think_start, tokenizer.think_end), "mlx-lm"
    return None, ""
