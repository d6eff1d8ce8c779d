"""The one-pass decoder over paged KV (``mlx_backend/decoders/paged.py``), driven by
hand: every family of the matrix either runs on pages, its greedy tokens and
logprobs as mlx-lm's alone while sequences join, leave and start from a cached
prefix with chunks that split pages, or is refused with its reason, and on
quantized pages as mlx-lm over its quantized cache; a long prompt
beside two decoding sequences is done within a bounded number of steps where the
batch decoder starves it; rows that verify proposals decode as mlx-lm alone; pages
come back on finish, cancel and error, verifying or not; kept states of a decoder
reset after a failed step are never served."""

import copy
import gc
import math
import random
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load as load_mlx_lm

from mlx_backend.caches.page_tables import WINDOW_SLACK
from mlx_backend.caches.paged import (
    HOLE,
    PAGE_TOKENS,
    PagedPrefix,
    pages_for,
    trim_floor,
)
from mlx_backend.cpu.kernels.fast_ops import mlx_fast_ops, route_fast_ops
from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.factory import make_plain_decoder
from mlx_backend.decoders.paged import (
    NotPaged,
    PagedDecoder,
    paged_layers,
    paged_shapes,
)
from mlx_backend.decoders.step_budget import PASS_MULTIPLE, StepBudget, StepCosts
from mlx_backend.engine.prompt_store import (
    PromptCounts,
    PromptStore,
    make_prompt_cache,
    paged_layer,
)
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.mlx_lm_fixes import apply_fixes
from mlx_utils import check_kv_cache, make_kv_cache
from python_utils import apply_cache_types, parse_options
from tests.family_models import FAMILIES, WINDOW
from tests.support import EagerLookup, device_tolerance, near_tie
from tests.tiny_models import FLAT

# The families whose caches and attention run on pages; the rest say why not.
PAGED = {
    "llama",
    "qwen3",
    "phi3",
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "nemotron_h",
    "granitemoehybrid",
    "lfm2",
    "mamba2",
    "deepseek_v3",
}
OPTIONS = parse_options(["prefill_step_size:256"])
# Prompt tokens a step carries beside decode rows: chunks of 13 less the rows,
# which split pages at varied offsets.
SMALL_STEPS = StepBudget("test", tokens=13)


def prompt_of(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 250) for _ in range(length))


def reference(
    model, prompt, max_tokens: int, cache=None
) -> list[tuple[int, float, float]]:
    """mlx-lm's greedy tokens alone (over ``cache``, by default mlx-lm's own),
    with each one's logprob and margin."""
    steps = []
    for token, logprobs in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=greedy_sampler,
        prompt_cache=cache,
    ):
        second, first = mx.sort(logprobs)[-2:].tolist()
        steps.append((token, logprobs[token].item(), first - second))
    return steps


def sequence(model, prompt, max_tokens, cache=None, rest=None, **fields):
    return NewSequence(
        prompt=prompt,
        rest=prompt if rest is None else rest,
        kv_cache=cache or make_kv_cache(model, OPTIONS),
        sampler=greedy_sampler,
        processors=[],
        max_tokens=max_tokens,
        logprobs=1,
        **fields,
    )


def run_until_done(decoder, keys: dict) -> dict:
    """Step until every sequence in ``keys`` (key -> name) is done: each name's
    tokens and logprobs, and its KV state."""
    out = {name: ([], [], None) for name in keys.values()}
    while keys:
        for result in decoder.step():
            assert result.error is None
            name = keys.get(result.key)
            if name is None:
                continue
            tokens, scores, _ = out[name]
            tokens += result.tokens
            scores += [s[0] for s in result.logprobs]
            if result.done:
                del keys[result.key]
                out[name] = (tokens, scores, decoder.remove(result.key))
    return out


