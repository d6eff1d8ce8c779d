"""The memory budget's arithmetic and sizes, and the step token budget's choice
(engine/memory_budget.py, decoders/step_budget.py)."""

import copy
import random
import statistics
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache

from mlx_backend.caches.page_tables import PagedStore
from mlx_backend.caches.paged import LayerShape
from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.proposers import NgramProposer
from mlx_backend.decoders.speculative import SpeculativeDecoder
from mlx_backend.decoders.step_budget import (
    DECODE_WINDOW,
    KEYS_UNIT,
    MEAN_MULTIPLE,
    NO_STEP_BUDGET,
    NO_WORK,
    PASS_MOST,
    PASS_MULTIPLE,
    PROBE_TOKENS,
    STEP_MULTIPLE,
    PassPacer,
    PassWork,
    PrefillPacer,
    StepBudget,
    StepCosts,
    choose_step_budget,
    chunk_work,
)
from mlx_backend.engine.memory_budget import (
    OPTION_SOURCE,
    KVSizer,
    LayerBytes,
    MemoryBudget,
    device_memory,
    measure_kv_sizer,
    paged_kv_sizer,
)
from mlx_backend.engine.prompt_store import PromptCounts, PromptStore
from mlx_backend.errors import InvalidArgument, ResourceExhausted
from mlx_cache import ThreadSafeLRUPromptCache
from mlx_utils import make_kv_cache
from python_utils import LoadOptions, parse_options
from tests.engine_helpers import new_sequence
from tests.tiny_models import FLAT, tiny_model


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


FLOAT32_PAGES = LayerShape(2, 64, 64, mx.float32)


@pytest.mark.parametrize(
    "shape",
    [
        FLOAT32_PAGES,
        LayerShape(2, 64, 64, mx.float32, mx.float16),
        LayerShape(2, 64, 64, mx.float32, bits=8, group_size=32),
        LayerShape(2, 64, 64, mx.float32, window=40),
    ],
    ids=["float32", "float16", "q8", "window"],
)
@pytest.mark.parametrize("tokens", [1, 32, 33, 600])
def test_the_paged_sizer_counts_the_pages_a_sequence_holds(shape, tokens):
    """On pages a sequence holds whole pages in the pages' own type (float16,
    quantized codes with their scales), not mlx-lm's 256-token rooms; a sliding
    window's, those its window, slack and a prefill chunk span."""
    shapes, chunk = [shape, FLOAT32_PAGES], 50
    store = PagedStore(shapes)
    tables = store.tables()
    sizer = paged_kv_sizer(shapes, chunk)
    for first in range(0, tokens, chunk):
        context = min(first + chunk, tokens)
        store.extend(tables, context, first)
        assert store.nbytes() <= sizer.bytes_for(context)
    if not shape.window:
        assert sizer.bytes_for(tokens) == store.nbytes()
    elif tokens > 200:
        # Its bytes stop growing past its window; the pages behind it are freed.
        window = sizer.layers[0]
        assert window.bytes_for(tokens) == window.bytes_for(10 * tokens)
        assert store.groups[1].nbytes() < store.groups[0].nbytes()
    if shape is not FLOAT32_PAGES:
        assert sizer.layers[0].per_token <= sizer.layers[1].per_token


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


def test_the_default_budget_is_a_share_of_each_devices_memory(monkeypatch):
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 80_000})
    assert device_memory() == (64_000, "80% of the device's memory")
    working_set = {"max_recommended_working_set_size": 10_000, "memory_size": 1}
    monkeypatch.setattr(mx, "device_info", lambda: working_set)
    assert device_memory() == (9_000, "90% of the recommended working set")


def test_a_share_of_the_device_shrinks_by_what_a_job_holds():
    # A fine-tuning job's estimate comes off the device's share, not off a set budget.
    shared = budget(True)
    assert shared.room_beside(2_500) == 3_500
    set_budget = replace(shared, source=OPTION_SOURCE)
    assert set_budget.room_beside(2_500) == 6_000


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


def test_the_budget_is_the_option_or_time_as_measured():
    assert choose_step_budget(48, costs(40, 20, 1)).tokens == 48
    measured = choose_step_budget(None, costs(40, 20, 1))
    assert measured.timed and measured.reason == "measured"
    assert "2.5 decode steps at most, 1.6 on average" in measured.describe()
    assert not choose_step_budget(None, None).timed
    assert not choose_step_budget(0, costs(40, 20, 1)).timed


def test_a_set_budget_is_shared_only_while_sequences_decode():
    pacer = PrefillPacer(StepBudget("test", tokens=100), 256)
    assert pacer.chunk(decoding=0, prefilling=3) == 256
    assert pacer.chunk(decoding=4, prefilling=2) == 48
    # No floor: eight rows share what four decode rows leave.
    assert pacer.chunk(decoding=4, prefilling=8) == 12
    assert pacer.chunk(decoding=90, prefilling=20) == 1
    assert PrefillPacer(NO_STEP_BUDGET, 256).chunk(4, 1) == 256
    assert PrefillPacer(StepBudget("test", tokens=1000), 256).chunk(4, 1) == 256


def simulate(pacer: PrefillPacer, decode_s: float, cost, steps: int) -> list:
    """``steps`` steps of one decoding row beside a prompt, where a chunk of n
    tokens after ``done`` costs ``cost(done, n)`` seconds: (step s, tokens)."""
    done, seen = 0, []
    for _ in range(steps):
        n = pacer.chunk(decoding=1, prefilling=1)
        seconds = decode_s + (cost(done, n) if n else 0.0)
        pacer.observe(seconds, 1, n)
        done += n
        seen.append((seconds, n))
    return seen


def test_steps_keep_their_time_deep_into_a_long_prompt():
    """A pass costs 12 ms plus 2.6 ms a token, and its attention 1 ms a token per
    1000 tokens of context for each token, as the embedded model's do on 2 cores:
    the chunks shrink as the prompt deepens, each step keeps within its multiple
    of a decode step (or one token's pass, where that is more), and the steps
    average theirs."""
    decode_s = 0.017
    pacer = PrefillPacer(choose_step_budget(None, costs(17, 12, 2.6)), 256)

    def cost(done: int, n: int) -> float:
        return 0.012 + 0.0026 * n + 0.001 * (done / 1000) * (n + 12)

    seen = simulate(pacer, decode_s, cost, 1500)
    chunks = [n for _, n in seen if n]
    assert max(chunks[:50]) > chunks[-1] == 1
    done = 0
    for seconds, n in seen:
        bound = max(STEP_MULTIPLE * decode_s, decode_s + cost(done, 1))
        assert seconds <= bound * 1.01
        done += n
    # Deep in the prompt one token's pass costs more than a step allows.
    assert decode_s + cost(done, 1) > STEP_MULTIPLE * decode_s
    assert sum(s for s, _ in seen) / len(seen) <= MEAN_MULTIPLE * decode_s * 1.02
    # Prefill goes on, a token every few steps.
    assert sum(n for _, n in seen[-100:]) >= 25


def test_a_slow_step_holds_the_prefill_back_until_its_time_is_made_up():
    decode_s = 0.020
    pacer = PrefillPacer(choose_step_budget(None, costs(20, 16, 1)), 256)
    # A prefill starts with a step's worth of credit (30 ms), and one token's
    # pass as the load measured it (17 ms) or a decode step's (20 ms).
    assert pacer.chunk(1, 1) == 1
    pacer.observe(decode_s + 0.012, 1, 1)
    # 18 ms left, 12 ms earned a step; 16 ms a token now.
    assert pacer.chunk(1, 1) == 2
    # That step took 200 ms more than a decode step: 170 ms to make up at 12 ms
    # a step, and then one token at a time.
    pacer.observe(decode_s + 0.200, 1, 2)
    skipped = 0
    while (n := pacer.chunk(1, 1)) == 0:
        pacer.observe(decode_s, 1, 0)
        skipped += 1
    assert skipped == 16 and n == 1
    # A short prompt goes at once, on credit.
    pacer.observe(decode_s + 0.030, 1, 1)
    assert pacer.chunk(1, 2) == 0
    assert pacer.chunk(1, 2, short=True) == 1
    pacer.observe(decode_s + 0.030, 1, 2)
    # Room left: a token more a row.
    pacer.observe(decode_s + 0.004, 1, 2)
    pacer.chunk(1, 2)
    assert pacer.chunk(1, 2, short=True) == 2
    # The next prefill banks nothing and starts over from one token's pass.
    assert pacer.chunk(1, 0) == 256
    assert pacer.chunk(1, 1) == 1


