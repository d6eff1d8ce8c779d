"""LoRA adapters on every model family, in-process: for each tiny family model
(``tests/family_models.py``) an adapter as ``mlx_lm.lora`` saves one (all layers,
random nonzero lora_a and lora_b), served unfused and with ``fuse_lora:true``,
gives mlx-lm's own greedy text for the folder loaded with ``adapter_path``, which
the adapter changed. mlx-lm's ``linear_to_lora_layers`` wraps every linear of a
layer by default, a mixture's stacked experts (``SwitchLinear``) included; the
six mixture-of-experts families get their experts adapted, and an adapter that
leaves them out (``lora_parameters.keys``) serves as well."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load as load_mlx_lm
from mlx_lm.utils import load_adapters, load_model

from mlx_backend.engine.engine import Engine
from mlx_backend.models.loading import LoadPlan
from mlx_backend.models.lora import Adapter
from mlx_backend.models.mlx_lm_fixes import apply_fixes
from mlx_backend.request_parsing import GenerationRequest
from python_utils import parse_options
from tests.engine_helpers import run, text_of
from tests.family_models import FAMILIES
from tests.support import assert_text_as_reference, greedy_steps

# As tests/engine/test_model_families.py: gpt-oss is not read as harmony.
PLAIN = ("tool_parser:none", "reasoning:none")
QUESTION = "Name three rivers in France and the seas they reach."
LORA = {"rank": 4, "scale": 2.0, "dropout": 0.0}
# The families with experts, which mlx-lm's default adapter wraps.
MIXTURES = (
    "gpt_oss",
    "gemma4_text",
    "qwen3_next",
    "nemotron_h",
    "granitemoehybrid",
    "deepseek_v3",
)


def write_family_adapter(model, folder: Path, experts: bool = True) -> Path:
    """An adapter as ``mlx_lm.lora`` saves one after training ``model`` (mlx-lm's,
    which this wraps): the trainable parameters once ``linear_to_lora_layers``
    wrapped every layer by default, here random and nonzero; with ``experts``
    false, ``lora_parameters.keys`` names the linears only, not a mixture's
    experts."""
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), LORA)
    kinds = {path: type(m).__name__ for path, m in model.named_modules()}
    relative = {
        path: type(module).__name__
        for layer in model.layers
        for path, module in layer.named_modules()
    }
    lora = LORA
    if not experts:
        lora = {
            **LORA,
            "keys": sorted(p for p, k in relative.items() if k == "LoRALinear"),
        }
    kept = ("LoRALinear", "LoRASwitchLinear") if experts else ("LoRALinear",)
    mx.random.seed(1)
    weights = {}
    for name, value in tree_flatten(model.trainable_parameters()):
        if kinds[name.rpartition(".")[0]] not in kept:
            continue
        if name.endswith(".lora_a"):
            # (inputs, rank), or (experts, rank, inputs) for a mixture's experts.
            inputs = value.shape[0] if value.ndim == 2 else value.shape[-1]
            bound = inputs**-0.5
            weights[name] = mx.random.uniform(-bound, bound, value.shape)
        else:
            # mlx-lm starts lora_b at zero.
            weights[name] = 0.2 * mx.random.normal(value.shape)
    folder.mkdir(parents=True)
    config = {
        "fine_tune_type": "lora",
        "num_layers": len(model.layers),
        "lora_parameters": lora,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


def prompt_of(tokenizer) -> tuple[int, ...]:
    messages = [{"role": "user", "content": QUESTION}]
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


class Greedy:
    """mlx-lm's greedy reply to the question (12 tokens at most), and the check
    that another reply is it."""

    def __init__(self, model, tokenizer):
        self.tokenizer = tokenizer
        ends = tokenizer.eos_token_ids
        self.steps = greedy_steps(model, prompt_of(tokenizer), 12, ends)
        self.text = tokenizer.decode([t for t, _ in self.steps if t not in ends])

    def check(self, text: str) -> None:
        """``text`` is the reply, up to a near tie (tests/support.py)."""
        ends = self.tokenizer.eos_token_ids
        assert_text_as_reference(text, self.steps, self.tokenizer.decode, ends)


def adapted_model(folder: Path, adapter: Path):
    """mlx-lm's model for ``folder`` with ``adapter``, as ``mlx_lm.load(folder,
    adapter_path=adapter)`` makes it (its tokenizer is the folder's, loaded once)."""
    model, _ = load_model(folder)
    model = load_adapters(model, str(adapter))
    model.eval()
    return model


def served_text(name: str, folder: Path, adapter: Path, fuse: bool) -> str:
    """Our engine's greedy reply with the adapter applied (or fused)."""
    engine = Engine()
    try:
        engine.load(
            LoadPlan(
                identity=name,
                model=str(folder),
                adapters=(Adapter(adapter, 1.0),),
                options=parse_options([*PLAIN, f"fuse_lora:{fuse}"]),
            )
        ).result()
        applied = "1 LoRA adapter" + (", fused" if fuse else "")
        assert applied in engine.info.compute_path.description
        prompt = prompt_of(engine.info.tokenizer)
        request = GenerationRequest(prompt, 12, load_id=engine.info.load_id)
        return text_of(run(engine, request)[0])
    finally:
        engine.shutdown()


class Family:
    """One family's folder and adapter, and mlx-lm's text with it."""

    def __init__(self, name: str, folder: Path, models: Path):
        self.name = name
        self.folder = folder
        model, tokenizer = load_mlx_lm(str(self.folder))
        base = Greedy(model, tokenizer).text
        self.adapter = write_family_adapter(model, models / f"{name}-adapter")
        experts = [m for m in model.modules() if type(m).__name__ == "LoRASwitchLinear"]
        assert bool(experts) == (name in MIXTURES)
        self.expected = Greedy(adapted_model(folder, self.adapter), tokenizer)
        # The adapter changes what the model says.
        assert self.expected.text != base


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Where the family adapters are saved."""
    apply_fixes()
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_folder, models):
    return Family(request.param, family_folder(request.param), models)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_an_adapter_gives_mlx_lm_text(family, fuse):
    family.expected.check(served_text(family.name, family.folder, family.adapter, fuse))


@pytest.mark.parametrize("name", MIXTURES)
def test_an_adapter_without_the_experts_gives_mlx_lm_text(
    name, family_folder, models, tmp_path
):
    folder = family_folder(name)
    model, tokenizer = load_mlx_lm(str(folder))
    adapter = write_family_adapter(model, tmp_path / "adapter", experts=False)
    expected = Greedy(adapted_model(folder, adapter), tokenizer)
    for fuse in (False, True):
        expected.check(served_text(name, folder, adapter, fuse))