def assert_as_reference(tokens, scores, steps) -> None:
    """Token for token as mlx-lm alone, up to a near tie; logprobs within noise
    (float32 rounding, which grows with the logprob: gemma3's at -4.2 differed by
    1.2e-4 on a suite's worker threads)."""
    for i, (token, logprob, margin) in enumerate(steps):
        if tokens[i] != token:
            assert margin < near_tie(), f"parted at {i}: {tokens} != {steps}"
            return
        tolerance = device_tolerance(1e-4, 10)
        assert scores[i] == pytest.approx(logprob, rel=tolerance, abs=tolerance)
    assert len(tokens) == len(steps)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_folder):
    apply_fixes()
    route_fast_ops()
    model, _ = load_mlx_lm(str(family_folder(request.param)))
    return request.param, model


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "gathered"])
def test_families_on_pages_as_mlx_lm(family, kernels):
    name, model = family
    try:
        shapes = paged_layers(model, OPTIONS)
    except NotPaged as e:
        assert name not in PAGED, f"{name} fell back: {e}"
        assert str(e)
        return
    assert name in PAGED
    prompts = {
        "short": prompt_of(9, 1),
        "long": prompt_of(3 * PAGE_TOKENS + 5, 2),
        "late": prompt_of(40, 3),
    }
    with mlx_fast_ops() if not kernels else _nothing():
        decoder = PagedDecoder(model, OPTIONS, shapes, SMALL_STEPS)
        keys = {decoder.add(sequence(model, prompts["short"], 10)): "short"}
        keys[decoder.add(sequence(model, prompts["long"], 12))] = "long"
        out = {}
        for _ in range(4):
            for result in decoder.step():
                name_ = keys[result.key]
                tokens, scores, _ = out.setdefault(name_, ([], [], None))
                tokens += result.tokens
                scores += [s[0] for s in result.logprobs]
        # A sequence joins mid-run, as others decode and prefill.
        keys[decoder.add(sequence(model, prompts["late"], 12))] = "late"
        rest = run_until_done(decoder, dict(keys))
        for n, (tokens, scores, state) in rest.items():
            before = out.get(n, ([], [], None))
            out[n] = (before[0] + tokens, before[1] + scores, state)
        for n, prompt in prompts.items():
            tokens, scores, state = out[n]
            steps = reference(model, prompt, len(tokens))
            assert_as_reference(tokens, scores, steps)
            # Its KV state holds the prompt and every token fed after it.
            assert list(state.tokens) == [*prompt, *tokens[:-1]]
            paged = paged_layer(state.cache)
            assert paged is None or paged.offset == len(state.tokens)
        # A second turn starts from the first's KV state, whose full pages it
        # shares; a third from a copy in mlx-lm's caches, loaded into pages.
        tokens, _, state = out["long"]
        second = (*state.tokens, tokens[-1], *prompt_of(20, 4))
        rest = second[len(state.tokens) :]
        key = decoder.add(sequence(model, second, 8, cache=state.cache, rest=rest))
        paged = paged_layer(state.cache)
        # A layer that sees every key holds its first page (a window's: a hole).
        full = [c for c in state.cache if isinstance(c, PagedPrefix)]
        full = [c for c in full if not c.lease.start]
        assert paged is None or full[0].lease.kv.refs(full[0].lease.pages[0]) == 2
        tokens, scores, _ = run_until_done(decoder, {key: "second"})["second"]
        assert_as_reference(tokens, scores, reference(model, second, 8))
        dense = as_mlx_lm(state.cache)
        key = decoder.add(sequence(model, second, 8, cache=dense, rest=rest))
        tokens, scores, _ = run_until_done(decoder, {key: "third"})["third"]
        assert_as_reference(tokens, scores, reference(model, second, 8))
        # The kept states alone held pages (Mamba 2 has none).
        assert decoder.kv_nbytes() == 0
        assert (decoder.pages_nbytes() > 0) == bool(paged_shapes(shapes))
        del out, rest, state, paged, full, dense, _
        gc.collect()
        assert decoder.pages_nbytes() == 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_a_hybrid_s_snapshot_ends_a_chunk_and_holds_its_state(family_folder, name):
    """A recurrent state is only had where a chunk ends: a prompt snapshot in
    the middle of what would be one chunk ends a chunk there, its kept state
    holds the recurrent layers' state at that token beside the pages before it,
    and a sequence that starts from it decodes as mlx-lm."""
    apply_fixes()
    model, _ = load_mlx_lm(str(family_folder(name)))
    decoder = PagedDecoder(model, OPTIONS, paged_layers(model, OPTIONS))
    prompt, middle = prompt_of(2 * PAGE_TOKENS + 9, 11), PAGE_TOKENS + 7
    key = decoder.add(sequence(model, prompt, 6, snapshots=(middle,)))
    kept, tokens = {}, []
    while key in decoder._rows:
        for result in decoder.step():
            kept.update({len(s.tokens): s.cache for s in result.snapshots})
            tokens += result.tokens
            if result.done:
                decoder.remove(key)
    assert tokens == [t for t, _, _ in reference(model, prompt, 6)]
    assert sorted(kept) == [middle]
    second = (*prompt[:middle], *prompt_of(20, 12))
    key = decoder.add(
        sequence(model, second, 8, cache=kept[middle], rest=second[middle:])
    )
    tokens, scores, _ = run_until_done(decoder, {key: "second"})["second"]
    assert_as_reference(tokens, scores, reference(model, second, 8))
    decoder.close()


