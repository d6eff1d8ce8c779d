"""Tiny random models, one per model family that mlx-lm serves, for tests that need
each family's layers and caches rather than a llama's: ``FAMILIES`` names them (by
mlx-lm model type), ``family_config`` is a family's config.json and
``make_family_folder`` saves one as an MLX model folder with the default model's
tokenizer, the same weights on every call.

Each is float32, 2-4 layers of width 32, and has every layer kind of its family:
sliding-window and global attention (a ``WINDOW``-token window, which test prompts
exceed), linear attention, Mamba, short convolutions, MLA and mixtures of experts.
The weights are mlx-lm's random initialization, rescaled so that greedy decoding
varies from token to token and with the prompt, and so that the recurrent states
and the sliding windows change what a model says."""

import copy
import importlib
import json
import math
from functools import cache
from pathlib import Path
from tempfile import TemporaryDirectory

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_backend.models.gguf import save_tokenizer
from mlx_backend.models.loading import default_model_path

FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen3",
    "gemma3_text",
    "gpt_oss",
    "gemma4_text",
    "qwen3_next",
    "qwen3_5",
    "nemotron_h",
    "granitemoehybrid",
    "lfm2",
    "deepseek_v3",
    "phi3",
    "mamba2",
)

# The sliding window of the families that have one: test prompts run past it.
WINDOW = 16

# Every family shares the default model's vocabulary and end token.
_VOCABULARY = {"vocab_size": 49152, "eos_token_id": 2}

_ATTENTION = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Quantized KV needs whole groups of 32 per head.
    "head_dim": 32,
    "max_position_embeddings": 8192,
}
# Families whose head width is the model's width over the heads.
_ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1}

_CONFIGS: dict[str, dict] = {
    "llama": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    # Layer 0 slides, layer 1 is global.
    "gemma3_text": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 8,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
    },
    "gpt_oss": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        # gpt-oss's own YaRN (transformers assumes it when the config has none).
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
    # Layers 2 and 3 reuse the keys and values of layers 0 and 1 (one sliding, one
    # global); per-layer inputs as the small models have, experts as the 26B has.
    "gemma4_text": {
        **_ATTENTION,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size_per_layer_input": 49152,
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "final_logit_softcapping": 30.0,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "tie_word_embeddings": True,
    },
    # Layer 0: gated delta net and a dense MLP; layer 1: attention and experts.
    "qwen3_next": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "full_attention_interval": 2,
        "intermediate_size": 64,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
    # As Qwen3.5 checkpoints nest it: the text model's config in text_config.
    "qwen3_5": {
        "text_config": {
            **_ATTENTION,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 2,
            "full_attention_interval": 2,
            "intermediate_size": 64,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
            },
            "tie_word_embeddings": True,
            **_VOCABULARY,
        },
        "tie_word_embeddings": True,
    },
    # Mamba, attention, MLP and experts blocks.
    "nemotron_h": {
        **_ATTENTION,
        "hybrid_override_pattern": "M*-E",
        "intermediate_size": 64,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    # Granite 4.0 H: Mamba and position-free attention, each with experts.
    "granitemoehybrid": {
        **_ATTENTION,
        **_ONE_HEAD,
        "num_hidden_layers": 2,
        "layer_types": ["mamba", "attention"],
        "intermediate_size": 32,
        "shared_intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.125,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "rms_norm_eps": 1e-5,
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_expand": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "position_embedding_type": "nope",
        "tie_word_embeddings": True,
    },
    "lfm2": {
        **_ATTENTION,
        **_ONE_HEAD,
        "num_hidden_layers": 2,
        "layer_types": ["conv", "full_attention"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 32,
        "block_ff_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "tie_word_embeddings": True,
    },
    # Multi-head latent attention; layer 0 dense, layer 1 experts in 2 groups.
    "deepseek_v3": {
        **_ATTENTION,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "kv_lora_rank": 32,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
    },
    "phi3": {
        **_ATTENTION,
        **_ONE_HEAD,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "mamba2": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_heads": 8,
        "head_dim": 8,
        "expand": 2,
        "intermediate_size": 64,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.001, 100.0],
        "time_step_rank": "auto",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def family_config(name: str) -> dict:
    """The config.json of family ``name``'s tiny model (a fresh copy)."""
    config = {"model_type": name, **copy.deepcopy(_CONFIGS[name])}
    if "text_config" in config:
        return {**config, "eos_token_id": _VOCABULARY["eos_token_id"]}
    return {**config, **_VOCABULARY}


def _randomize_routers(model: nn.Module) -> None:
    # mlx-lm starts DeepSeek's and Nemotron-H's routers at zero, which ties every
    # expert: tokens would pick experts by argpartition's order among equals.
    for _, module in model.named_modules():
        if type(module).__name__ == "MoEGate":
            module.weight = 0.3 * mx.random.normal(module.weight.shape)
            bias = module.e_score_correction_bias
            module.e_score_correction_bias = 0.01 * mx.random.normal(bias.shape)


def _lengthen_memory(model: nn.Module) -> None:
    # With mlx-lm's dt_bias of 1 a recurrent state forgets within a token or two,
    # and Mamba's skip (D) outweighs it: a broken state would go unseen. Time
    # steps from 0.02 to 0.2, a weak skip and stronger B and C make it count.
    for _, module in model.named_modules():
        if "A_log" in module and "dt_bias" in module:
            shape = module.dt_bias.shape
            dt = mx.exp(mx.random.uniform(math.log(0.02), math.log(0.2), shape))
            module.dt_bias = dt + mx.log(-mx.expm1(-dt))
        if "D" in module and "conv1d" in module:
            module.D = 0.1 * module.D
            # The convolution's channels: x, then B and C.
            x = module.num_heads * module.head_dim
            weight = module.conv1d.weight
            module.conv1d.weight = mx.concatenate([weight[:x], 4 * weight[x:]])


# The projections that write into the residual stream, in every family's naming.
_RESIDUAL_WRITERS = (
    "o_proj",
    "out_proj",
    "down_proj",
    "w2",
    "fc2",
    "output_linear",
    "per_layer_projection",
)
_QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))


