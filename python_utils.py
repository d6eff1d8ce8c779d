"""Option parsing and message conversion: LoadModel options, request fields, chats."""

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.registry import check_format_options
from mlx_backend.formats.rerank import RERANKER_FORMS
from mlx_backend.switches import parse_bool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """Typed LoadModel ``Options``; every field is documented in README.md."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_context_size: int = 64
    max_tokens: int | None = None
    # None: the compute path's default (cpu/compute_path.py).
    prefill_step_size: int | None = None
    # Decoding over paged KV with one forward pass per step for decode rows and
    # prompt chunks alike (decoders/paged.py); None ("auto"): the device's default.
    paged: bool | None = None
    # What the paged decoder's pages store keys and values as: "auto" (the
    # model's KV dtype, as mlx-lm keeps it), "float32" or "float16" (half the
    # bytes that attention reads at depth; llama.cpp's default KV type).
    kv_dtype: str = "auto"
    # The float KV type CacheTypeKey/Value name ("float16" for f16, "float32" for
    # f32): the paged decoder's pages take it where kv_dtype is auto; the batch
    # decoder keeps the model's KV type.
    cache_float: str | None = None
    # Continuous batching: sequences decoded together, and prompts prefilled together.
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    # Prompt and decode tokens a step carries while sequences decode (None:
    # measured at load, 0: none; decoders/step_budget.py).
    step_token_budget: int | None = None
    # Bytes for the weights, KV, prompt cache and a prefill step together (None:
    # a share of the device's memory; engine/memory_budget.py).
    memory_budget: int | None = None
    max_kv_size: int | None = None
    # Quantized KV caches (quantized_kv.py): bits (None: full precision) and the
    # group size (None: 64, mlx-lm's default). CacheTypeKey/Value set them too.
    kv_bits: int | None = None
    kv_group_size: int | None = None
    # Tokens a sequence's KV cache holds at full precision before it is quantized.
    quantized_kv_start: int = 0
    # LoRA adapters (lora.py) are folded into the weights instead of wrapping them.
    fuse_lora: bool = False
    # A folder that keeps the prompt cache's entries across restarts, and may hold
    # PromptCachePath files (caches/prompt_files.py).
    prompt_cache_dir: str = ""
    # The prompt cache: 0 entries turns it off; bytes default to a share of RAM.
    max_cache_entries: int = 10
    max_cache_bytes: int | None = None
    enable_thinking: bool | None = None
    # The tool-call framing (formats/registry.py: one of ours, one of mlx-lm's
    # parsers, or "none") and the reasoning markers ("think", "mistral", "command",
    # "harmony" or "none"); "" keeps what the registry detects.
    tool_parser: str = ""
    reasoning: str = ""
    trust_remote_code: bool = False
    # BLAS threads (ModelOptions.Threads; 0: the physical cores).
    threads: int = 0
    # CPU decode steps wait for the previous token before building the rest of the
    # step: "on", "off", or "auto" (measured at load, cpu/pacing.py).
    cpu_pacing: str = "auto"
    # Linux CPU: quantized weights run on the SIMD kernels (cpu/kernels) unless
    # dequantize is true (float32 for the BLAS). Without the kernels, None
    # dequantizes when the float32 weights fit dequantize_max_bytes.
    dequantize: bool | None = None
    dequantize_max_bytes: int | None = None
    # What the SIMD kernels multiply weights with: "auto" (int8 wherever it
    # measures faster at load, decoding and prefilling apart; the host's
    # MLX_BACKEND_KERNEL_ACTIVATIONS may pin it), "float32" x, or x rounded per
    # group to "int16" (logprobs move by up to 0.004) or to "int8" (integer dot
    # products; a mean KL of about 0.0004 decoding, 0.0008 prefilling, on the
    # default model), docs/cpu-kernels.md.
    kernel_activations: str = "auto"
    # Embedding: how the final hidden states are pooled ("mean" or "last").
    embedding_pooling: str = "mean"
    # Rerank (formats/rerank.py): the form a causal-LM reranker judges documents in
    # ("qwen3", "yes_no"; "": the model is no reranker), and the instruction it gets
    # ("": the form's default).
    reranker: str = ""
    rerank_instruction: str = ""
    # Replies a stream may hold unread by its client before it is ended.
    max_stream_backlog: int = 256
    # Requests that share a long prompt prefix prefill it once (engine/scheduler.py).
    prefix_sharing: bool = True
    # KV caches that can't be trimmed (sliding windows, recurrent state): prefill
    # keeps snapshots of the prompt's state at its end and every snapshot_interval
    # tokens (0: at its end only; caches/kinds.py); false for comparison.
    prompt_snapshots: bool = True
    snapshot_interval: int = 1024
    # Speculative decoding (speculative.py): "auto", "ngram", "draft" or "off"; proposed
    # tokens verified per step at most, and the n-gram sizes prompt lookup matches.
    speculative: str = "auto"
    num_draft_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    # Serving over an MLX distributed group (distributed/): MLX's hostfile JSON
    # (or the env MLX_DISTRIBUTED_HOSTFILE), "ring", "jaccl" or "mpi" (or the env
    # MLX_DISTRIBUTED_BACKEND), "auto", "tensor" or "pipeline", the seconds the
    # workers have to join, and the seconds a step may take before it counts as hung.
    hostfile: str = ""
    distributed_backend: str = ""
    distributed_mode: str = "auto"
    distributed_timeout: float = 60.0
    distributed_step_timeout: float = 20.0


# String options that are paths, whose case matters.
_CASE_SENSITIVE = {"hostfile", "prompt_cache_dir", "rerank_instruction"}
_OPTION_ALIASES = {"temp": "temperature", "penalty": "repetition_penalty"}


# LocalAI's configs name vLLM's parsers; mlx-lm's json_tools reads Hermes-style calls.
def parse_options(options: list[str] | tuple[str, ...]) -> LoadOptions:
    """Parse LoadModel ``key:value`` strings into ``LoadOptions``.

    Unknown keys are logged and ignored, so LocalAI configs shared with other
    backends still load; a known key with a bad value is an InvalidArgument.
    """
    fields = {f.name: f for f in dataclasses.fields(LoadOptions)}
    values: dict[str, Any] = {}
    for entry in options:
        key, sep, raw = entry.partition(":")
        key = _OPTION_ALIASES.get(key.strip(), key.strip())
        if not sep:
            raise InvalidArgument(f"Options: {entry!r} is not in key:value form")
        if key not in fields:
            logger.warning("ignoring unknown LoadModel option %r", key)
            continue
        kind = fields[key].type
        try:
            if "bool" in str(kind) and "None" in str(kind) and raw.strip() == "auto":
                values[key] = None
            elif "bool" in str(kind):
                values[key] = parse_bool(raw)
            elif "int" in str(kind):
                values[key] = int(raw.strip())
            elif key in _CASE_SENSITIVE:
                values[key] = raw.strip()
            elif "str" in str(kind):
                values[key] = raw.strip().lower()
            else:
                values[key] = float(raw.strip())
        except ValueError as e:
            raise InvalidArgument(f"Options: {key}: {e}") from None
    parsed = LoadOptions(**values)
    for name in (
        "prefill_step_size",
        "max_batch_size",
        "prefill_batch_size",
        "repetition_context_size",
        "max_kv_size",
        "dequantize_max_bytes",
        "max_stream_backlog",
        "ngram_min",
        "memory_budget",
    ):
        value = getattr(parsed, name)
        if value is not None and value < 1:
            raise InvalidArgument(f"Options: {name} must be at least 1")
    for name in (
        "max_tokens",
        "max_cache_entries",
        "max_cache_bytes",
        "num_draft_tokens",
        "quantized_kv_start",
        "threads",
        "snapshot_interval",
        "step_token_budget",
    ):
        value = getattr(parsed, name)
        if value is not None and value < 0:
            raise InvalidArgument(f"Options: {name} must not be negative")
    for name in SAMPLING_RANGES:
        value = getattr(parsed, name)
        if value is not None:
            check_sampling(f"Options: {name}", name, value)
    check_kv_quantization(parsed)
    if parsed.speculative not in SPECULATIVE_MODES:
        raise InvalidArgument(
            f"Options: speculative must be one of {', '.join(SPECULATIVE_MODES)}"
        )
    if parsed.cpu_pacing not in CPU_PACING_MODES:
        raise InvalidArgument(
            f"Options: cpu_pacing must be one of {', '.join(CPU_PACING_MODES)}"
        )
    if parsed.kv_dtype not in KV_DTYPES:
        raise InvalidArgument(
            f"Options: kv_dtype must be one of {', '.join(KV_DTYPES)}"
        )
    if parsed.kernel_activations not in KERNEL_ACTIVATIONS:
        raise InvalidArgument(
            "Options: kernel_activations must be one of "
            + ", ".join(KERNEL_ACTIVATIONS)
        )
    tool_parser, reasoning = check_format_options(parsed.tool_parser, parsed.reasoning)
    parsed = dataclasses.replace(parsed, tool_parser=tool_parser, reasoning=reasoning)
    if parsed.num_draft_tokens > MAX_DRAFT_TOKENS:
        raise InvalidArgument(
            f"Options: num_draft_tokens must be at most {MAX_DRAFT_TOKENS}"
        )
    if parsed.ngram_max < parsed.ngram_min:
        raise InvalidArgument("Options: ngram_max must be at least ngram_min")
    if parsed.distributed_backend not in ("", *DISTRIBUTED_BACKENDS):
        raise InvalidArgument(
            "Options: distributed_backend must be one of "
            f"{', '.join(DISTRIBUTED_BACKENDS)}"
        )
    if parsed.distributed_mode not in DISTRIBUTED_MODES:
        raise InvalidArgument(
            f"Options: distributed_mode must be one of {', '.join(DISTRIBUTED_MODES)}"
        )
    for name in ("distributed_timeout", "distributed_step_timeout"):
        if not getattr(parsed, name) > 0:
            raise InvalidArgument(f"Options: {name} must be positive")
    if parsed.reranker not in ("", *RERANKER_FORMS):
        raise InvalidArgument(
            f"Options: reranker must be one of {', '.join(RERANKER_FORMS)}"
        )
    if parsed.embedding_pooling not in EMBEDDING_POOLINGS:
        raise InvalidArgument(
            f"Options: embedding_pooling must be one of {', '.join(EMBEDDING_POOLINGS)}"
        )
    return parsed


KV_BITS = (2, 3, 4, 5, 6, 8)
KV_DTYPES = ("auto", "float32", "float16")
KV_GROUP_SIZES = (32, 64, 128)
# llama.cpp's cache type names, as LocalAI sends them in CacheTypeKey and
# CacheTypeValue, as MLX (bits, group size); None keeps full precision, in the
# float type CACHE_FLOATS names where pages can store it.
CACHE_TYPES = {
    "f32": None,
    "f16": None,
    "bf16": None,
    "q8_0": (8, 32),
    "q5_0": (5, 32),
    "q5_1": (5, 32),
    "q4_0": (4, 32),
    "q4_1": (4, 32),
    "iq4_nl": (4, 32),
}
CACHE_FLOATS = {"f32": "float32", "f16": "float16"}


def check_kv_quantization(options: LoadOptions) -> None:
    if options.kv_bits is not None and options.kv_bits not in KV_BITS:
        raise InvalidArgument(
            f"Options: kv_bits must be one of {', '.join(map(str, KV_BITS))}"
        )
    if (
        options.kv_group_size is not None
        and options.kv_group_size not in KV_GROUP_SIZES
    ):
        raise InvalidArgument(
            "Options: kv_group_size must be one of "
            f"{', '.join(map(str, KV_GROUP_SIZES))}"
        )
    if options.kv_bits is not None and options.max_kv_size is not None:
        raise InvalidArgument(
            "Options: max_kv_size can't be combined with a quantized KV cache "
            "(kv_bits, CacheTypeKey or CacheTypeValue): rotating caches stay unquantized"
        )


def apply_cache_types(options: LoadOptions, key: str, value: str) -> LoadOptions:
    """``options`` with the KV quantization that ``CacheTypeKey`` and
    ``CacheTypeValue`` name, unless the option ``kv_bits`` already sets one.

    MLX quantizes keys and values alike: when the two differ, the finer one
    serves both.
    """
    chosen = []
    for field, name in (("CacheTypeKey", key), ("CacheTypeValue", value)):
        name = name.strip().lower()
        if not name:
            continue
        if name not in CACHE_TYPES:
            raise InvalidArgument(
                f"{field}: unknown cache type {name!r} "
                f"(known: {', '.join(CACHE_TYPES)})"
            )
        chosen.append((CACHE_TYPES[name], field, name))
    if not chosen or options.kv_bits is not None:
        return options
    # None (full precision) is the finest; then the most bits.
    finest = max(chosen, key=lambda c: (c[0] is None, c[0] or (0, 0)))
    if len({c[0] for c in chosen}) > 1:
        logger.warning(
            "%s and %s differ; MLX quantizes keys and values alike, so both use %s",
            *(f"{field}={name}" for _, field, name in chosen),
            finest[2],
        )
    if finest[0] is None:
        return dataclasses.replace(options, cache_float=CACHE_FLOATS.get(finest[2]))
    bits, group_size = finest[0]
    updated = dataclasses.replace(
        options, kv_bits=bits, kv_group_size=options.kv_group_size or group_size
    )
    check_kv_quantization(updated)
    return updated


# The accepted range of each sampling value. A value outside it is refused, never
# clamped; the OpenAI fields keep OpenAI's ranges.
SAMPLING_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, math.inf),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}


def check_sampling(field: str, name: str, value: float) -> float:
    """``value`` when it is finite and inside ``SAMPLING_RANGES[name]``."""
    low, high = SAMPLING_RANGES[name]
    if not math.isfinite(value) or not low <= value <= high:
        bounds = f"at least {low:g}" if high == math.inf else f"{low:g} to {high:g}"
        raise InvalidArgument(f"{field} must be a finite number, {bounds}; got {value}")
    return value


EMBEDDING_POOLINGS = ("mean", "last")
SPECULATIVE_MODES = ("auto", "ngram", "draft", "off")
CPU_PACING_MODES = ("auto", "on", "off")
KERNEL_ACTIVATIONS = ("auto", "float32", "int16", "int8")
DISTRIBUTED_BACKENDS = ("ring", "jaccl", "mpi")
DISTRIBUTED_MODES = ("auto", "tensor", "pipeline")
# Proposed tokens one step may verify, at most (LoadModel option and NDraft).
MAX_DRAFT_TOKENS = 32
# OpenAI's limit on alternatives per token.
MAX_TOP_LOGPROBS = 20


def parse_logprobs(logprobs: int, top_logprobs: int) -> int | None:
    """How many alternatives each token's logprob entry lists; None: no logprobs."""
    if logprobs < 0:
        raise InvalidArgument("Logprobs must not be negative")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"TopLogprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if logprobs == 0 and top_logprobs == 0:
        return None
    return top_logprobs


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds from ``500ms``, ``2s``, ``1m`` or a plain number of seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