def test_a_prefill_starts_from_a_decode_step_a_token_at_least():
    """The load measured a pass's fixed cost at 0.1 ms: a prefill's first chunk
    is still a decode step's worth a token (one in a step's 30 ms of prefill),
    not 8 tokens at 3.4 ms each. A short prompt in a pass of its own learns its
    cost apart from the prompt batch's, and prefills every step on credit."""
    decode_s = 0.020
    pacer = PrefillPacer(choose_step_budget(None, costs(20, 0.1, 3.4)), 256)
    assert pacer.chunk(1, 1, alone=True) == 1
    pacer.observe(decode_s + 0.012, 1, 1, alone=True)
    # 16 ms a token now, and room left: a token more.
    assert pacer.chunk(1, 1, alone=True) == 2
    pacer.observe(decode_s + 0.020, 1, 2, alone=True)
    # The prompt batch waits for its credit, then starts from a decode step's.
    skipped = 0
    while (n := pacer.chunk(1, 1)) == 0:
        pacer.observe(decode_s, 1, 0)
        skipped += 1
    assert skipped == 1 and n == 1


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
    decoder = BatchDecoder(model, options, True, budget=StepBudget("test", tokens=40))
    first = decoder.add(sequence(model, options, 200, 4))
    decoder.step()
    later = decoder.add(sequence(model, options, 300, 4))
    # Long enough to wait for the slot (a short one prefills beside it, alone).
    shorter = decoder.add(sequence(model, options, 100, 4))
    started = {}
    for step in range(60):
        for result in decoder.step():
            if result.tokens:
                started.setdefault(result.key, step)
        if len(started) == 3:
            break
    assert started[first] < started[shorter] < started[later]


def one_row_decoding(tokens: int) -> tuple:
    """A batch decoder with a step budget of ``tokens``, one row decoding."""
    model = tiny_model()
    options = LoadOptions(prefill_step_size=256)
    decoder = BatchDecoder(
        model, options, True, budget=StepBudget("test", tokens=tokens)
    )
    decoder.add(sequence(model, options, 8, 50))
    for _ in range(3):
        decoder.step()
    return model, options, decoder


def test_a_prefill_beside_decoding_rows_keeps_within_the_budget():
    model, options, decoder = one_row_decoding(40)
    decoder.add(sequence(model, options, 300, 4))
    decoder.step()
    # One row decodes, one prefills: 39 prompt tokens a step, not 256.
    assert decoder._batch.prefill_step_size == 39


class EagerLookup(NgramProposer):
    """Prompt lookup verified from the first decoded token on."""

    cheap = False


def test_a_sequence_back_from_speculation_counts_as_decoding():
    """Issue 50's stalls of seconds: a sequence that speculated alone goes back to
    the batch when a prompt arrives, and waits there as a one-token prompt; the
    batch saw nothing decoding and prefilled a whole ``prefill_step_size`` chunk
    of the new prompt in that step."""
    model = tiny_model()
    options = LoadOptions(prefill_step_size=256)
    inner = BatchDecoder(model, options, True, budget=StepBudget("test", tokens=8))
    decoder = SpeculativeDecoder(inner, model, lambda: EagerLookup(1, 3), costs=FLAT)
    # Every token occurs in the prompt: whatever comes, a proposal follows.
    prompt = tuple(range(64)) * 2
    stream = replace(sequence(model, options, 1, 200), prompt=prompt, rest=prompt)
    decoder.add(replace(stream, draft_tokens=4))
    for _ in range(20):
        if decoder._lone is not None:
            break
        decoder.step()
    assert decoder._lone is not None
    counters = inner._batch._counters
    decoder.add(sequence(model, options, 300, 4))
    for step in range(4):
        before = counters.prompt_tokens
        tokens = [t for r in decoder.step() for t in r.tokens]
        # Its first step back joins the decode batch (its kept token is that
        # step's input, with no prefill beside it); then one sequence decodes
        # beside 7 prompt tokens a step, not 256.
        assert counters.prompt_tokens - before == (7 if step else 0)
        assert len(tokens) == (step > 0)


def test_a_prompt_that_ends_leaves_the_batch_without_a_copy_of_every_row(
    monkeypatch,
):
    """mlx-lm deep-copies the whole prompt batch's KV cache to split off the
    prompts whose prefill ends; SharingPromptBatch shares it, and the text is the
    same as each prompt's alone."""
    model = tiny_model()
    options = LoadOptions(prefill_step_size=16)

    def texts(prompts: list) -> list:
        decoder = BatchDecoder(model, options, True)
        keys = [decoder.add(sequence(model, options, n, 6)) for n in prompts]
        out = {key: [] for key in keys}
        while any(len(t) < 6 for t in out.values()):
            for result in decoder.step():
                out[result.key] += result.tokens
        return [out[key] for key in keys]

    alone = [texts([n])[0] for n in (5, 40)]
    copied = []
    deepcopy = copy.deepcopy

    def counting(x, *args):
        if isinstance(x, list) and any(isinstance(c, BatchKVCache) for c in x):
            copied.append(len(x))
        return deepcopy(x, *args)

    monkeypatch.setattr(copy, "deepcopy", counting)
    assert texts([5, 40]) == alone
    assert copied == []


def test_a_finished_sequence_s_state_is_copied_a_few_layers_a_step():
    """A finished sequence's KV state joins the prompt cache at once, and its copy
    out of the batch settles over the next steps (one 3,800-token state of the
    embedded model took a step 50-120 ms more when copied at once)."""
    model = tiny_model()
    options = LoadOptions()
    store = PromptStore(
        ThreadSafeLRUPromptCache(can_trim_fn=lambda c: True, trim_fn=lambda c, n: 0),
        1,
        lambda: make_kv_cache(model, options),
        PromptCounts(),
    )
    cache = make_kv_cache(model, options)
    model(mx.array([list(range(1, 41))]), cache=cache)
    tokens = tuple(range(1, 41))
    store.keep(cache, tokens, later=True)
    layer_bytes = cache[0].keys.nbytes
    arrays = len(store._unsettled)
    assert arrays == 2 * len(cache) and store.cached_length(tokens + (9,)) == 40
    store.settle(layer_bytes)
    assert len(store._unsettled) == arrays - 1
    store.settle(3 * layer_bytes)
    assert len(store._unsettled) == arrays - 4
    store.sync()
    assert not store._unsettled
    # Kept at once, as before.
    store.keep(make_kv_cache(model, options), tokens[:3])
    assert not store._unsettled


def test_a_short_prompt_prefills_alone_and_starts_decoding_in_a_step_of_its_own():
    """Beside a long prompt, a short one prefills in a pass of its own (padded
    beside the long one, its tokens cost as deep as the long one's), then its KV
    joins the decode batch in a step that carries no other prefill, its last
    prompt token an input of that step's decode pass (not a pass of its own);
    the long one waits for those steps. Its text is its text alone."""
    model, options, decoder = one_row_decoding(8)
    decoder.add(sequence(model, options, 300, 4))
    short = decoder.add(replace(sequence(model, options, 12, 4), snapshots=(6, 11)))
    counters = decoder._batch._counters
    seen, tokens, snapshots = [], [], []
    for _ in range(6):
        before = len(decoder._batch._generation_batch), counters.prompt_tokens
        for result in decoder.step():
            if result.key == short:
                tokens += result.tokens
                snapshots += [len(s.tokens) for s in result.snapshots]
        joined = len(decoder._batch._generation_batch) > before[0]
        seen.append((joined, counters.prompt_tokens - before[1], len(tokens)))
    # One decoding row leaves 7 tokens a step: the short prompt's 11 before its
    # last (a snapshot after 6, and at its end) in two steps; its last prompt
    # token is an input of the decode pass of the step it joins, and its tokens
    # come from the next one on; then the long one takes the 6 two decoding rows
    # leave.
    assert seen == [
        (False, 6, 0),
        (False, 5, 0),
        (True, 0, 0),
        (False, 6, 1),
        (False, 6, 2),
        (False, 6, 3),
    ]
    assert snapshots == [6, 11]
    alone = BatchDecoder(model, options, True)
    alone.add(sequence(model, options, 12, 4))
    assert [t for _ in range(8) for r in alone.step() for t in r.tokens][:3] == tokens