def _scale_norm(norm: nn.Module, factor: float) -> None:
    if type(norm).__module__.endswith("gemma3_text"):
        # Gemma 3's norms scale by 1 + weight.
        norm.weight = factor * (1 + norm.weight) - 1
    else:
        norm.weight = factor * norm.weight


def _sharpen(attention: nn.Module, factor: float) -> None:
    # Queries and keys times factor, where each family computes them.
    for q, k in _QK_NORMS:
        if q in attention:
            for norm in (q, k):
                # Gemma 4's layers that share keys have no k_norm.
                if norm in attention:
                    _scale_norm(attention[norm], factor)
            return
    if "qkv_proj" in attention:
        # Phi-3 stacks the queries, keys and values.
        rows = (attention.n_heads + attention.n_kv_heads) * attention.head_dim
        weight = attention.qkv_proj.weight
        attention.qkv_proj.weight = mx.concatenate(
            [factor * weight[:rows], weight[rows:]]
        )
    elif "embed_q" in attention:
        # MLA: the queries, the keys' latent projection and their rotary part.
        attention.q_b_proj.weight = factor * attention.q_b_proj.weight
        attention.embed_q.weight = factor * attention.embed_q.weight
        kv = attention.kv_a_proj_with_mqa
        rows = attention.kv_lora_rank
        kv.weight = mx.concatenate([kv.weight[:rows], factor * kv.weight[rows:]])
    else:
        for name in ("q_proj", "k_proj"):
            for key in ("weight", "bias"):
                if key in attention[name]:
                    attention[name][key] = factor * attention[name][key]


def _liven(model: nn.Module) -> None:
    # At mlx-lm's initial scale attention is nearly uniform and the layers add
    # little to the embedding: the model repeats one token whatever the prompt.
    for name, module in model.named_modules():
        if "q_proj" in module or "qkv_proj" in module or "q_b_proj" in module:
            _sharpen(module, 3.0)
        if name.rsplit(".", 1)[-1] in _RESIDUAL_WRITERS and "weight" in module:
            module.weight = 3.0 * module.weight


def _build(name: str) -> tuple[dict, dict[str, mx.array]]:
    config = family_config(name)
    module = importlib.import_module(f"mlx_lm.models.{name}")
    # Seeded per family, so each family's weights are the same on every call.
    mx.random.seed(FAMILIES.index(name))
    model = module.Model(module.ModelArgs.from_dict(config))
    _randomize_routers(model)
    _lengthen_memory(model)
    _liven(model)
    weights = dict(tree_flatten(model.parameters()))
    if name == "gemma3_text":
        # Gemma ties its output to the embeddings: the checkpoint has no lm_head.
        del weights["lm_head.weight"]
    return config, weights


@cache
def _tokenizer_files() -> dict[str, bytes]:
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    with TemporaryDirectory() as temporary:
        save_tokenizer(metadata, Path(temporary))
        return {p.name: p.read_bytes() for p in Path(temporary).iterdir()}


def make_family_folder(folder: Path, name: str) -> Path:
    """Family ``name``'s tiny model saved in ``folder`` as mlx-lm saves models,
    unless a previous call saved it there already; returns ``folder``."""
    if (folder / "config.json").is_file():
        return folder
    config, weights = _build(name)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    for file_name, content in _tokenizer_files().items():
        (folder / file_name).write_bytes(content)
    # Written last: a folder with config.json is complete.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