# Deeper JSON is refused: chat templates, tool parsers and grammar compilers
# recurse over what a request sends.
MAX_JSON_DEPTH = 100


def load_json(field: str, text: str) -> Any:
    """``json.loads`` that refuses nesting deeper than ``MAX_JSON_DEPTH``, naming
    the field; malformed JSON raises ``json.JSONDecodeError`` as usual. The depth
    is read off the text first: deep enough, Python 3.11 and 3.12 raise
    RecursionError while 3.13 reports the text as malformed."""
    if json_nesting(text) > MAX_JSON_DEPTH:
        raise InvalidArgument(
            f"{field}: JSON nested deeper than {MAX_JSON_DEPTH} levels"
        )
    return json.loads(text)


def parse_json_field(field: str, text: str) -> Any:
    """Decode a JSON request field, naming the field when it is malformed."""
    try:
        return load_json(field, text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{field}: malformed JSON: {e}") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_nesting(text: str) -> int:
    """How deeply arrays and objects nest in JSON text (a scalar is 0): its
    brackets outside strings."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _decode_tool_calls(index: int, text: str) -> list[dict]:
    field = f"Messages[{index}].tool_calls"
    calls = parse_json_field(field, text)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise InvalidArgument(f"{field}: expected a JSON array of tool calls")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidArgument(f"{field}: each tool call needs a 'function' object")
        arguments = function.get("arguments")
        # Templates iterate over arguments, so they must be a dict, not JSON text.
        if isinstance(arguments, str):
            arguments = (
                parse_json_field(f"{field}.arguments", arguments)
                if arguments.strip()
                else {}
            )
            function["arguments"] = arguments
    return calls


def convert_messages(messages) -> list[dict]:
    """Proto ``Message``s to the dicts chat templates expect."""
    converted = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name:
            item["name"] = message.name
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning_content:
            # transformers copies it to gpt-oss's "thinking"; Command's is "tool_plan".
            item["reasoning_content"] = message.reasoning_content
            item["tool_plan"] = message.reasoning_content
        if message.tool_calls:
            item["tool_calls"] = _decode_tool_calls(i, message.tool_calls)
        converted.append(item)
    return converted


def arguments_as_text(messages: list[dict]) -> list[dict]:
    """``messages`` with each call's arguments as JSON text, for templates that join
    them to a string (DeepSeek V3.1's)."""
    converted = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": json.dumps(
                            call["function"].get("arguments", {}), ensure_ascii=False
                        ),
                    },
                }
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        converted.append(message)
    return converted


