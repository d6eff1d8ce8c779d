"""CPU pacing, without an engine: the choice the measured rounds make, the host's
setting against the option, and the load-time measurement kept for the same
weights (on a tiny llama)."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_backend.cpu.pacing import CPU_PACING_ENV, choose_pacing, pacing_setting
from mlx_backend.decoders.measured import measured_once
from mlx_backend.errors import FailedPrecondition
from tests.tiny_models import TINY_LLAMA


def test_pacing_is_decided_by_the_measured_rounds_unless_the_option_says():
    # (paced, unpaced) tok/s per round: unpaced steps must win on average by 5%.
    slower = [(30.0, 39.0), (31.0, 38.0), (29.0, 40.0)]
    pacing = choose_pacing("auto", slower)
    assert not pacing.paced
    assert pacing.describe() == (
        "CPU pacing off (auto, measured: tok/s paced 30.0, unpaced 39.0; "
        "paced/unpaced by round 0.77, 0.82, 0.72)"
    )
    assert choose_pacing("auto", [(40.0, 41.9)]).describe() == (
        "CPU pacing on (auto, measured: tok/s paced 40.0, unpaced 41.9)"
    )
    assert not choose_pacing("auto", [(40.0, 42.1)]).paced
    assert choose_pacing("auto", [(40.0, 33.0), (41.0, 34.0)]).paced
    # A round that the machine's noise turned around doesn't veto the others.
    assert not choose_pacing("auto", [(34.0, 40.0), (41.0, 40.0)]).paced
    # A tie paces: unpaced steps' losses come in spells a short measurement misses.
    assert choose_pacing("auto", [(40.0, 33.0), (33.0, 40.0)]).paced
    assert choose_pacing("auto").describe() == "CPU pacing off (auto, not measured)"
    assert choose_pacing("on", slower).describe() == "CPU pacing on (cpu_pacing:on)"
    assert not choose_pacing("off", [(40.0, 33.0)]).paced


def test_a_load_time_measurement_is_kept_for_the_same_weights_and_key():
    def tiny(seed: int) -> llama.Model:
        mx.random.seed(seed)
        model = llama.Model(llama.ModelArgs.from_dict({**TINY_LLAMA, "vocab_size": 64}))
        mx.eval(model.parameters())
        return model

    calls = []

    def measure():
        calls.append(len(calls))
        return calls[-1]

    model = tiny(1)
    assert measured_once(model, ("test", 8), measure) == 0
    assert measured_once(tiny(1), ("test", 8), measure) == 0  # a reload
    assert measured_once(model, ("test", 4), measure) == 1
    assert measured_once(tiny(2), ("test", 8), measure) == 2  # other weights
    assert calls == [0, 1, 2]


def test_the_host_sets_pacing_unless_the_option_says():
    assert pacing_setting("auto", {}) == ("auto", "auto")
    assert pacing_setting("auto", {CPU_PACING_ENV: " Auto "}) == ("auto", "auto")
    host = {CPU_PACING_ENV: "on"}
    assert pacing_setting("auto", host) == ("on", "MLX_BACKEND_CPU_PACING=on")
    assert pacing_setting("off", host) == ("off", "cpu_pacing:off")
    with pytest.raises(FailedPrecondition) as error:
        pacing_setting("auto", {CPU_PACING_ENV: "fast"})
    assert str(error.value) == (
        "MLX_BACKEND_CPU_PACING must be one of auto, on, off, not 'fast'"
    )
