"""Native GGUF loading: llama-architecture GGUF files onto mlx-lm's llama model.

MLX reads GGUF itself (``mx.load``); Q4_0, Q4_1 and Q8_0 tensors arrive in MLX's
quantized layout, so the weights are used as they are, without dequantizing.
The tokenizer is rebuilt from the GGUF metadata with the ``tokenizers`` library
and handed to mlx-lm's own tokenizer loader, so streaming detokenization and
marker detection work as for any MLX folder.
"""

import json
import logging
import math
import mmap
import re
import struct
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import _get_classes
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from mlx_backend.models.tokenizers import file_key, reuse_tokenizer
from mlx_backend.refusals import Described
from mlx_utils import dequantize_to_float32

logger = logging.getLogger(__name__)

# GGUF block size for Q4_0, Q4_1 and Q8_0.
GGUF_GROUP_SIZE = 32
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


_GGUF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_GGUF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
# general.file_type of a file whose tensors are F16 (llama.cpp's LLAMA_FTYPE_MOSTLY_F16).
_F16_FILE = 1


class GGUFError(ValueError, Described):
    """The GGUF file is not one this loader supports. Its message never quotes the
    file: a name or value read from it is shown only when it is one this module
    knows (an architecture, a tensor type), so any file can be refused safely."""


# Names that a refusal may show when the file holds them: llama.cpp's other
# architectures and tokenizer models, and its tensor types.
_KNOWN_ARCHITECTURES = frozenset(
    "baichuan bert bloom chatglm command-r cohere2 deepseek deepseek2 exaone falcon "
    "gemma gemma2 gemma3 gemma3n gpt2 gptj gptneox granite granitemoe grok internlm2 "
    "jamba mamba minicpm mistral3 mpt nemotron olmo olmo2 olmoe phi2 phi3 phimoe "
    "qwen qwen2 qwen2moe qwen3 qwen3moe refact rwkv6 stablelm starcoder starcoder2 "
    "t5".split()
)
_KNOWN_TOKENIZERS = frozenset("llama gpt2 bert t5 rwkv plamo2 none".split())
_GGML_TYPES = dict(
    enumerate(
        "F32 F16 Q4_0 Q4_1 Q4_2 Q4_3 Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K "
        "IQ2_XXS IQ2_XS IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ2_S IQ4_XS I8 I16 I32 I64 F64 "
        "IQ1_M BF16".split()
    )
)


def _named(what: str, value, names: frozenset[str]) -> str:
    """``what`` with ``value`` quoted when it is one of ``names``: anything else
    read from the file stays unquoted."""
    return f"{what} {value!r}" if isinstance(value, str) and value in names else what


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def translate_name(name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.scales``) to mlx-lm's llama names."""
    base, suffix = name.rsplit(".", 1)
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match:
        layer, part = match.groups()
        if part not in _LAYER_NAMES:
            raise GGUFError("a tensor of a layer is not one a llama layer has")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise GGUFError("a tensor is not one a llama model has")
    return f"{_TOP_NAMES[base]}.{suffix}"


def gguf_name(name: str) -> str:
    """``translate_name``'s inverse: mlx-lm's llama name to the GGUF tensor name."""
    base, suffix = name.rsplit(".", 1)
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if match:
        layer, part = match.groups()
        return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{suffix}"
    return f"{_GGUF_TOP_NAMES[base]}.{suffix}"


def save_gguf_f16(weights: dict[str, mx.array], base: str | Path, path: Path) -> None:
    """Write llama ``weights`` (as ``load_gguf`` names and lays them out) as an
    F16 GGUF file that keeps the ``base`` GGUF's metadata: its architecture,
    hyperparameters and tokenizer. Norms stay float32, as llama.cpp writes them."""
    _, metadata = mx.load(str(base), format="gguf", return_metadata=True)
    metadata = {**metadata, "general.file_type": mx.array(_F16_FILE, mx.uint32)}
    metadata.pop("general.quantization_version", None)
    tensors = {
        gguf_name(k): v.astype(mx.float32 if "norm" in k else mx.float16)
        for k, v in weights.items()
    }
    mx.save_gguf(str(path), tensors, metadata)