def tools_into_system(messages: list[dict], tools: list) -> list[dict]:
    """``messages`` with ``tools`` as JSON on the system message, for templates that
    read them there (Phi-4-mini's); a system message is added if there is none."""
    if messages and messages[0]["role"] == "system":
        system, rest = dict(messages[0]), messages[1:]
    else:
        system, rest = {"role": "system", "content": ""}, messages
    system["tools"] = json.dumps(tools, ensure_ascii=False)
    return [system, *rest]


def parse_tools(text: str) -> list | None:
    if not text.strip():
        return None
    tools = parse_json_field("Tools", text)
    if not isinstance(tools, list):
        raise InvalidArgument("Tools: expected a JSON array of tools")
    return tools or None


def parse_tool_choice(text: str) -> str | dict | None:
    """``ToolChoice`` is JSON (a quoted mode or an object); a bare mode is accepted."""
    text = text.strip()
    if not text:
        return None
    if text[0] not in '"{[':
        return text
    return parse_json_field("ToolChoice", text)


def parse_logit_bias(text: str, vocab_size: int) -> dict[int, float]:
    """``LogitBias`` JSON to ``{token_id: bias}``; ids outside the vocabulary are ignored."""
    if not text.strip():
        return {}
    raw = parse_json_field("LogitBias", text)
    if not isinstance(raw, dict):
        raise InvalidArgument("LogitBias: expected a JSON object of token id to bias")
    bias = {}
    for key, value in raw.items():
        try:
            token, amount = int(key), float(value)
        except (TypeError, ValueError):
            token, amount = -1, math.nan
        if not math.isfinite(amount):
            raise InvalidArgument(
                f"LogitBias: {key!r}: {value!r} is not a token id and a finite number"
            )
        if 0 <= token < vocab_size:
            bias[token] = amount
    return bias


