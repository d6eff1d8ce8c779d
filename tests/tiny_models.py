"""Tiny llamas that tests build: the config (``TINY_LLAMA``); a random draft model
with the default model's tokenizer (``make_tiny_draft``) and ``FLAT``, the
speculative decoders' costs tests run drafts with; the default model's first
layers alone (``make_short_default``); the same random tiny llama on every
call (``tiny_model``) with LoRA adapters for it (``write_adapter``); and a reranker
whose answers a marker word sets (``make_marker_reranker``)."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import load_tokenizer

from mlx_backend.models.gguf import export_mlx_folder, save_tokenizer
from mlx_backend.models.loading import default_model_path

# Speculative decoders' costs where every k costs one pass: each step verifies all
# it can, so runs are long and the same on every machine.
FLAT = (1.0,) * 9

# make_marker_reranker's "yes": the marker's share of the positions times the gain,
# less the bias, over the final norm's scale.
MARKER_GAIN = 40.0
MARKER_BIAS = 0.5

# A llama small enough to build in a test; the tests set its vocabulary.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def make_tiny_draft(
    folder: Path,
    vocabulary_changed: bool = False,
    layers: int = 1,
    seed: int = 0,
    width: int = TINY_LLAMA["hidden_size"],
) -> Path:
    """A llama of ``layers`` layers of ``width`` with random weights (the same for
    a ``seed``) and the default model's tokenizer: a draft model whose proposals are mostly
    wrong, or a model whose head counts divide by 2. ``vocabulary_changed`` adds a
    token, so its vocabulary differs from the model's."""
    config = {
        **TINY_LLAMA,
        "num_hidden_layers": layers,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    save_tokenizer(metadata, folder)
    if vocabulary_changed:
        path = folder / "tokenizer.json"
        tokenizer = json.loads(path.read_text())
        tokenizer["added_tokens"].append(
            {
                "id": 49152,
                "content": "<draft-only>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        path.write_text(json.dumps(tokenizer))
    return folder


def make_short_default(folder: Path, layers: int = 4) -> Path:
    """The embedded model's first ``layers`` layers, its embedding and its tokenizer,
    exported as an MLX folder: the default model's shapes and quantization (9 query
    heads, 3 KV heads, 4-bit weights in groups of 32) at a fraction of its passes."""
    export_mlx_folder(default_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    dropped = tuple(f"model.layers.{i}." for i in range(layers, 64))

    def kept(name: str) -> bool:
        return not f"{name}.".startswith(dropped)

    config["num_hidden_layers"] = layers
    config["quantization"] = {
        k: v for k, v in config["quantization"].items() if kept(k)
    }
    path = str(folder / "model.safetensors")
    weights = {k: v for k, v in mx.load(path).items() if kept(k)}
    mx.save_safetensors(path, weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tiny_quantized_llama(tie: bool = True) -> llama.Model:
    """A random 2-layer llama, 4-bit in groups of 32 (the kernels' format); with
    ``tie`` false, its output layer apart from the embedding."""
    config = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 96}
    config.update(vocab_size=50, tie_word_embeddings=tie)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


# -- LoRA adapters for a tiny llama ----------------------------------------------


def tiny_model() -> llama.Model:
    """The same random tiny llama on every call."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY_LLAMA, "vocab_size": 64}))
    mx.eval(model.parameters())
    return model


def write_adapter(
    folder: Path,
    seed: int,
    own_scale: float = 2.0,
    rank: int = 4,
    config: dict | None = None,
    weights: dict | None = None,
) -> Path:
    """An adapter as mlx_lm.lora saves one, for every linear of the tiny llama's
    layers, with random nonzero lora_b (mlx-lm starts it at zero)."""
    folder.mkdir(parents=True)
    config = config or {
        "fine_tune_type": "lora",
        "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": own_scale, "dropout": 0.0},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if weights is None:
        mx.random.seed(seed)
        weights = {}
        for name, module in tiny_model().named_modules():
            if name.startswith("model.layers.") and isinstance(module, nn.Linear):
                out_dims, in_dims = module.weight.shape
                bound = in_dims**-0.5
                a = mx.random.uniform(-bound, bound, (in_dims, rank))
                weights[f"{name}.lora_a"] = a
                weights[f"{name}.lora_b"] = 0.05 * mx.random.normal((rank, out_dims))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


def make_marker_reranker(folder: Path, marker: str) -> Path:
    """A one-layer llama, the default model's tokenizer, whose answer after a
    prompt is "yes" the more, the more often the single token `` marker`` occurs
    in it: a reranker whose ranking is known. Its attention is uniform (no query
    or key weights) and carries the marker's share of the positions to the
    output layer, where "yes" gets ``MARKER_GAIN`` times it less
    ``MARKER_BIAS`` ("no" gets 0), over the final norm's scale."""
    config = {
        **TINY_LLAMA,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    folder.mkdir(parents=True, exist_ok=True)
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    save_tokenizer(metadata, folder)
    tokenizer = load_tokenizer(folder)
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in ("yes", "no")]
    ids.append(tokenizer.encode(f" {marker}", add_special_tokens=False))
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"'yes', 'no' and ' {marker}' must be one token each")
    yes, no, mark = (i[0] for i in ids)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: mx.zeros_like(v) for k, v in tree_flatten(model.parameters())}
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = mx.ones_like(weights[name])
    # Dimension 0: 1 for every token; dimension 1: the marker.
    embed = mx.zeros((49152, 8)).at[:, 0].add(1.0).at[mark, 1].add(1.0)
    attention = "model.layers.0.self_attn"
    weights["model.embed_tokens.weight"] = embed
    weights[f"{attention}.v_proj.weight"] = mx.zeros((8, 8)).at[2, 1].add(1.0)
    weights[f"{attention}.o_proj.weight"] = mx.zeros((8, 8)).at[2, 2].add(1.0)
    head = mx.zeros((49152, 8)).at[yes, 0].add(-MARKER_BIAS)
    weights["lm_head.weight"] = head.at[yes, 2].add(MARKER_GAIN)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder
