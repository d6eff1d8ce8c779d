"""The memory budget's arithmetic and sizes, and the step token budget's choice
(engine/memory_budget.py, decoders/step_budget.py)."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache

from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.step_budget import (
    MIN_CHUNK,
    DepthScale,
    StepBudget,
    StepCosts,
    choose_step_budget,
)
from mlx_backend.engine.memory_budget import (
    KVSizer,
    LayerBytes,
    MemoryBudget,
    measure_kv_sizer,
)
from mlx_backend.errors import InvalidArgument, ResourceExhausted
from mlx_utils import make_kv_cache
from python_utils import LoadOptions, parse_options
from tests.engine_helpers import new_sequence
from tests.tiny_models import tiny_model


def held_bytes(cache: list) -> int:
    return sum(
        a.nbytes
        for layer in cache
        for _, a in tree_flatten(layer.state)
        if isinstance(a, mx.array)
    )


@pytest.mark.parametrize("tokens", [1, 200, 256, 257, 600])
def test_the_sizer_matches_the_bytes_a_cache_holds(tokens):
    model = tiny_model()
    sizer = measure_kv_sizer(model, LoadOptions())
    cache = make_kv_cache(model, LoadOptions())
    model(mx.array([[(i % 60) + 1 for i in range(tokens)]]), cache=cache)
    mx.eval([layer.state for layer in cache])
    # mlx-lm's KVCache holds room for 256 tokens at a time.
    assert sizer.bytes_for(tokens) == sum(layer.nbytes for layer in cache)
    assert sizer.bytes_for(tokens) >= held_bytes(cache)


def test_a_window_holds_its_window_at_most():
    model = tiny_model()
    options = LoadOptions(max_kv_size=32, prefill_step_size=64)
    sizer = measure_kv_sizer(model, options)
    # A chunk of 64 attends over the 32-token window and itself.
    assert all(layer.window == 32 + 63 for layer in sizer.layers)
    cache = make_kv_cache(model, options)
    assert all(isinstance(layer, RotatingKVCache) for layer in cache)
    model(mx.array([list(range(1, 60))]), cache=cache)
    mx.eval([layer.state for layer in cache])
    assert sizer.bytes_for(59) == sizer.bytes_for(10_000) >= held_bytes(cache)


def test_layer_bytes_round_up_to_the_room_a_layer_allocates():
    layer = LayerBytes(fixed=5, per_token=2, window=None, step=256)
    assert layer.bytes_for(1) == 5 + 2 * 256
    assert layer.bytes_for(257) == 5 + 2 * 512
    assert LayerBytes(fixed=7).bytes_for(10_000) == 7


def budget(rectangular: bool) -> MemoryBudget:
    sizer = KVSizer((LayerBytes(per_token=10), LayerBytes(fixed=100)))
    return MemoryBudget(10_000, 3_000, 1_000, sizer, rectangular)


def test_batched_rows_count_as_long_as_the_longest():
    assert budget(True).room == 6_000
    assert budget(True).kv_bytes([100, 10]) == 2 * (1_000 + 100)
    assert budget(False).kv_bytes([100, 10]) == (1_000 + 100) + (100 + 100)
    assert budget(True).kv_bytes([]) == 0


def test_a_request_bigger_than_the_room_is_refused_naming_both_numbers():
    budget(True).check_alone(590)
    with pytest.raises(ResourceExhausted) as refused:
        budget(True).check_alone(600)
    message = str(refused.value)
    assert message.startswith("Tokens:")
    assert "600 tokens" in message and "6100 bytes" in message
    assert "6000 bytes" in message


def costs(decode_ms: float, pass_ms: float, token_ms: float) -> StepCosts:
    return StepCosts(decode_ms / 1e3, pass_ms / 1e3, token_ms / 1e3, 0)


def test_the_measured_budget_spends_two_thirds_of_a_step_on_prefill():
    # (40 + 20) ms of fixed work, 1 ms a token: 120 tokens take two thirds.
    chosen = choose_step_budget(None, 256, costs(40, 20, 1))
    assert chosen.tokens == 120 and chosen.reason == "measured"
    assert choose_step_budget(None, 256, costs(40, 20, 0.01)).tokens == 256
    assert choose_step_budget(None, 256, costs(1, 0, 1)).tokens == MIN_CHUNK
    assert choose_step_budget(48, 256, costs(40, 20, 1)).tokens == 48
    assert choose_step_budget(None, 256, None).tokens == 256


def test_chunks_share_the_budget_only_while_sequences_decode():
    chosen = StepBudget(100, "test")
    assert chosen.chunk(decoding=0, prefilling=3, step_size=256) == 256
    assert chosen.chunk(decoding=4, prefilling=2, step_size=256) == 48
    assert chosen.chunk(decoding=4, prefilling=8, step_size=256) == MIN_CHUNK
    assert StepBudget(0, "off").chunk(4, 1, 256) == 256
    assert StepBudget(1000, "test").chunk(4, 1, 256) == 256


def test_chunks_shrink_while_steps_take_longer_than_the_budget_s_time():
    # 60 ms of fixed work a step, and 120 tokens at 1 ms: 180 ms a step.
    chosen = choose_step_budget(None, 256, costs(40, 20, 1))
    depth = DepthScale(chosen)
    depth.observe(0.060 + 0.480)  # each token costs 4 ms deep in the context
    assert depth.value == pytest.approx(0.5)
    depth.observe(0.060 + 0.240)
    assert depth.value == pytest.approx(0.5 * 0.5**0.5)
    assert chosen.chunk(1, 1, 256, depth.value) == int(119 * depth.value)
    depth.observe(0.060 + 0.0012)
    assert depth.value == 1.0
    depth.observe(1.0)
    depth.reset()
    assert depth.value == 1.0
    # A budget the option set has nothing to scale by.
    fixed = DepthScale(StepBudget(64, "step_token_budget:64"))
    fixed.observe(5.0)
    assert fixed.value == 1.0


def test_budget_options_parse_and_check():
    parsed = parse_options(["memory_budget:1000000", "step_token_budget:0"])
    assert parsed.memory_budget == 1_000_000 and parsed.step_token_budget == 0
    with pytest.raises(InvalidArgument, match="memory_budget must be at least 1"):
        parse_options(["memory_budget:0"])
    with pytest.raises(InvalidArgument, match="step_token_budget must not be"):
        parse_options(["step_token_budget:-1"])


def sequence(model, options, length: int, max_tokens: int) -> NewSequence:
    prompt = tuple((i % 60) + 1 for i in range(length))
    return new_sequence(model, options, prompt, max_tokens)


def test_the_shortest_waiting_prompt_takes_a_free_prefill_slot_first():
    model = tiny_model()
    options = LoadOptions(prefill_step_size=32, prefill_batch_size=1)
    decoder = BatchDecoder(model, options, True, budget=StepBudget(40, "test"))
    first = decoder.add(sequence(model, options, 200, 4))
    decoder.step()
    later = decoder.add(sequence(model, options, 200, 4))
    short = decoder.add(sequence(model, options, 5, 4))
    started = {}
    for step in range(60):
        for result in decoder.step():
            if result.tokens:
                started.setdefault(result.key, step)
        if len(started) == 3:
            break
    assert started[first] < started[short] < started[later]


def test_a_prefill_beside_decoding_rows_keeps_within_the_budget():
    model = tiny_model()
    options = LoadOptions(prefill_step_size=256)
    decoder = BatchDecoder(model, options, True, budget=StepBudget(40, "test"))
    decoder.add(sequence(model, options, 8, 50))
    for _ in range(3):
        decoder.step()
    decoder.add(sequence(model, options, 300, 4))
    decoder.step()
    # One row decodes, one prefills: 39 prompt tokens a step, not 256.
    assert decoder._batch.prefill_step_size == 39
