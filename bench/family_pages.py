"""A family's layers on pages against the batch decoder, in-process: Qwen3.5's
recurrent layers, DeepSeek V3's latent attention (MLA), Gemma 3's sliding
windows.

No such checkpoint is at hand offline, so the model is mlx-lm's own class at a
mid size (1024 wide, 8-bit weights, random; ``SIZES``), saved once under
``bench-results/``. On the engine's compute path, in alternating rounds, each
decoder's step for 1 and for 4 streams 500 tokens deep (the wall time of
``Decoder.step`` over 40 steps), and a prompt's time to its first token with
nothing else running (1,000 tokens; Gemma 3's 4,000, past its windows) and the
KV bytes its sequence holds then.

    venv/bin/python -m bench.family_pages [--family qwen3_5] [--rounds 3]
"""

import argparse
import copy
import importlib
import json
import random
import statistics
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from bench.in_process import first_token, make_decoder, step_seconds
from mlx_backend.cpu.preload import maybe_reexec_with_preloads
from tests.engine_helpers import load_engine, on_engine_thread
from tests.family_models import _tokenizer_files, family_config

SIZES = {
    # 12 layers, 3 of them attention.
    "qwen3_5": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "full_attention_interval": 4,
        "intermediate_size": 2816,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_value_heads": 16,
        "linear_num_key_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
    # 8 layers of MLA (DeepSeek V3's latent and head widths), 7 of them with 8
    # experts of which 2 run.
    "deepseek_v3": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 2816,
        "moe_intermediate_size": 704,
        "kv_lora_rank": 512,
        "q_lora_rank": 384,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
    },
    # 12 layers, 10 of them sliding windows of 512 (Gemma 3 1B's window, head
    # width and one KV head).
    "gemma3_text": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "intermediate_size": 2816,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    },
}
QUANTIZATION = {"group_size": 64, "bits": 8}
DEPTH = 500
STEPS = 40
PROMPT = 1000
PROMPTS = {"gemma3_text": 4000}


def make_folder(family: str) -> Path:
    folder = Path(f"bench-results/family-{family}-1024")
    if (folder / "config.json").is_file():
        return folder
    config = copy.deepcopy(family_config(family))
    config.get("text_config", config).update(SIZES[family])
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    nn.quantize(model, **QUANTIZATION)
    config["quantization"] = QUANTIZATION
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    for name, content in _tokenizer_files().items():
        (folder / name).write_bytes(content)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def measure(model, options, rounds: int, length: int) -> dict:
    rng = random.Random(5)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 40000) for _ in range(n))

    streams = [prompt(DEPTH) for _ in range(4)]
    out = {}
    for round_ in range(rounds):
        for paged in (True, False) if round_ % 2 == 0 else (False, True):
            side = "paged" if paged else "batch"
            cells = out.setdefault(
                side, {"1 stream": [], "4 streams": [], "prefill": [], "KV": []}
            )
            for name, prompts in (("1 stream", streams[:1]), ("4 streams", streams)):
                decoder = make_decoder(paged, model, options)
                cells[name].append(
                    step_seconds(decoder, model, options, prompts, STEPS)
                )
                decoder.close()
            decoder = make_decoder(paged, model, options)
            seconds, held = first_token(decoder, model, options, prompt(length))
            cells["prefill"].append(seconds)
            cells["KV"].append(held)
            decoder.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SIZES), default="qwen3_5")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    maybe_reexec_with_preloads()
    folder = make_folder(args.family)
    size, length = SIZES[args.family], PROMPTS.get(args.family, PROMPT)
    engine = load_engine("speculative:off", model=str(folder.resolve()))
    try:
        out = on_engine_thread(
            engine, lambda model, options: measure(model, options, args.rounds, length)
        )
    finally:
        engine.shutdown()
    print(
        f"{args.family} on pages: mlx-lm's class, {size['hidden_size']} wide, "
        f"{size['num_hidden_layers']} layers, 8-bit random weights; streams "
        f"{DEPTH} tokens deep, a {length}-token prompt alone"
    )
    for side, cells in out.items():
        parts = []
        for name, runs in cells.items():
            unit, scale = {
                "prefill": ("s to first token", 1),
                "KV": ("MB held then", 1e-6),
            }.get(name, ("ms a step", 1e3))
            values = " / ".join(f"{v * scale:.1f}" for v in runs)
            parts.append(f"{name} {values} {unit}")
        print(f"{side}: " + "; ".join(parts))
    for name in out["paged"]:
        ratios = [b / p for p, b in zip(out["paged"][name], out["batch"][name])]
        cells = " / ".join(f"{r:.2f}" for r in ratios)
        print(f"batch / paged, {name}: {cells} (worst {min(ratios):.2f})")


if __name__ == "__main__":
    main()