def test_with_nothing_decoding_a_short_prompt_waits_for_no_whole_chunk():
    """Issue 50's short request took 2 s where the streams ended as it arrived:
    with nothing decoding, the long prompt prefilled in whole chunks (a second
    each, deep in it) and the short one, in its prompt batch, waited for two.
    Beside a long prompt it prefills alone, whole, in one step, and joins the
    decode pass in the next; then the long one goes on within the budget."""
    model = tiny_model()
    options = LoadOptions(prefill_step_size=64)
    decoder = BatchDecoder(model, options, True, budget=StepBudget("test", tokens=8))
    decoder.add(sequence(model, options, 600, 4))
    decoder.step()
    short = decoder.add(sequence(model, options, 20, 4))
    counters = decoder._batch._counters
    seen = []
    for _ in range(3):
        before = counters.prompt_tokens
        tokens = [t for r in decoder.step() if r.key == short for t in r.tokens]
        seen.append((counters.prompt_tokens - before, len(tokens)))
    assert seen == [(19, 0), (0, 0), (7, 1)]


def test_a_decode_step_is_timed_while_no_prefill_is_under_way():
    """Beside a prefill, issue 50's streams decoded steps alone in 25-35 ms where
    they took 20-22 ms before it: counted, they grew the budget they are the
    measure of (a step with prefill took over 5 of their steps before it)."""
    pacer = PrefillPacer(choose_step_budget(None, costs(10, 16, 1)), 256)
    for _ in range(DECODE_WINDOW):
        pacer.observe(0.020, 2, 0)
    assert pacer.chunk(2, 1) > 0
    for _ in range(DECODE_WINDOW):
        pacer.observe(0.030, 2, 0)
    assert pacer.decode_s == pytest.approx(0.020)
    # The prefill over, decode steps count again.
    assert pacer.chunk(2, 0) == 256
    for _ in range(DECODE_WINDOW):
        pacer.observe(0.030, 2, 0)
    assert pacer.decode_s == pytest.approx(0.030)


def one_pass(rows: int, rows_depth: int, chunk: int, depth: int):
    """A one-pass step's work: ``rows`` decode rows at ``rows_depth``, and a
    chunk of ``chunk`` prompt tokens ending ``depth`` deep."""
    keys = rows * rows_depth / KEYS_UNIT
    chunk_keys = (chunk * depth - chunk * (chunk - 1) / 2) / KEYS_UNIT
    held = depth / KEYS_UNIT if chunk else 0.0
    return PassWork(rows, keys, keys), PassWork(chunk, chunk_keys, held)


def step_cost(fixed_ms: float, token_ms: float, key_ms: float, held_ms: float = 0):
    """A step's seconds: a pass's fixed cost, a token's, per 1000 keys read, and
    per 1000 keys its sequences hold."""

    def seconds(rows: PassWork, chunk: PassWork) -> float:
        tokens, keys = rows.tokens + chunk.tokens, rows.keys + chunk.keys
        held = rows.held + chunk.held
        return (fixed_ms + token_ms * tokens + key_ms * keys + held_ms * held) / 1e3

    return seconds


def paced_prefill(
    pacer, seconds, length: int, start: int = 0
) -> tuple[list[float], list[int]]:
    """Each step's seconds over a decode step's before the prompt came, and its
    chunk, while a prompt of ``length`` prefills beside two decoding rows (from
    ``start`` on: the rest a prompt-cache hit)."""
    rows_depth, none = 500, PassWork(0, 0.0)
    for _ in range(DECODE_WINDOW):
        rows, _ = one_pass(2, rows_depth, 0, 0)
        pacer.observe(seconds(rows, none), rows, none)
        rows_depth += 1
    before = statistics.median(
        seconds(one_pass(2, rows_depth - i, 0, 0)[0], none) for i in range(9)
    )
    done, ratios, chunks = start, [], []
    while done < length:
        rows, _ = one_pass(2, rows_depth, 0, 0)
        (n,) = pacer.chunks(rows, [(done, length - done)])
        rows, chunk = one_pass(2, rows_depth, n, done + n)
        took = seconds(rows, chunk)
        pacer.observe(took, rows, chunk)
        ratios.append(took / before)
        chunks.append(n)
        done += n
        rows_depth += 1
    return ratios, chunks


