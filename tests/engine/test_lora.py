"""LoRA adapters on the embedded model, in-process: adapters change the greedy
answer, scale 0 leaves it, fused and unfused agree, and an adapter for another
model fails the load and keeps the model serving."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_backend.engine.engine import Engine
from mlx_backend.gpu import on_cuda
from mlx_backend.models.loading import LoadPlan
from mlx_backend.models.lora import Adapter, AdapterError
from python_utils import parse_options
from tests.engine_helpers import generation, load_engine, run, text_of
from tests.support import ANSWER
from tests.tiny_models import write_adapter


def smollm_adapter(folder: Path, seed: int, layers: int = 6) -> Path:
    """A rank-4 adapter on the first ``layers`` layers' q_proj and v_proj of
    SmolLM2-135M (576 wide, 3 KV heads of 64), strong enough to change its
    greedy text."""
    folder.mkdir(parents=True)
    config = {"lora_parameters": {"rank": 4, "scale": 8.0, "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    weights = {}
    for layer in range(layers):
        for proj, out_dims in (("q_proj", 576), ("v_proj", 192)):
            name = f"model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_a"] = mx.random.normal((576, 4)) * 0.05
            weights[f"{name}.lora_b"] = mx.random.normal((4, out_dims)) * 0.5
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


def greedy_answer(
    *adapters: tuple[Path, float], fuse: bool = False, extra: tuple[str, ...] = ()
) -> str:
    engine = Engine()
    try:
        options = parse_options([f"fuse_lora:{fuse}", "max_tokens:24", *extra])
        engine.load(
            LoadPlan(
                identity="default",
                adapters=tuple((Adapter(path, scale) for path, scale in adapters)),
                options=options,
            )
        ).result()
        return text_of(run(engine, generation(engine))[0])
    finally:
        engine.shutdown()


def test_adapters_on_the_embedded_model(tmp_path: Path):
    one = smollm_adapter(tmp_path / "one", seed=1)
    two = smollm_adapter(tmp_path / "two", seed=2)
    base = ANSWER  # the model's own greedy answer
    assert greedy_answer((one, 0.0)) == base
    adapted = greedy_answer((one, 1.0))
    assert adapted != base
    assert greedy_answer((one, 1.0), (two, 1.0)) not in (base, adapted)
    # Fused into float32 weights the update is exact (on the CPU: CUDA's TF32
    # matmuls round the fused and the unfused products apart, enough to move this
    # strong random adapter's text). Fused into quantized ones (the CPU kernels'
    # path, or a GPU), the weights are quantized again, as mlx-lm's fuse does,
    # which moves its text.
    float32 = ("dequantize:true",)
    fused = greedy_answer((one, 1.0), fuse=True, extra=float32)
    if not on_cuda():
        assert fused == greedy_answer((one, 1.0), extra=float32)
    assert fused != base
    assert greedy_answer((one, 1.0), fuse=True) not in (base, "")


def test_a_failed_adapter_keeps_the_model(tmp_path: Path):
    engine = load_engine()
    try:
        before = text_of(run(engine, generation(engine))[0])
        tiny = write_adapter(tmp_path / "tiny", seed=1)
        with pytest.raises(AdapterError, match="does not fit this model"):
            engine.load(
                LoadPlan(adapters=(Adapter(tiny, 1.0),), options=parse_options([]))
            ).result()
        assert engine.stats.state == "ready"
        assert text_of(run(engine, generation(engine))[0]) == before
    finally:
        engine.shutdown()