def test_families_on_quantized_pages_as_mlx_lm_quantized(family):
    """kv_bits 8 in groups of 32: every family that runs on pages runs on quantized
    pages (its window layers' pages unquantized, as mlx-lm leaves them), its greedy
    tokens as mlx-lm's alone over its quantized cache while a sequence joins; a
    second turn from a kept state's shared pages, and one from its copy in
    mlx-lm's quantized caches loaded into pages, decode as mlx-lm too."""
    name, model = family
    options = replace(OPTIONS, kv_bits=8, kv_group_size=32)
    try:
        check_kv_cache(model, options)
    except InvalidArgument:
        # MLA's latents can't be quantized (the load refuses that).
        assert name == "deepseek_v3"
        return
    try:
        shapes = paged_layers(model, options)
    except NotPaged as e:
        assert name not in PAGED, f"{name} fell back: {e}"
        return
    assert name in PAGED
    layers = paged_shapes(shapes)
    # Mamba 2 has no attention layer.
    assert {s.bits for s in layers} - {None} == ({8} if layers else set())
    prompts = {"long": prompt_of(3 * PAGE_TOKENS + 5, 2), "late": prompt_of(40, 3)}
    decoder = PagedDecoder(model, options, shapes, SMALL_STEPS)
    keys = {decoder.add(sequence(model, prompts["long"], 10)): "long"}
    decoder.step()
    keys[decoder.add(sequence(model, prompts["late"], 10))] = "late"
    out = run_until_done(decoder, keys)

    def quantized_reference(prompt, max_tokens):
        return reference(model, prompt, max_tokens, make_kv_cache(model, options))

    for n, prompt in prompts.items():
        tokens, _, state = out[n]
        assert_near_quantized(tokens, quantized_reference(prompt, len(tokens)))
    tokens, _, state = out["long"]
    second = (*state.tokens, tokens[-1], *prompt_of(20, 4))
    rest = second[len(state.tokens) :]
    theirs = quantized_reference(second, 6)
    for cache in (state.cache, as_mlx_lm(state.cache)):
        key = decoder.add(sequence(model, second, 6, cache=cache, rest=rest))
        mine, _, _ = run_until_done(decoder, {key: "next"})["next"]
        assert_near_quantized(mine, theirs)
    decoder.close()


# Quantized KV rounds the keys in float32 here and in the model's dtype in
# mlx-lm, amplifying rounding as the quantized-KV tests measure (up to 0.4 in a
# logprob): tokens may part where mlx-lm's two best were that close.
QUANTIZED_NOISE = 0.4


def assert_near_quantized(tokens, steps) -> None:
    """Token for token as mlx-lm's steps, up to where mlx-lm's margin was within
    twice ``QUANTIZED_NOISE``."""
    assert len(tokens) == len(steps)
    for i, (token, _, margin) in enumerate(steps):
        if tokens[i] != token:
            assert margin < 2 * QUANTIZED_NOISE, f"parted at {i}: {tokens} != {steps}"
            return


def as_mlx_lm(cache: list) -> list:
    """A kept state's copy in mlx-lm's caches (its recurrent layers are)."""
    return [
        layer.to_kv_cache() if isinstance(layer, PagedPrefix) else copy.copy(layer)
        for layer in cache
    ]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def llama(family_folder):
    route_fast_ops()
    model, _ = load_mlx_lm(str(family_folder("llama")))
    return model


# A decode step's 20 ms and a prompt token's 4 ms, as a 2-core CPU runs the
# embedded model; the paged pacer learns these rather than the steps' own times,
# the batch one nothing (no timing in the test).
COSTS = StepCosts(decode_s=0.02, pass_s=0.0, token_s=0.004, peak_bytes_per_token=0)
LONG = 3000