def test_a_one_pass_step_keeps_its_multiple_of_a_decode_step_as_the_prompt_deepens():
    """A pass costs 15 ms plus 4 ms a token and 2 ms per 1000 keys read (the
    embedded model on 2 cores, roughly): from the load's measurement, which knows
    nothing of depth, the pacer learns the key cost from the steps it sees, and
    then each step takes PASS_MULTIPLE times a decode step before the prompt
    came, however deep the prompt is."""
    pacer = PassPacer(choose_step_budget(None, costs(20, 15, 4)), 256)
    ratios, chunks = paced_prefill(pacer, step_cost(15, 4, 2), 3000)
    # On the multiple on average (a step that rounds its chunk down leaves the
    # rest to the next), and never over the most a step may take.
    assert statistics.mean(ratios[20:]) == pytest.approx(PASS_MULTIPLE, rel=0.03)
    assert max(ratios) < 1.03 * PASS_MOST
    # Deep in the prompt the chunks shrink.
    assert chunks[-1] < chunks[20]


def test_the_pacer_learns_a_token_cost_the_load_did_not_see():
    """The load timed chunks of 16 and 64, and the large one ran on another
    kernel (a fast BLAS): 28 ms a pass plus 1.9 ms a token, where the steps' small
    chunks cost 2.6 ms a token on the row kernels (the embedded model under MKL,
    whose steps ran 3x over their budget), and attention 2.8 ms per 1000 keys a
    token reads and 3.7 ms per 1000 its sequence holds (reading its KV from
    memory, once a step). From the load's small chunk (2.7 ms a token) and the
    steps it sees, the pacer keeps the steps on their multiple from the first one
    on, none over the most, and through noise of a tenth either way."""
    measured = replace(costs(18, 28.4, 1.92), chunk_token_s=0.0027)
    seconds = step_cost(15.5, 2.6, 2.8, 3.7)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    ratios, _ = paced_prefill(pacer, seconds, 3000)
    assert statistics.mean(ratios) == pytest.approx(PASS_MULTIPLE, rel=0.03)
    assert max(ratios) < 1.03 * PASS_MOST

    noise = random.Random(3)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    noisy = lambda *work: seconds(*work) * noise.uniform(0.9, 1.1)  # noqa: E731
    ratios, _ = paced_prefill(pacer, noisy, 3000)
    assert statistics.mean(ratios) == pytest.approx(PASS_MULTIPLE, rel=0.1)
    assert max(ratios) < 1.15 * PASS_MOST


def test_where_not_one_token_fits_steps_bank_their_time():
    """Deep in a prompt (a cache hit 6,000 tokens deep beside rows 500 deep),
    reading its KV takes more than a step's room: steps without a chunk bank
    their room and the next spends it, never over the most a step may take (the
    decode rows' steps taught the fit what reading KV costs; a first chunk that
    deep is a probe of two tokens at most), and never over the multiple on
    average."""
    measured = replace(costs(18, 28.4, 1.92), chunk_token_s=0.0027)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    ratios, chunks = paced_prefill(pacer, step_cost(15, 2.6, 2.8, 10), 6100, 6000)
    assert 0 < chunks[0] <= PROBE_TOKENS
    assert chunks[20:24] in ([0, 1, 0, 1], [1, 0, 1, 0])
    assert max(ratios) < 1.03 * PASS_MOST
    assert statistics.mean(ratios) < PASS_MULTIPLE


def test_a_kv_read_beyond_the_most_a_step_may_take_still_buys_its_tokens():
    """A prompt 100,000 tokens deep whose KV takes 60 ms to read, where the most
    a step may take leaves 52 ms beside two decode rows: every step that carries
    a chunk overruns by that read, so it carries the tokens the rest of its room
    buys, not one token (the prompt's 500 tokens then take some 100 steps, not
    over 1,000)."""
    measured = replace(costs(18, 28.4, 1.92), chunk_token_s=0.0027)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    seconds = step_cost(15, 2.6, 0.01, 0.6)
    ratios, chunks = paced_prefill(pacer, seconds, 100_500, 100_000)
    assert len(chunks) < 150
    alone = seconds(one_pass(2, 520, 0, 0)[0], PassWork(0, 0.0))
    assert max(ratios) < PASS_MOST + 0.065 / alone