def make_config(metadata: dict, weights: dict) -> dict:
    """An mlx-lm llama config from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{_named('the GGUF architecture', arch, _KNOWN_ARCHITECTURES)} is not "
            "supported (only 'llama' is)"
        )

    def meta(key, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata 'llama.{key}' is missing")
        return _scalar(value)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    vocab = metadata.get("llama.vocab_size")
    if vocab is None:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("rope.dimension_count", hidden // heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 4096),
        "vocab_size": _scalar(vocab),
        # GGUF permutes q/k for interleaved RoPE.
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in weights,
    }


def _quantization_of(weights: dict, path: str) -> dict | None:
    scales = weights.get(f"{path}.scales")
    if scales is None:
        return None
    packed = weights[f"{path}.weight"]
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits = packed.shape[-1] * 32 // in_features
    return {"group_size": GGUF_GROUP_SIZE, "bits": bits}


def make_model(config: dict, weights: dict) -> nn.Module:
    """Build mlx-lm's model for ``config`` and load GGUF ``weights`` into it."""
    weights = {translate_name(k): v for k, v in weights.items()}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    nn.quantize(
        model,
        class_predicate=lambda path, module: (
            hasattr(module, "to_quantized") and _quantization_of(weights, path)
        )
        or False,
    )
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def _make_pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre not in (None, "default", "gpt2"):
        logger.warning(
            "GGUF pre-tokenizer %r is approximated by GPT-2 byte-level splitting", pre
        )
    return byte_level


def make_hf_tokenizer(metadata: dict) -> tuple[Tokenizer, dict]:
    """A byte-level BPE ``tokenizers.Tokenizer`` and its tokenizer_config."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{_named('the GGUF tokenizer model', kind, _KNOWN_TOKENIZERS)} is not "
            "supported (only byte-level BPE 'gpt2')"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else []

    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = _make_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _USER_DEFINED
        ]
    )

    def token(key):
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else tokens[_scalar(value)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", 0))),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(metadata.get("llama.context_length", 4096)),
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer, {k: v for k, v in config.items() if v is not None}


def gguf_tokenizer(metadata: dict) -> TokenizerWrapper:
    """The GGUF's tokenizer as mlx-lm loads it, with its end-of-sequence token."""
    eos = _scalar(metadata.get("tokenizer.ggml.eos_token_id"))
    with tempfile.TemporaryDirectory(prefix="gguf-tokenizer-") as folder:
        save_tokenizer(metadata, Path(folder))
        return load_tokenizer(
            Path(folder), eos_token_ids=[eos] if eos is not None else None
        )


def save_tokenizer(metadata: dict, folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF tokenizer."""
    tokenizer, config = make_hf_tokenizer(metadata)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# GGUF metadata value types: the scalars' sizes, strings and arrays.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_STRING_LENGTH = struct.Struct("<Q")
# Tensor types MLX reads (F32, F16, Q4_0, Q4_1, Q8_0): (values, bytes) per block.
_TENSOR_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}
# The smallest tensor-table entry: a name length, one dimension, a type, an offset.
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8


class _GGUFWalker:
    """Reads a GGUF file's header within its bounds; every overrun is a GGUFError."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.pos = 0

    def check_room(self, size: int) -> None:
        if size > len(self.data) - self.pos:
            raise GGUFError(f"the file is truncated or corrupt at byte {self.pos}")

    def take(self, size: int) -> int:
        self.check_room(size)
        self.pos += size
        return self.pos - size

    def unpack(self, fmt: str) -> int:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def skip_strings(self, count: int) -> None:
        # A vocabulary's array holds ~50k strings: one tight loop, not calls each.
        data, pos, end, length = self.data, self.pos, len(self.data), _STRING_LENGTH
        for _ in range(count):
            if pos + 8 > end:
                break
            size = length.unpack_from(data, pos)[0]
            pos += 8
            if size > end - pos:
                break
            pos += size
        else:
            self.pos = pos
            return
        raise GGUFError(f"the file is truncated or corrupt at byte {pos}")

    def string(self) -> bytes:
        size = self.unpack("<Q")
        start = self.take(size)
        return self.data[start : start + size]

    def value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[kind])
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALAR_BYTES:
                self.take(count * _SCALAR_BYTES[item])
            elif item == _STRING:
                self.check_room(count * 8)  # each string has its length
                self.skip_strings(count)
            else:
                raise GGUFError("a metadata array has an unknown item type")
        else:
            raise GGUFError("a metadata value has an unknown type")


