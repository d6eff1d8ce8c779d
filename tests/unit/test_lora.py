"""lora.py on a tiny llama: composition, fusing, quantized bases, refusals, and
the request fields that name adapters. (tests/engine/test_lora.py loads adapters
on the embedded model.)"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import load_adapters

from mlx_backend.errors import InvalidArgument
from mlx_backend.models.lora import (
    Adapter,
    AdapterError,
    MultiLoRALinear,
    apply_adapters,
    make_adapters,
)
from tests.support import assert_tokens_as_reference, device_tolerance, greedy_steps
from tests.tiny_models import tiny_model, write_adapter

TOKENS = mx.array([[1, 5, 9, 3, 7, 2, 11]])
Q_PROJ = "model.layers.0.self_attn.q_proj"


def logits(model: nn.Module) -> mx.array:
    out = model(TOKENS)
    mx.eval(out)
    return out


@pytest.fixture
def adapter_a(tmp_path: Path) -> Path:
    return write_adapter(tmp_path / "a", seed=1, own_scale=2.0)


@pytest.fixture
def adapter_b(tmp_path: Path) -> Path:
    return write_adapter(tmp_path / "b", seed=2, own_scale=0.5, rank=2)


def adapted_logits(*adapters: tuple[Path, float], fuse: bool = False) -> mx.array:
    model = tiny_model()
    apply_adapters(model, [Adapter(path, scale) for path, scale in adapters], fuse)
    return logits(model)


def wrappers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)]


def test_scale_zero_gives_exactly_the_base_logits(adapter_a, adapter_b):
    base = logits(tiny_model())
    assert mx.array_equal(adapted_logits((adapter_a, 0.0)), base)
    assert mx.array_equal(adapted_logits((adapter_a, 0.0), (adapter_b, 0.0)), base)
    assert not mx.allclose(adapted_logits((adapter_a, 1.0)), base, atol=1e-3)


def test_one_adapter_matches_mlx_lm_load_adapters(adapter_a):
    reference = load_adapters(tiny_model(), str(adapter_a))
    model = tiny_model()
    assert apply_adapters(model, [Adapter(adapter_a)]) == "1 LoRA adapter"
    assert len(wrappers(model)) == 14  # 7 linears in each of 2 layers
    assert mx.allclose(logits(model), logits(reference), atol=1e-5)


def test_two_adapters_compose_as_documented(adapter_a, adapter_b):
    model = tiny_model()
    base = model.model.layers[0].self_attn.q_proj
    apply_adapters(model, [Adapter(adapter_a, 0.5), Adapter(adapter_b, 2.0)])
    x = mx.random.normal((1, 3, 32), key=mx.random.key(3))
    expected = base(x)
    for path, scale, own_scale in ((adapter_a, 0.5, 2.0), (adapter_b, 2.0, 0.5)):
        w = mx.load(str(path / "adapters.safetensors"))
        delta = (x @ w[f"{Q_PROJ}.lora_a"]) @ w[f"{Q_PROJ}.lora_b"]
        expected = expected + scale * own_scale * delta
    assert mx.allclose(model.model.layers[0].self_attn.q_proj(x), expected, atol=1e-6)

    both = logits(model)
    assert not mx.allclose(both, adapted_logits((adapter_a, 0.5)), atol=1e-3)
    assert not mx.allclose(both, adapted_logits((adapter_b, 2.0)), atol=1e-3)


def test_fused_matches_unfused(adapter_a, adapter_b):
    adapters = [Adapter(adapter_a, 0.5), Adapter(adapter_b, 2.0)]
    unfused, fused = tiny_model(), tiny_model()
    apply_adapters(unfused, adapters)
    assert apply_adapters(fused, adapters, fuse=True) == "2 LoRA adapters, fused"

    assert wrappers(fused) == []
    assert type(fused.model.layers[1].mlp.down_proj) is nn.Linear
    base_names = {name for name, _ in tree_flatten(tiny_model().parameters())}
    assert {name for name, _ in tree_flatten(fused.parameters())} == base_names
    assert mx.allclose(logits(fused), logits(unfused), atol=device_tolerance(1e-4, 10))
    ours = [token for token, _ in generate_step(TOKENS[0], fused, max_tokens=16)]
    assert_tokens_as_reference(ours, greedy_steps(unfused, TOKENS[0], 16, ()))


def test_a_fused_call_folds_in_earlier_unfused_adapters(adapter_a, adapter_b):
    model = tiny_model()
    apply_adapters(model, [Adapter(adapter_a, 0.5)])
    apply_adapters(model, [Adapter(adapter_b, 2.0)], fuse=True)
    assert wrappers(model) == []
    both = adapted_logits((adapter_a, 0.5), (adapter_b, 2.0))
    assert mx.allclose(logits(model), both, atol=device_tolerance(1e-4, 10))


def test_quantized_base_unfused_and_fused(adapter_a):
    def quantized() -> llama.Model:
        model = tiny_model()
        nn.quantize(model, group_size=32, bits=8)
        return model

    base = logits(quantized())
    unfused = quantized()
    apply_adapters(unfused, [Adapter(adapter_a)])
    assert isinstance(unfused.model.layers[0].mlp.up_proj.base, nn.QuantizedLinear)
    reference = load_adapters(quantized(), str(adapter_a))
    assert mx.allclose(logits(unfused), logits(reference), atol=1e-5)

    fused = quantized()
    apply_adapters(fused, [Adapter(adapter_a)], fuse=True)
    layer = fused.model.layers[0].mlp.up_proj
    assert type(layer) is nn.QuantizedLinear
    assert (layer.group_size, layer.bits) == (32, 8)
    # mlx-lm's own fuse (dequantize, add, re-quantize) gives the same model.
    mlx_fused = load_adapters(quantized(), str(adapter_a))
    for name, module in mlx_fused.named_modules():
        if isinstance(module, LoRALinear):
            mlx_fused.update_modules(tree_unflatten([(name, module.fuse())]))
    assert mx.allclose(logits(fused), logits(mlx_fused), atol=1e-5)
    # Re-quantizing costs a little; the adapter's effect is far larger.
    assert abs(logits(fused) - logits(unfused)).max() < 0.05
    assert abs(logits(unfused) - base).max() > 0.3


def test_the_file_says_which_linears_are_adapted(tmp_path):
    weights = {
        "model.layers.1.mlp.gate_proj.lora_a": mx.ones((32, 2)),
        "model.layers.1.mlp.gate_proj.lora_b": mx.ones((2, 64)),
    }
    folder = write_adapter(tmp_path / "one", seed=0, weights=weights)
    model = tiny_model()
    apply_adapters(model, [Adapter(folder)])
    assert wrappers(model) == ["model.layers.1.mlp.gate_proj"]


NO_MODULE = "adapters.safetensors adapts a module the model does not have"


@pytest.mark.parametrize(
    "layer, lora_a, lora_b, why",
    [
        (Q_PROJ, (64, 4), (4, 32), "takes 32 inputs, its lora_a has 64 rows"),
        (Q_PROJ, (32, 4), (4, 16), "has 32 outputs, its lora_b has 16 columns"),
        ("model.layers.5.self_attn.q_proj", (32, 4), (4, 32), NO_MODULE),
        ("model.layers.0.input_layernorm", (32, 4), (4, 32), "not a linear"),
    ],
)
def test_another_architecture_fails_and_leaves_the_model(
    tmp_path, adapter_a, layer, lora_a, lora_b, why
):
    weights = {f"{layer}.lora_a": mx.ones(lora_a), f"{layer}.lora_b": mx.ones(lora_b)}
    folder = write_adapter(tmp_path / "other", seed=0, weights=weights)
    model = tiny_model()
    before = tree_flatten(model.parameters())

    # The good adapter comes first: nothing is applied until all are checked.
    with pytest.raises(AdapterError) as error:
        apply_adapters(model, [Adapter(adapter_a), Adapter(folder)], fuse=True)
    message = str(error.value)
    assert f"adapter {folder} does not fit this model: " in message
    assert why in message
    # Tensor names are the file's bytes: a layer is named only when the model has it.
    assert (layer in message) == (why != NO_MODULE)
    after = tree_flatten(model.parameters())
    assert [name for name, _ in after] == [name for name, _ in before]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(after, before))
    assert wrappers(model) == []


BROKEN = {
    "missing folder": (None, None, "no such folder"),
    "dora": (
        {"fine_tune_type": "dora", "lora_parameters": {"scale": 1.0}},
        None,
        "fine_tune_type dora is not supported; only lora adapters can be combined",
    ),
    "full": ({"fine_tune_type": "full"}, None, "fine_tune_type full is not"),
    "no config": ("", None, "adapter_config.json can't be read (no such file"),
    "bad json": (
        "{",
        None,
        "adapter_config.json is not valid JSON (at line 1, column 2)",
    ),
    "alpha, not scale": (
        {"lora_parameters": {"rank": 4, "alpha": 16}},
        None,
        "no numeric lora_parameters.scale",
    ),
    "no weights": ({"lora_parameters": {"scale": 1.0}}, "", "no adapters.safetensors"),
    "lora_a alone": (
        {"lora_parameters": {"scale": 1.0}},
        {f"{Q_PROJ}.lora_a": mx.ones((32, 4))},
        f"{Q_PROJ} has no lora_b",
    ),
    "not lora": (
        {"lora_parameters": {"scale": 1.0}},
        {f"{Q_PROJ}.weight": mx.ones((32, 32))},
        f"holds a tensor for {Q_PROJ} that is not a LoRA tensor (lora_a or lora_b)",
    ),
}


@pytest.mark.parametrize("config, weights, why", BROKEN.values(), ids=BROKEN.keys())
def test_broken_adapters_are_refused(tmp_path, config, weights, why):
    folder = tmp_path / "adapter"
    if config is not None:
        folder.mkdir()
        if config != "":
            text = config if isinstance(config, str) else json.dumps(config)
            (folder / "adapter_config.json").write_text(text)
        if weights is not None and weights != "":
            mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    model = tiny_model()
    with pytest.raises(AdapterError, match="^adapter ") as error:
        apply_adapters(model, [Adapter(folder)])
    assert str(folder) in str(error.value)
    assert why in str(error.value)


def test_adapter_fields_become_adapters(tmp_path: Path):
    made = make_adapters("solo", 0.0, ["a", "/abs/b"], [0.5], str(tmp_path))
    assert made == (
        Adapter(tmp_path / "solo", 1.0),
        Adapter(tmp_path / "a", 0.5),
        Adapter(Path("/abs/b"), 1.0),
    )
    assert make_adapters("", 0.0, [], [], "") == ()
    with pytest.raises(InvalidArgument, match="LoraScales: 2 scales for 1"):
        make_adapters("", 0.0, ["a"], [1.0, 2.0], "")