def test_steps_whose_rows_verify_proposals_keep_their_multiple():
    """Two rows verify 0-8 proposals each step (speculation), planned after the
    last step was read (3 ms of host time more), on kernels whose tokens cost
    4.5 ms each up to 32 on the axis and 1.8 ms past them (the load's chunks of
    16 and 64 tokens measured 2.7 ms a token between them). The pacer learns
    from every step, verifying or not: the steps keep their multiple of what
    their rows alone take, none over the most, and the 3,000-token prompt is
    done in some 200 steps (a chunk of two tokens a step took 1,500)."""
    measured = replace(costs(20, 15, 2.7), chunk_token_s=0.0045)

    def seconds(work: PassWork, read: bool) -> float:
        tokens = min(work.tokens, 32) * 4.5 + max(work.tokens - 32, 0) * 1.8
        return (15 + 3 * read + tokens + 2.8 * work.keys + 3.7 * work.held) / 1e3

    draws = random.Random(5)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    depth, done, ratios, steps = 1500, 0, [], 0

    def rows_now() -> PassWork:
        rows = NO_WORK
        for _ in range(2):
            rows += chunk_work(1 + draws.choice((0, 0, 3, 8)), depth)
        return rows

    for _ in range(64):
        rows = rows_now()
        pacer.observe(seconds(rows, True), rows, NO_WORK, True)
        depth += 2
    while done < 3000:
        rows = rows_now()
        (n,) = pacer.chunks(rows, [(done, 3000 - done)], read=True)
        work = rows + chunk_work(n, done) if n else rows
        took = seconds(work, True)
        pacer.observe(took, rows, chunk_work(n, done) if n else NO_WORK, True)
        ratios.append(took / seconds(rows, True))
        done, depth, steps = done + n, depth + 2, steps + 1
    assert steps < 250
    assert max(ratios) < 1.05 * PASS_MOST
    assert statistics.mean(ratios) == pytest.approx(PASS_MULTIPLE, rel=0.1)


def test_a_one_pass_budget_in_tokens_or_none():
    pacer = PassPacer(StepBudget("test", tokens=13), 256)
    assert pacer.chunks(PassWork(0, 0.0), [(0, 1000)]) == [256]
    assert pacer.chunks(PassWork(4, 1.0), [(900, 1000)]) == [9]
    assert pacer.chunks(PassWork(4, 1.0), [(900, 5), (10, 100)]) == [5, 4]
    assert pacer.chunks(PassWork(20, 1.0), [(900, 1000)]) == [1]
    assert PassPacer(NO_STEP_BUDGET, 256).chunks(PassWork(4, 1.0), [(0, 900)]) == [256]
    assert pacer.chunks(PassWork(4, 1.0), []) == []


def test_each_prompt_in_a_step_pays_for_reading_its_kv():
    """Once the pacer has learnt what a chunk costs, a shallow prompt and a deep
    one in the same step are each charged their KV's read: the shallow one takes
    the 8 tokens it has left, the deep one what then fits, and the step stays
    within the most it may take."""
    measured = replace(costs(18, 28.4, 1.92), chunk_token_s=0.0027)
    seconds = step_cost(15.5, 2.6, 2.8, 3.7)
    pacer = PassPacer(StepBudget("t", costs=measured), 256)
    paced_prefill(pacer, seconds, 3000)
    rows, none = *one_pass(2, 600, 0, 0)[:1], PassWork(0, 0.0)
    shallow, deep = pacer.chunks(rows, [(100, 8), (3000, 1000)])
    assert shallow == 8 and 0 < deep < 8
    took = seconds(rows, none)
    for held, n in ((100, shallow), (3000, deep)):
        took += seconds(none, one_pass(0, 0, n, held + n)[1]) - seconds(none, none)
    assert took < 1.03 * PASS_MOST * seconds(rows, none)
