"""What the SIMD kernels multiply the weights with (``cpu/activations.py``): the
option, the host's setting, or a measurement at load, decoding and prefilling
apart; and what the kernels then run."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_backend.cpu import activations
from mlx_backend.cpu.activations import (
    ACTIVATIONS_ENV,
    Activations,
    activations_setting,
    choose_activations,
    first_layer,
    kernel_products,
)
from mlx_backend.cpu.compute_path import prepare_for_cpu
from mlx_backend.errors import FailedPrecondition
from python_utils import parse_options
from tests.tiny_models import tiny_quantized_llama


def test_the_option_then_the_host_then_auto():
    assert activations_setting("int8", {ACTIVATIONS_ENV: "float32"}) == (
        "int8",
        "kernel_activations:int8",
    )
    assert activations_setting("auto", {ACTIVATIONS_ENV: " Float32 "}) == (
        "float32",
        f"{ACTIVATIONS_ENV}=float32",
    )
    assert activations_setting("auto", {}) == ("auto", "auto")
    with pytest.raises(FailedPrecondition, match=f"{ACTIVATIONS_ENV} must be one of"):
        activations_setting("auto", {ACTIVATIONS_ENV: "int4"})
    # The load option's default is auto, and anything else is refused by name.
    assert parse_options([]).kernel_activations == "auto"
    with pytest.raises(Exception, match="kernel_activations must be one of auto"):
        parse_options(["kernel_activations:fp8"])


def test_the_measured_products_are_the_models_own():
    model = tiny_quantized_llama(tie=False)
    products = kernel_products(model)
    paths = [path for path, _ in products]
    # The head and each layer's seven projections; the untied embedding only
    # looks rows up.
    assert len(products) == 1 + 2 * 7 and paths == sorted(paths)
    assert "model.embed_tokens" not in paths and "lm_head" in paths
    tied = tiny_quantized_llama(tie=True)
    assert "model.embed_tokens" in [path for path, _ in kernel_products(tied)]
    block = first_layer(products)
    expected = [p for path, p in products if path.startswith("model.layers.0.")]
    assert len(block) == 7 and all(a is b for a, b in zip(block, expected))
    nn.quantize(flat := nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), 32, 4)
    assert len(first_layer(kernel_products(flat))) == 2


def test_the_measurement_keeps_to_its_budgets(qmm, monkeypatch):
    """Each side's products fit its budget (a large model's load spends about a
    second on the measurement), and always at least one."""
    model = tiny_quantized_llama(tie=False)
    timed = []
    monkeypatch.setattr(
        activations,
        "speed_ratio",
        lambda qmm, products, rows: timed.append((rows, products)) or 1.0,
    )
    activations.measure(qmm, model)
    decode = [p for rows, p in timed if rows == 1][0]
    prefill = [p for rows, p in timed if rows == 256][0]
    assert len(decode) == 15 and len(prefill) == 7
    monkeypatch.setattr(activations, "DECODE_BYTES", 1)
    monkeypatch.setattr(activations, "PREFILL_WORK", 1)
    timed.clear()
    activations.measure(qmm, model)
    assert [len(p) for _, p in timed] == [1, 1, 1]


def test_a_pinned_choice_sets_both_sides(qmm):
    for mode in ("int8", "float32"):
        chosen = choose_activations(qmm, tiny_quantized_llama(tie=False), mode, {})
        assert (chosen.decode, chosen.prefill) == (mode, mode)
        assert chosen.measured is None and chosen.reason == f"kernel_activations:{mode}"
        settings = qmm.settings()
        assert (settings["activations"], settings["prefill_activations"]) == (
            mode,
            mode,
        )
    host = choose_activations(
        qmm, tiny_quantized_llama(tie=False), "auto", {ACTIVATIONS_ENV: "int8"}
    )
    assert host.decode == "int8" and host.reason == f"{ACTIVATIONS_ENV}=int8"


def test_auto_measures_each_side_and_takes_int8_where_it_wins(qmm, monkeypatch):
    model = tiny_quantized_llama(tie=False)
    chosen = choose_activations(qmm, model, "auto", {})
    decode, prefill = chosen.measured
    assert decode > 0 and prefill > 0 and chosen.reason == "auto, measured"
    for ratio, side in zip(chosen.measured, (chosen.decode, chosen.prefill)):
        assert side == ("int8" if ratio <= activations.INT8_MARGIN else "float32")
    # Each side on its own: int8 where it measured faster.
    monkeypatch.setattr(activations, "measure", lambda qmm, model: (1.2, 0.6))
    chosen = choose_activations(qmm, model, "auto", {})
    assert (chosen.decode, chosen.prefill) == ("float32", "int8")
    assert (qmm.settings()["activations"], qmm.settings()["prefill_activations"]) == (
        "float32",
        "int8",
    )
    assert chosen.describe() == (
        "float32 activations decoding, int8 prefilling (auto, measured: int8/float32"
        " time, decode 1.20, prefill 0.60)"
    )
    # The rows of x a side's products meet: a decode's up to the row limit, the
    # GEMM past it.
    w, scales, biases = mx.quantize(mx.random.normal((64, 128)), 32, 4)
    x = mx.random.normal((40, 128), key=mx.random.key(1))
    many = qmm.quantized_matmul(x, w, scales, biases, 32, 4)
    one = qmm.quantized_matmul(x[:1], w, scales, biases, 32, 4)
    mx.eval(many, one)
    qmm.set_activations("float32")
    alone = qmm.quantized_matmul(x[:1], w, scales, biases, 32, 4)
    assert not mx.allclose(many[:1], alone, rtol=0, atol=1e-5)
    assert mx.array_equal(one, alone)


def test_a_draft_model_keeps_the_models_choice(qmm):
    qmm.set_activations("float32", "int8")
    _, path = prepare_for_cpu(
        tiny_quantized_llama(tie=False), None, None, activations=None
    )
    assert "float32 activations" in path.description
    assert qmm.settings()["prefill_activations"] == "int8"
    qmm.set_activations("float32")


def test_an_unknown_setting_is_refused(qmm):
    with pytest.raises(ValueError, match="activations must be float32, int16 or int8"):
        qmm.set_activations("float32", "int4")
    assert Activations("int8", "int8", "x").describe() == "int8 activations (x)"
