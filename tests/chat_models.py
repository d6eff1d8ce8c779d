"""Chat models for tests of reasoning and tool calls: the default weights with
marker tokens (``<think>``, ``<tool_call>``) and a chat template each: Qwen-style
JSON calls, the same opening inside thinking, and Qwen3-Coder's XML calls; and a
reference reply with a thought and two calls (``REPLY``)."""

import json
from pathlib import Path

from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path

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


def make_chat_folders(root: Path) -> dict[str, Path]:
    """The default model exported under ``root``, and a chat folder for each
    template: ``json``, ``open`` (the turn opens inside thinking) and ``coder``."""
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