def steps_to_prefill(decoder, model, limit: int, **fields) -> int | None:
    """Steps until a 3,000-token prompt's first token, while two sequences
    (``fields``: their ``NewSequence`` fields) decode throughout; None: not
    within ``limit``."""
    if isinstance(decoder, PagedDecoder):
        # The steps take what COSTS says, whatever this machine's pace.
        observe = decoder.pacer.observe
        decoder.pacer.observe = lambda _, rows, chunk, read: observe(
            COSTS.decode_s + COSTS.token_s * (rows.tokens + chunk.tokens - 1),
            rows,
            chunk,
            read,
        )
    else:
        decoder.pacer.observe = lambda *args, **kwargs: None
    for seed in (5, 6):
        decoder.add(sequence(model, prompt_of(7, seed) * 3, 10_000, **fields))
    for _ in range(8):
        decoder.step()
    long = decoder.add(sequence(model, prompt_of(LONG, 7), 4))
    for step in range(1, limit + 1):
        if any(r.key == long and r.tokens for r in decoder.step()):
            return step
    return None


def test_a_long_prompt_beside_decoding_sequences_is_done_in_bounded_steps(llama):
    """A step takes PASS_MULTIPLE times what its two decode rows alone would (a
    pass's fixed cost, at least a decode step's less its token, and a token's):
    the paged pass carries the prompt tokens that fit in the rest, beside its
    decode rows, about 12 a step here. The batch decoder's budget for a pass of
    its own, which reads every weight again, left the prompt one token a step."""
    budget = StepBudget("test", costs=COSTS)
    alone = COSTS.decode_s - COSTS.token_s + 2 * COSTS.token_s
    per_step = math.floor((PASS_MULTIPLE - 1) * alone / COSTS.token_s)
    bound = LONG // per_step + 3
    shapes = paged_layers(llama, OPTIONS)
    paged = PagedDecoder(llama, OPTIONS, shapes, budget)
    assert steps_to_prefill(paged, llama, bound) is not None
    batch = BatchDecoder(llama, OPTIONS, True, budget=budget)
    assert steps_to_prefill(batch, llama, bound) is None
    batch.close()


def test_rows_that_verify_proposals_leave_a_long_prompt_its_share(llama):
    """The same, with both sequences verifying proposals: a step that reads the
    last one first, to propose from its tokens, is timed as any other (the
    pacer once learnt nothing from them and fed the prompt two tokens a step)."""
    budget = StepBudget("test", costs=COSTS)
    alone = COSTS.decode_s - COSTS.token_s + 2 * COSTS.token_s
    bound = LONG // math.floor((PASS_MULTIPLE - 1) * alone / COSTS.token_s) + 3
    decoder = speculating(llama, budget)
    assert steps_to_prefill(decoder, llama, bound, draft_tokens=4) is not None
    assert decoder.draft_proposed > 100


class Known(EagerLookup):
    """Proposes a sequence's reference continuation (``known``: each one's
    prompt and tokens), every fourth proposal wrong, so that verifications keep
    some and reject the rest."""

    def __init__(self, known: list[list[int]]):
        super().__init__(1, 3)
        self.known = known

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        n = len(tokens)
        for whole in self.known:
            if whole[:n] == list(tokens):
                ahead = whole[n : n + limit]
                return [t + 1 if (n + i) % 4 == 0 else t for i, t in enumerate(ahead)]
        return []