def check_gguf(path: str | Path) -> None:
    """Check that a GGUF file's metadata and tensors lie inside the file.

    MLX's GGUF reader trusts every length it reads, so a corrupt or truncated file
    would crash the process; this walks the header in Python first.

    Raises:
        GGUFError: The file is corrupt, truncated, or holds unsupported tensors.
    """
    with open(path, "rb") as file:
        if Path(path).stat().st_size < 24:
            raise GGUFError("the file is too short for a GGUF header")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            walker = _GGUFWalker(data)
            magic, version = data[:4], walker.unpack("<4xI")
            if magic != b"GGUF":
                raise GGUFError("not a GGUF file (it does not start with GGUF)")
            if version not in (2, 3):
                raise GGUFError("not a GGUF file of version 2 or 3")
            tensors, pairs = walker.unpack("<Q"), walker.unpack("<Q")
            alignment = 32
            for _ in range(pairs):
                key, kind = walker.string(), walker.unpack("<I")
                if key == b"general.alignment" and kind == _UINT32:
                    alignment = walker.unpack("<I") or 32
                else:
                    walker.value(kind)
            walker.check_room(tensors * _MIN_TENSOR_INFO)
            table = []
            # Tensors are named by their place in the table: their names are the
            # file's bytes.
            for i in range(tensors):
                walker.string()
                dims = walker.unpack("<I")
                if not 1 <= dims <= 4:
                    raise GGUFError(f"tensor {i} does not have 1 to 4 dimensions")
                shape = [walker.unpack("<Q") for _ in range(dims)]
                kind, offset = walker.unpack("<I"), walker.unpack("<Q")
                if kind not in _TENSOR_BLOCKS:
                    supported = ", ".join(_GGML_TYPES[k] for k in _TENSOR_BLOCKS)
                    raise GGUFError(
                        f"tensor {i} is of type {_GGML_TYPES.get(kind, 'unknown')}; "
                        f"MLX reads {supported}"
                    )
                values, block = _TENSOR_BLOCKS[kind]
                blocks, rest = divmod(math.prod(shape), values)
                if rest:
                    raise GGUFError(f"tensor {i} is not whole blocks")
                table.append((i, offset, blocks * block))
            start = -(-walker.pos // alignment) * alignment
            for i, offset, size in table:
                if start + offset + size > len(data):
                    raise GGUFError(f"tensor {i} runs past the end of the file")


def load_gguf(path: str | Path) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load a llama-architecture GGUF file.

    Args:
        path: The GGUF file, whatever its name.

    Returns:
        The mlx-lm model, its ``TokenizerWrapper`` and the model config.
    """
    check_gguf(path)
    try:
        weights, metadata = mx.load(str(path), format="gguf", return_metadata=True)
        config = make_config(metadata, weights)
        model = make_model(config, weights)
        tokenizer = reuse_tokenizer(
            file_key(Path(path)), partial(gguf_tokenizer, metadata)
        )
    except GGUFError:
        raise
    except Exception as e:
        # MLX's, mlx-lm's and tokenizers' messages may quote the metadata.
        logger.warning("building a model from %s failed", path, exc_info=True)
        raise GGUFError(
            "its metadata and tensors don't make a llama model and tokenizer "
            f"({type(e).__name__}, details in the server log)"
        ) from e
    logger.info(
        "loaded GGUF %s: %d layers, hidden %d, vocab %d",
        path,
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    return model, tokenizer, config


def export_mlx_folder(
    path: str | Path, folder: str | Path, dequantize: bool = False
) -> Path:
    """Write a GGUF model as an MLX-format folder that ``mlx_lm.load`` reads.

    Args:
        path: The ``.gguf`` file.
        folder: The output folder; created if missing.
        dequantize: Write float32 weights, as the fast Linux CPU path runs them.

    Returns:
        The output folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    check_gguf(path)
    weights, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    config = make_config(metadata, weights)
    if dequantize:
        model = dequantize_to_float32(make_model(config, weights))
        weights = dict(tree_flatten(model.parameters()))
    else:
        weights = {translate_name(k): v for k, v in weights.items()}
    quantization = {}
    for name in weights:
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            quantization[module] = _quantization_of(weights, module)
    if quantization:
        first = next(iter(quantization.values()))
        config["quantization"] = {**first, **quantization}
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = _scalar(eos)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(metadata, folder)
    return folder