@dataclass(frozen=True)
class TemplateArgs:
    """What a chat request hands the chat template besides the messages."""

    tools: list | None = None
    enable_thinking: bool | None = None
    extra: dict = dataclasses.field(default_factory=dict)


# apply_chat_template's own arguments (transformers 5): chat_template_kwargs may only
# add template variables, never swap the template or change what rendering returns.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def parse_template_args(
    tools: str, tool_choice: str, metadata: dict, default_thinking: bool | None
) -> TemplateArgs:
    parsed_tools = parse_tools(tools)
    if parse_tool_choice(tool_choice) == "none":
        parsed_tools = None
    thinking = default_thinking
    if "enable_thinking" in metadata:
        try:
            thinking = parse_bool(metadata["enable_thinking"])
        except ValueError:
            raise InvalidArgument(
                "Metadata.enable_thinking: expected 'true' or 'false'"
            ) from None
    extra = {}
    if metadata.get("chat_template_kwargs", "").strip():
        extra = parse_json_field(
            "Metadata.chat_template_kwargs", metadata["chat_template_kwargs"]
        )
        if not isinstance(extra, dict):
            raise InvalidArgument(
                "Metadata.chat_template_kwargs: expected a JSON object"
            )
        reserved = sorted(TEMPLATE_ARGUMENTS & extra.keys())
        if reserved:
            raise InvalidArgument(
                f"Metadata.chat_template_kwargs: {reserved[0]!r} is an argument of "
                "apply_chat_template, not a template variable"
            )
    if metadata.get("reasoning_effort"):
        extra = {"reasoning_effort": metadata["reasoning_effort"], **extra}
    return TemplateArgs(tools=parsed_tools, enable_thinking=thinking, extra=extra)


def render_chat(tokenizer, messages: list[dict], args: TemplateArgs) -> list[int]:
    """Token ids of the chat template applied to ``messages``.

    The template writes any BOS itself, so no special tokens are added again.
    """
    kwargs = dict(args.extra)
    if args.enable_thinking is not None:
        kwargs["enable_thinking"] = args.enable_thinking
    try:
        return list(
            tokenizer.apply_chat_template(
                messages,
                tools=args.tools,
                add_generation_prompt=True,
                tokenize=True,
                **kwargs,
            )
        )
    except Exception as e:
        raise InvalidArgument(f"Messages: the chat template failed: {e}") from e


SAMPLE_CHAT = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
)


def render_sample_chat(tokenizer) -> str:
    """The chat template rendered with thinking on for a short sample conversation."""
    if not tokenizer.has_chat_template:
        return ""
    return tokenizer.apply_chat_template(
        list(SAMPLE_CHAT),
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=True,
    )


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a raw prompt, adding BOS only if the text lacks it."""
    bos = tokenizer.bos_token
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))