def speculating(model, budget: StepBudget = SMALL_STEPS) -> PagedDecoder:
    """A paged decoder whose rows verify every lookup proposal (flat costs)."""
    decoder = PagedDecoder(model, OPTIONS, paged_layers(model, OPTIONS), budget)
    decoder.speculate(lambda: EagerLookup(1, 3), FLAT)
    return decoder


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "nemotron_h", "lfm2"])
def test_rows_that_verify_proposals_decode_as_mlx_lm(family_folder, name):
    """Prompts that repeat themselves, so lookup proposes from the first token:
    each row verifies in the step's pass beside the others (and a prompt's
    chunks), keeps what mlx-lm alone makes, and its kept state holds only the
    tokens it kept. A hybrid's rows verify too: where a proposal is rejected
    their recurrent states go back to before the pass and the kept tokens run
    again in front of the next one; a kept state ends where its recurrent
    states do, and a second turn from it decodes as mlx-lm."""
    apply_fixes()
    model, _ = load_mlx_lm(str(family_folder(name)))
    prompts = {
        f"loop{seed}": prompt_of(12, seed) * 3 + prompt_of(5, seed + 10)
        for seed in (21, 22, 23)
    }
    known = [
        [*p, *(t for t, _, _ in reference(model, p, 16))] for p in prompts.values()
    ]
    decoder = PagedDecoder(model, OPTIONS, paged_layers(model, OPTIONS), SMALL_STEPS)
    decoder.speculate(lambda: Known(known), FLAT)
    keys = {
        decoder.add(sequence(model, p, 16, draft_tokens=4)): n
        for n, p in prompts.items()
    }
    out = run_until_done(decoder, keys)
    assert decoder.draft_proposed > decoder.draft_accepted > 0
    for n, (tokens, scores, state) in out.items():
        steps = reference(model, prompts[n], 16)
        assert_as_reference(tokens, scores, steps)
        # The last token is returned, not fed: the state holds the rest.
        fed = [*prompts[n], *tokens[:-1]]
        if name == "llama":
            assert state.tokens == fed
        assert state.tokens == fed[: len(state.tokens)]
        second = (*fed, tokens[-1], *prompt_of(6, 30))
        rest = second[len(state.tokens) :]
        key = decoder.add(sequence(model, second, 6, cache=state.cache, rest=rest))
        mine, scores, _ = run_until_done(decoder, {key: "second"})["second"]
        assert_as_reference(mine, scores, reference(model, second, 6))
    # One that leaves while its pass verifies keeps what that pass started from.
    prompt = prompts["loop21"]
    key, got = decoder.add(sequence(model, prompt, 16, draft_tokens=4)), []
    for _ in range(40):
        got += [t for r in decoder.step() if r.key == key for t in r.tokens]
        queued = decoder._queued
        if any(r.key == key and d for r, d in zip(queued.rows, queued.drafts)):
            break
    else:
        pytest.fail("no pass verified")
    state = decoder.remove(key)
    fed = [*prompt, *got]
    assert state.tokens == fed[: len(state.tokens)]
    second = (*fed, *prompt_of(6, 31))
    rest = second[len(state.tokens) :]
    key = decoder.add(sequence(model, second, 6, cache=state.cache, rest=rest))
    mine, scores, _ = run_until_done(decoder, {key: "third"})["third"]
    assert_as_reference(mine, scores, reference(model, second, 6))


@pytest.mark.parametrize("verifying", [False, True], ids=["plain", "verifying"])
def test_pages_come_back_on_finish_cancel_and_error(llama, verifying):
    if verifying:
        decoder = speculating(llama)
    else:
        decoder = PagedDecoder(
            llama, OPTIONS, paged_layers(llama, OPTIONS), SMALL_STEPS
        )
    kv = decoder._kv
    rng = random.Random(68)
    cancelled = set()
    live = set()
    for round_ in range(60):
        if rng.random() < 0.5 or not live:
            flag = rng.random() < 0.2
            seq = sequence(
                llama,
                prompt_of(rng.randint(1, 45), round_) * 2,
                rng.randint(1, 6),
                cancelled=(lambda: True) if flag else (lambda: False),
                draft_tokens=3,
            )
            key = decoder.add(seq)
            live.add(key)
            if flag:
                cancelled.add(key)
        elif rng.random() < 0.3:
            # A client that leaves mid-run.
            decoder.remove(live.pop())
        for result in decoder.step():
            assert result.error is None
            if result.done and result.key in live:
                live.discard(result.key)
                decoder.remove(result.key, keep_state=rng.random() < 0.5)
    assert cancelled
    assert (decoder.draft_proposed > 0) == verifying
    for key in list(live):
        decoder.remove(key)
    assert kv.pages_held == 0
    # An error in a step drops every sequence, and their pages.
    decoder.add(sequence(llama, prompt_of(50, 9), 5))
    decoder.add(sequence(llama, prompt_of(70, 10), 5))
    decoder.step()

    def fail(*args):
        raise RuntimeError("boom")

    decoder._forward = fail
    results = decoder.step()
    assert len(results) == 2 and all(r.done and r.error for r in results)
    assert decoder.kv_nbytes() == 0


