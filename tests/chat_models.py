"""Chat models for tests of reasoning and tool calls: a tiny random llama with the
default model's tokenizer, marker tokens (``<think>``, ``<tool_call>``) and a chat
template each: Qwen-style JSON calls, the same opening inside thinking, and
Qwen3-Coder's XML calls; and a reference reply with a thought and two calls
(``REPLY``).

``FAMILIES`` adds one chat model per family the format registry knows, with the
family's real chat template (``tests/chat_templates``, sources in SOURCES.md), its
marker tokens in place of the default model's unused special tokens, and the exact
text its model emits (``FamilyReply``)."""

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.tiny_models import make_tiny_draft

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


THOUGHT = "The user wants the weather. I should call the tool."
CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
CALL_LYON = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
REPLY = (
    f"<think>\n{THOUGHT}\n</think>\n\nLet me check both cities."
    f"<tool_call>\n{CALL_PARIS}\n</tool_call>\n<tool_call>\n{CALL_LYON}\n</tool_call>"
)


@functools.cache
def _read_json(path: Path) -> dict:
    """A base folder's file, parsed once for all the folders made from it."""
    return json.loads(path.read_text())


def make_chat_folder(
    base: Path,
    folder: Path,
    template: str,
    tokens: dict[int, str] = MARKER_TOKENS,
    bos: str = "",
    eos: str = "",
) -> Path:
    """The ``base`` model with marker ``tokens`` (by id) and ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        (folder / name).symlink_to(base / name)
    tokenizer = _read_json(base / "tokenizer.json")
    # The base's, copied where this folder changes them (its markers).
    vocab = dict(tokenizer["model"]["vocab"])
    tokenizer = {
        **tokenizer,
        "model": {**tokenizer["model"], "vocab": vocab},
        "added_tokens": [dict(entry) for entry in tokenizer["added_tokens"]],
    }
    for entry in tokenizer["added_tokens"]:
        if entry["id"] in tokens:
            del vocab[entry["content"]]
            entry["content"] = tokens[entry["id"]]
            # As in Qwen, Hermes and DeepSeek, these markers are plain text.
            entry["special"] = entry["content"] not in TEXT_MARKERS
            vocab[entry["content"]] = entry["id"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    config.pop("added_tokens_decoder", None)
    if bos:
        config["bos_token"] = bos
    if eos:
        config["eos_token"] = config["pad_token"] = eos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


TEXT_MARKERS = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
}
TEMPLATES = Path(__file__).parent / "chat_templates"
GEMMA_QUOTE = '<|"|>'
# The calls every family's reply makes (a family that calls one tool per turn
# makes the first), and their arguments as the model writes them.
PARIS = ("get_weather", '{"city": "Paris", "days": 2}')
LYON = ("get_weather", '{"city": "Lyon"}')


@dataclass(frozen=True)
class FamilyReply:
    """What a family's model emits, and what the client must get from it."""

    text: str
    content: str = ""
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()
    # Template variables the request sets (Metadata chat_template_kwargs).
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    template: str  # a file in tests/chat_templates
    tokens: tuple[str, ...]  # in place of the default model's special tokens 3, 4, ...
    format: str  # the ChatFormat name the registry must choose
    replies: tuple[FamilyReply, ...]
    bos: str = ""
    eos: str = ""
    # How the template writes the call's "Paris" back into a prompt (None: it
    # drops calls).
    rendered_argument: str | None = '"Paris"'


def _json_call(name_key: str, args_key: str, call: tuple[str, str]) -> str:
    return f'{{"{name_key}": "{call[0]}", "{args_key}": {call[1]}}}'


HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
MISTRAL_TOKENS = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[ARGS]",
)
LLAMA3_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
DEEPSEEK_CALLS = (
    "<｜tool▁calls▁begin｜>"
    f"<｜tool▁call▁begin｜>{PARIS[0]}<｜tool▁sep｜>{PARIS[1]}<｜tool▁call▁end｜>"
    f"<｜tool▁call▁begin｜>{LYON[0]}<｜tool▁sep｜>{LYON[1]}<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
LIST_OF_TWO = f'[{_json_call("name", "arguments", PARIS)}, {_json_call("name", "arguments", LYON)}]'

FAMILIES = {
    "gpt_oss": Family(
        "gpt_oss.jinja",
        HARMONY_TOKENS,
        "harmony",
        (
            FamilyReply(
                f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                f"<|message|>{PARIS[1]}<|call|>",
                reasoning=THOUGHT,
                calls=(PARIS,),
            ),
            FamilyReply(
                f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
                " to=functions.get_weather<|channel|>commentary json"
                f"<|message|>{LYON[1]}<|call|>",
                reasoning=THOUGHT,
                calls=(LYON,),
            ),
            FamilyReply(
                f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
                "<|channel|>final<|message|>It is sunny in Paris.<|return|>",
                content="It is sunny in Paris.",
                reasoning=THOUGHT,
            ),
        ),
        eos="<|return|>",
    ),
    "llama3_3": Family(
        "llama3_3.jinja",
        LLAMA3_TOKENS,
        "llama3_json",
        (
            FamilyReply(_json_call("name", "parameters", PARIS), calls=(PARIS,)),
            FamilyReply("It is sunny.", content="It is sunny."),
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "llama3_2": Family(
        "llama3_2.jinja",
        LLAMA3_TOKENS,
        "llama3_json",
        (
            FamilyReply(
                "<|python_tag|>"
                + _json_call("name", "parameters", PARIS)
                + "; "
                + _json_call("name", "parameters", LYON),
                calls=(PARIS, LYON),
            ),
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "llama4": Family(
        "llama4.jinja",
        (
            "<|begin_of_text|>",
            "<|header_start|>",
            "<|header_end|>",
            "<|eot|>",
            "<|eom|>",
            "<|python_start|>",
            "<|python_end|>",
        ),
        "llama4",
        (
            FamilyReply(
                '[get_weather(city="Paris", days=2), get_weather(city="Lyon")]',
                calls=(PARIS, LYON),
            ),
            FamilyReply(_json_call("name", "parameters", LYON), calls=(LYON,)),
        ),
        bos="<|begin_of_text|>",
        eos="<|eot|>",
    ),
    "deepseek_v3_1": Family(
        "deepseek_v3_1.jinja",
        (
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<think>",
            "</think>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        "deepseek_v31+<think>",
        (
            # With thinking on the prompt ends in <think>.
            FamilyReply(
                f"{THOUGHT}</think>Let me check.{DEEPSEEK_CALLS}",
                content="Let me check.",
                reasoning=THOUGHT,
                calls=(PARIS, LYON),
                kwargs={"thinking": True},
            ),
            FamilyReply(DEEPSEEK_CALLS, calls=(PARIS, LYON)),
        ),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    ),
    "magistral": Family(
        "magistral.jinja",
        MISTRAL_TOKENS + ("[THINK]", "[/THINK]"),
        "mistral+[THINK]",
        (
            FamilyReply(
                f"[THINK]{THOUGHT}[/THINK]Let me check."
                f"[TOOL_CALLS]{PARIS[0]}[ARGS]{PARIS[1]}"
                f"[TOOL_CALLS]{LYON[0]}[ARGS]{LYON[1]}",
                content="Let me check.",
                reasoning=THOUGHT,
                calls=(PARIS, LYON),
            ),
            FamilyReply(
                f"[THINK]{THOUGHT}[/THINK]"
                '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                f'{LYON[1]}, "id": "abc123def"}}]',
                reasoning=THOUGHT,
                calls=(LYON,),
            ),
        ),
        bos="<s>",
        eos="</s>",
    ),
    "mistral_small_3_2": Family(
        "mistral_small_3_2.jinja",
        MISTRAL_TOKENS + ("[CALL_ID]", "[TOOL_CONTENT]"),
        "mistral",
        (
            FamilyReply(
                f"[TOOL_CALLS]{PARIS[0]}[CALL_ID]a1B2c3D4e[ARGS]{PARIS[1]}"
                f"[TOOL_CALLS]{LYON[0]}[CALL_ID]Zz9Yy8Xx7[ARGS]{LYON[1]}",
                calls=(PARIS, LYON),
            ),
        ),
        bos="<s>",
        eos="</s>",
    ),
    "hermes_3": Family(
        "hermes_3.jinja",
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        "json",
        (
            FamilyReply(
                f"<tool_call>\n{_json_call('name', 'arguments', PARIS)}\n</tool_call>\n"
                f'<tool_call>\n{{"arguments": {LYON[1]}, "name": "get_weather"}}'
                "\n</tool_call>",
                content="\n",
                calls=(PARIS, LYON),
            ),
        ),
    ),
    "phi_4_mini": Family(
        "phi_4_mini.jinja",
        (
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "<|tool|>",
            "<|/tool|>",
            "<|tool_call|>",
            "<|/tool_call|>",
            "<|tool_response|>",
        ),
        "phi4_mini",
        (
            FamilyReply(
                f"<|tool_call|>{LIST_OF_TWO}<|/tool_call|>", calls=(PARIS, LYON)
            ),
        ),
        eos="<|end|>",
        rendered_argument=None,
    ),
    "granite_3_3": Family(
        "granite_3_3.jinja",
        ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"),
        "granite+<think>",
        (
            FamilyReply(f"<|tool_call|>{LIST_OF_TWO}", calls=(PARIS, LYON)),
            FamilyReply(
                f"<think>{THOUGHT}</think><response>It is sunny.</response>",
                content="It is sunny.",
                reasoning=THOUGHT,
                kwargs={"thinking": True},
            ),
        ),
        eos="<|end_of_text|>",
        rendered_argument=None,
    ),
    "command_r7b": Family(
        "command_r7b.jinja",
        (
            "<BOS_TOKEN>",
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|START_THINKING|>",
            "<|END_THINKING|>",
            "<|START_ACTION|>",
            "<|END_ACTION|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_TOOL_RESULT|>",
            "<|END_TOOL_RESULT|>",
        ),
        "command+<|START_THINKING|>",
        (
            FamilyReply(
                f"<|START_THINKING|>{THOUGHT}<|END_THINKING|><|START_ACTION|>[\n"
                f'    {{"tool_call_id": "0", "tool_name": "get_weather", '
                f'"parameters": {PARIS[1]}}},\n'
                f'    {{"tool_call_id": "1", "tool_name": "get_weather", '
                f'"parameters": {LYON[1]}}}\n]<|END_ACTION|>',
                reasoning=THOUGHT,
                calls=(PARIS, LYON),
            ),
            FamilyReply(
                "<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>",
                content="It is sunny.",
            ),
        ),
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
    ),
    "gemma4": Family(
        "gemma4.jinja",
        (
            "<bos>",
            "<|turn>",
            "<turn|>",
            "<|channel>",
            "<channel|>",
            "<|think|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            GEMMA_QUOTE,
        ),
        "gemma4+<|channel>thought",
        (
            FamilyReply(
                f"<|channel>thought\n{THOUGHT}<channel|><|tool_call>call:get_weather"
                f"{{city:{GEMMA_QUOTE}Paris{GEMMA_QUOTE},days:2}}<tool_call|>",
                reasoning=THOUGHT,
                calls=(PARIS,),
                kwargs={"enable_thinking": True},
            ),
            FamilyReply("It is sunny.", content="It is sunny."),
        ),
        bos="<bos>",
        eos="<turn|>",
        rendered_argument=f"{GEMMA_QUOTE}Paris{GEMMA_QUOTE}",
    ),
    "qwen3_coder": Family(
        "qwen3_coder.jinja",
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        "qwen3_coder",
        (
            FamilyReply(
                "Let me check.\n\n<tool_call>\n<function=get_weather>\n"
                "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                "</parameter>\n</function>\n</tool_call>",
                content="Let me check.\n\n",
                calls=(PARIS,),
            ),
        ),
        eos="<|im_end|>",
        rendered_argument="\nParis\n",
    ),
    "glm4_7": Family(
        "glm4_7.jinja",
        (
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        "glm47+<think>",
        (
            FamilyReply(
                f"{THOUGHT}</think><tool_call>get_weather<arg_key>city</arg_key>"
                "<arg_value>Paris</arg_value><arg_key>days</arg_key>"
                "<arg_value>2</arg_value></tool_call>",
                reasoning=THOUGHT,
                calls=(PARIS,),
            ),
        ),
        rendered_argument="<arg_value>Paris</arg_value>",
    ),
    "minimax_m2": Family(
        "minimax_m2.jinja",
        (
            "]~!b[",
            "]~b]",
            "[e~[",
            "<think>",
            "</think>",
            "<minimax:tool_call>",
            "</minimax:tool_call>",
        ),
        "minimax_m2+<think>",
        (
            FamilyReply(
                f"{THOUGHT}\n</think>\n\n\n<minimax:tool_call>\n"
                '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>'
                '\n<parameter name="days">2</parameter>\n</invoke>\n'
                "</minimax:tool_call>",
                reasoning=f"{THOUGHT}\n",
                calls=(PARIS,),
            ),
        ),
        eos="[e~[",
        rendered_argument=">Paris</parameter>",
    ),
    "kimi_k2": Family(
        "kimi_k2.jinja",
        (
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            "<think>",
            "</think>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        "kimi_k2+<think>",
        (
            FamilyReply(
                f"<think>{THOUGHT}</think><|tool_calls_section_begin|>"
                "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                f"{PARIS[1]}<|tool_call_end|><|tool_calls_section_end|>",
                reasoning=THOUGHT,
                calls=(PARIS,),
            ),
        ),
        eos="<|im_end|>",
    ),
    "lfm2": Family(
        "lfm2.jinja",
        (
            "<|startoftext|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ),
        "pythonic",
        (
            FamilyReply(
                '<|tool_call_start|>[get_weather(city="Paris", days=2)]'
                "<|tool_call_end|>",
                calls=(PARIS,),
            ),
        ),
        bos="<|startoftext|>",
        eos="<|im_end|>",
        rendered_argument=None,
    ),
}


def make_family_folder(base: Path, folder: Path, family: Family) -> Path:
    tokens = dict(enumerate(family.tokens, start=3))
    template = (TEMPLATES / family.template).read_text()
    return make_chat_folder(base, folder, template, tokens, family.bos, family.eos)


def make_chat_folders(root: Path) -> dict[str, Path]:
    """A tiny random llama with the default model's tokenizer and chat template
    (``plain``: forced tokens and grammars, not the weights, decide what these chats
    say), and a chat folder for each template: ``json``, ``open`` (the turn opens
    inside thinking), ``coder`` and each of ``FAMILIES``."""
    base = make_tiny_draft(root / "plain", layers=2)
    templates = {
        "json": JSON_TEMPLATE,
        "open": OPEN_THINK_TEMPLATE,
        "coder": CODER_TEMPLATE,
    }
    folders = {"plain": base}
    folders |= {
        name: make_chat_folder(base, root / name, template)
        for name, template in templates.items()
    }
    for name, family in FAMILIES.items():
        folders[name] = make_family_folder(base, root / name, family)
    return folders