def test_a_prompt_of_many_chunks_alone_as_mlx_lm(llama):
    """Steps that only prefill (no row samples) write their KV and return nothing."""
    options = parse_options(["prefill_step_size:16"])
    decoder = PagedDecoder(llama, options, paged_layers(llama, options))
    prompt = prompt_of(70, 11)
    key = decoder.add(sequence(llama, prompt, 6))
    assert decoder.step() == [] and decoder.step() == []
    tokens, scores, _ = run_until_done(decoder, {key: "alone"})["alone"]
    assert_as_reference(tokens, scores, reference(llama, prompt, 6))


def test_kept_states_of_a_reset_decoder_are_dropped_not_served(llama):
    """After a failed step the decoder starts a new store; the prompt cache's
    entries that hold the old one's pages (which may hold the failed step's
    writes) are dropped at the next fetch, which misses."""
    decoder = PagedDecoder(llama, OPTIONS, paged_layers(llama, OPTIONS), SMALL_STEPS)
    store = PromptStore(
        make_prompt_cache(OPTIONS, 1 << 30),
        1,
        lambda: make_kv_cache(llama, OPTIONS),
        PromptCounts(),
    )
    prompt, other = prompt_of(40, 12), prompt_of(50, 13)
    for p in (prompt, other):
        key = decoder.add(sequence(llama, p, 3))
        state = run_until_done(decoder, {key: "one"})["one"][2]
        store.keep(state.cache, state.tokens, later=True)
    cache, rest = store.fetch(prompt, pages=True)
    assert len(rest) == 1 and isinstance(cache[0], PagedPrefix)
    key = decoder.add(sequence(llama, prompt, 3, cache=cache, rest=rest))
    decoder.reset()
    cache, rest = store.fetch(prompt, pages=True)
    assert rest == prompt and not isinstance(cache[0], PagedPrefix)
    assert len(store.cache) == 0


def test_float16_pages_hold_half_the_bytes_and_decode_as_mlx_lm(llama):
    """kv_dtype:float16 keeps the pages in float16 (the CPU kernel widens a block
    at a time): half the bytes, and the greedy tokens of mlx-lm's float32 KV up to
    a near tie, their logprobs within float16's rounding."""
    options = parse_options(["prefill_step_size:256", "kv_dtype:float16"])
    shapes = paged_layers(llama, options)
    assert {s.stored for s in shapes} == {mx.float16}
    decoder = PagedDecoder(llama, options, shapes, SMALL_STEPS)
    wide = PagedDecoder(llama, OPTIONS, paged_layers(llama, OPTIONS), SMALL_STEPS)
    assert 2 * decoder._kv.page_nbytes == wide._kv.page_nbytes
    prompts = {"a": prompt_of(45, 21), "b": prompt_of(90, 22)}
    keys = {decoder.add(sequence(llama, p, 10)): n for n, p in prompts.items()}
    out = run_until_done(decoder, keys)
    for name, prompt in prompts.items():
        tokens, scores, state = out[name]
        steps = reference(llama, prompt, len(tokens))
        for i, (token, logprob, margin) in enumerate(steps):
            if tokens[i] != token:
                assert margin < 1e-2, f"parted at {i}"
                break
            assert scores[i] == pytest.approx(logprob, abs=1e-2)
        # Kept states come back in the model's dtype.
        assert state.cache[0].to_kv_cache().keys.dtype == shapes[0].dtype


def test_kv_dtype_without_the_paged_pass_is_refused(llama):
    options = parse_options(["kv_dtype:float16", "paged:false"])
    with pytest.raises(InvalidArgument, match="kv_dtype.*paged is off"):
        make_plain_decoder(llama, options)


def test_cache_type_f16_stores_float16_pages_and_nothing_else_refuses(llama):
    """LocalAI's CacheTypeKey/Value f16 (llama.cpp's KV type) types the pages;
    where the batch decoder serves, the KV keeps the model's type, and the load
    goes on (kv_dtype, the option, is refused there)."""
    options = apply_cache_types(parse_options(["prefill_step_size:256"]), "f16", "f16")
    assert {s.stored for s in paged_layers(llama, options)} == {mx.float16}
    batch = make_plain_decoder(llama, replace(options, paged=False))
    assert isinstance(batch, BatchDecoder)
    batch.close()


def test_a_window_state_that_went_round_loads_its_last_tokens(family_folder):
    """A sliding-window layer's state past its window (a file the batch decoder
    wrote) keeps its last tokens, in a ring: they go into pages at their places
    (the pages before them holes), and the prompt's last token decodes as
    mlx-lm alone."""
    model, _ = load_mlx_lm(str(family_folder("gemma3_text")))
    prompt = prompt_of(80, 30)
    cache = make_kv_cache(model, OPTIONS)
    # One token at a time past the window: the ring's writes wrap around.
    mx.eval(model(mx.array(prompt[:8])[None], cache=cache))
    for token in prompt[8:-1]:
        mx.eval(model(mx.array([[token]]), cache=cache))
    decoder = PagedDecoder(model, OPTIONS, paged_layers(model, OPTIONS))
    key = decoder.add(sequence(model, prompt, 8, cache=cache, rest=prompt[-1:]))
    window = decoder._rows[key].tables[decoder._kv.windows.index(WINDOW)]
    assert window.start == len(prompt) - 1 - WINDOW and window.pages[0] == HOLE
    tokens, scores, _ = run_until_done(decoder, {key: "again"})["again"]
    assert_as_reference(tokens, scores, reference(model, prompt, 8))


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "gemma4_text"])
def test_a_window_frees_its_pages_behind_it_and_decodes_as_mlx_lm(family_folder, name):
    """A 230-token prompt in chunks of 32 and a repeating one whose rows verify
    proposals: a window layer's table holds at most its window, its slack, a
    chunk and a page at either end, the full layers' every page, and the tokens
    are mlx-lm's alone. Their kept states serve a second turn and the prompt
    sent again (a trim of one token), not a prompt that parts from them before
    their floor."""
    apply_fixes()
    model, _ = load_mlx_lm(str(family_folder(name)))
    options = parse_options(["prefill_step_size:32"])
    shapes = paged_layers(model, options)
    assert {s.window for s in shapes} == {0, WINDOW}
    prompts = {"long": prompt_of(230, 40), "loop": prompt_of(12, 41) * 10}
    known = [
        [*p, *(t for t, _, _ in reference(model, p, 24))] for p in prompts.values()
    ]
    decoder = PagedDecoder(model, options, shapes, SMALL_STEPS)
    decoder.speculate(lambda: Known(known), FLAT)
    keys = {
        decoder.add(sequence(model, p, 24, draft_tokens=4)): n
        for n, p in prompts.items()
    }
    full, window = (decoder._kv.windows.index(w) for w in (0, WINDOW))
    most = pages_for(WINDOW + WINDOW_SLACK + 32) + 2
    out = {n: ([], [], None) for n in prompts}
    freed = 0
    while keys:
        for result in decoder.step():
            name_ = keys[result.key]
            out[name_][0].extend(result.tokens)
            out[name_][1].extend(s[0] for s in result.logprobs)
            if result.done:
                del keys[result.key]
                out[name_] = (*out[name_][:2], decoder.remove(result.key))
        for row in decoder._rows.values():
            held = [p for p in row.tables[window].pages if p != HOLE]
            assert len(held) <= most
            assert HOLE not in row.tables[full].pages
            freed = max(freed, len(row.tables[window].pages) - len(held))
    assert freed >= 3 and decoder.draft_accepted > 0
    store = PromptStore(
        make_prompt_cache(options, 1 << 30),
        1,
        lambda: make_kv_cache(model, options),
        PromptCounts(),
    )
    for n, prompt in prompts.items():
        tokens, scores, state = out[n]
        assert_as_reference(tokens, scores, reference(model, prompt, 24))
        store.keep(state.cache, state.tokens, later=True)
    fed = out["long"][2].tokens
    floor = trim_floor(out["long"][2].cache)
    assert 0 < floor < len(fed) - 1
    del out, state
    # The prompt sent again, one that parts before the floor, a second turn
    # (from the first's state, trimmed by the tokens it made).
    again = fed
    parted = (*fed[: floor - 5], *prompt_of(10, 43))
    second = (*fed, *prompt_of(10, 42))
    for prompt, reused in ((again, len(fed) - 1), (parted, 0), (second, len(fed))):
        cache, rest = store.fetch(prompt, pages=True)
        assert len(prompt) - len(rest) == reused
        key = decoder.add(sequence(model, prompt, 6, cache=cache, rest=rest))
        mine, scores, state = run_until_done(decoder, {key: "next"})["next"]
        assert_as_reference(mine, scores, reference(model, prompt, 6))
        store.keep(state.cache, state.tokens, later=True)
