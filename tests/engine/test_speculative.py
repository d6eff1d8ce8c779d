"""Speculative decoding, in-process on the embedded model.

The output is what plain decoding gives, alone, in a batch and when a lone
sequence joins a batch, and it is cut where plain decoding cuts it; seeded
sampling draws the same tokens; cancellation stops it; Status and the request
metrics count proposals; draft models propose. Each runs on the batch decoder
(a lone sequence speculates) and on the paged one (every row may). (tests/unit/test_speculative.py
checks the sampled distribution on a tiny llama.)
"""

import asyncio

import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from mlx_backend.decoders.proposers import NgramProposer
from mlx_backend.decoders.speculative import SpeculativeDecoder
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.loading import LoadPlan, ModelLoadError
from mlx_backend.output.reply_pipeline import Finished
from mlx_backend.request_parsing import SamplingParams
from python_utils import LoadOptions
from tests.engine_helpers import (
    chat_prompt,
    collect,
    generation,
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
    wait_idle,
)
from tests.support import QUESTION
from tests.tiny_models import FLAT, make_tiny_draft

PARAGRAPH = (
    "The old lighthouse stood on the northern cliff for more than two hundred "
    "years. Sailors trusted its beam to guide them past the rocks, and the "
    "keeper's family lived in the small stone cottage at its base, tending the "
    "lamp every night."
)
REPEAT = "Repeat this paragraph exactly, word for word:\n\n" + PARAGRAPH
POEM = "Write a short poem about the sea."


# The decoder's options: the batch decoder's and the paged one's.
MODES = {"batch": ("paged:false",), "paged": ("paged:true",)}


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


# Behaviour that doesn't depend on which decoder verifies (the engine cuts the
# tokens; the batch decoder's own moves), or that pages cover in
# tests/engine/test_paged_decoder.py: on the batch decoder alone, for the suite's time.
BATCH_ONLY = pytest.mark.parametrize("mode", ["batch"], indirect=True)


@pytest.fixture(scope="module")
def plain(mode):
    engine = load_engine("speculative:off", *MODES[mode])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def speculative(mode):
    engine = load_engine(*MODES[mode])
    assert isinstance(engine.served.decoder, PagedDecoder) == (mode == "paged")
    on_engine_thread(
        engine, lambda model, options: setattr(engine.served.decoder, "costs", FLAT)
    )
    yield engine
    engine.shutdown()


def both(plain, speculative, *texts, **fields) -> tuple[list, list]:
    """Each text's events from the plain and the speculative engine, submitted
    together on each."""
    fields.setdefault("max_tokens", 64)
    expected = run(plain, *(generation(plain, t, **fields) for t in texts))
    actual = run(speculative, *(generation(speculative, t, **fields) for t in texts))
    return expected, actual


def check_same(expected: list, actual: list) -> None:
    assert text_of(actual) == text_of(expected)
    want, got = expected[-1], actual[-1]
    assert isinstance(got, Finished)
    assert (got.finish_reason, got.completion_tokens) == (
        want.finish_reason,
        want.completion_tokens,
    )
    entries = [e for event in expected for e in event.logprobs]
    got_entries = [e for event in actual for e in event.logprobs]
    assert [e.token for e in got_entries] == [e.token for e in entries]
    for a, b in zip(got_entries, entries):
        # One pass over several tokens rounds differently from one over one.
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def proposals(engine) -> tuple[int, int]:
    memory = stats_after(engine)
    return memory["draft_tokens_proposed"], memory["draft_tokens_accepted"]


def trace_steps(engine, *texts: str, max_tokens: int = 64) -> list[dict]:
    """Each step's tokens per text (by index), greedy sequences that start
    together, as the speculative decoder (with flat costs) makes them."""
    prompts = [chat_prompt(engine, text) for text in texts]

    def steps(model, options):
        if options.paged:
            decoder = PagedDecoder(model, options, paged_layers(model, options))
            decoder.speculate(lambda: NgramProposer(2, 4), FLAT)
        else:
            decoder = SpeculativeDecoder(
                BatchDecoder(model, options, True),
                model,
                lambda: NgramProposer(2, 4),
                costs=FLAT,
            )
        keys = {}
        for i, prompt in enumerate(prompts):
            sequence = NewSequence(
                prompt,
                prompt,
                make_prompt_cache(model),
                greedy_sampler,
                [],
                max_tokens,
                draft_tokens=8,
            )
            keys[decoder.add(sequence)] = i
        made = []
        while keys:
            results = decoder.step()
            made.append({keys[r.key]: r.tokens for r in results if r.tokens})
            for r in results:
                if r.done:
                    del keys[r.key]
        decoder.close()
        return [step for step in made if step]

    return on_engine_thread(engine, steps)


def trace(engine, text: str, max_tokens: int = 64) -> list[tuple[int, ...]]:
    """The tokens of each step of a lone greedy sequence."""
    return [step[0] for step in trace_steps(engine, text, max_tokens=max_tokens)]


@pytest.mark.parametrize(
    "mode, text",
    [
        ("batch", REPEAT),
        ("batch", POEM),
        ("batch", QUESTION),
        ("paged", REPEAT),
        ("paged", QUESTION),
    ],
    ids=["batch-copy", "batch-poem", "batch-answer", "paged-copy", "paged-answer"],
    indirect=["mode"],
)
def test_greedy_output_is_plain_decoding(plain, speculative, text):
    before = proposals(speculative)
    (expected,), (actual,) = both(plain, speculative, text, logprobs=2)
    check_same(expected, actual)
    proposed, accepted = (a - b for a, b in zip(proposals(speculative), before))
    metrics = speculative.last_metrics
    assert (metrics.draft_tokens_proposed, metrics.draft_tokens_accepted) == (
        proposed,
        accepted,
    )
    if text == REPEAT:
        # All but the proposals past the paragraph's end.
        assert proposed > 0 and accepted >= 0.85 * proposed
    elif text == POEM:
        # Some proposals are taken and some thrown away.
        assert 0 < accepted < proposed
    else:
        # Its guesses hold too rarely to pay for leaving the batch.
        assert proposed == 0


def test_a_lone_sequence_leaves_once_its_guesses_hold(speculative, mode):
    """Prompt lookup is checked against plain decoding first: the copy's guesses
    hold twice while it decodes in the batch (with flat costs, what makes leaving
    it pay), and only then does it speculate. On pages the step in flight, which
    the second hit's read overlapped, comes first."""
    steps = trace(speculative, REPEAT)
    first = [1, 1, 1, 9] if mode == "batch" else [1, 1, 1, 1, 9]
    assert [len(tokens) for tokens in steps[: len(first)]] == first


@BATCH_ONLY
def test_cuts_inside_an_accepted_run(plain, speculative):
    steps = trace(speculative, REPEAT)
    tokenizer = speculative.info.tokenizer
    eos = min(tokenizer.eos_token_ids)
    # The cuts below fall inside steps that emitted several tokens.
    (cliff,) = [s for s in steps if tokenizer.encode(" cliff")[0] in s]
    assert cliff.index(tokenizer.encode(" cliff")[0]) < len(cliff) - 1
    ends = [sum(map(len, steps[: i + 1])) for i in range(len(steps))]
    # A token limit three tokens into the first full verification.
    full = next(i for i, tokens in enumerate(steps) if len(tokens) == 9)
    limit = ends[full - 1] + 3
    # The first EOS comes with the tokens after it.
    ending = next(s for s in steps if eos in s)
    assert len(ending) > 1
    for fields in ({"stop": ("cliff",)}, {"max_tokens": limit}, {}):
        (expected,), (actual,) = both(plain, speculative, REPEAT, **fields)
        check_same(expected, actual)
    assert text_of(actual) == PARAGRAPH


def test_ignore_eos_and_penalties_apply_at_each_verified_position(plain, speculative):
    bias = {speculative.info.tokenizer.encode(" stone")[0]: -5.0}
    sampling = dict(repetition_penalty=1.2, logit_bias=bias)
    (expected,), (actual,) = both(
        plain,
        speculative,
        REPEAT,
        max_tokens=72,
        ignore_eos=True,
        sampling=SamplingParams(**sampling),
    )
    check_same(expected, actual)
    assert actual[-1].finish_reason == "length"


def test_seeded_sampling_draws_what_plain_decoding_draws(plain, speculative):
    before = proposals(speculative)
    for seed in (1, 2):
        sampling = SamplingParams(temperature=0.7, seed=seed)
        (expected,), (actual,) = both(plain, speculative, REPEAT, sampling=sampling)
        check_same(expected, actual)
    assert proposals(speculative)[1] > before[1]


@BATCH_ONLY
def test_a_batch_decodes_as_plain_batching(plain, speculative):
    expected, actual = both(plain, speculative, REPEAT, POEM, QUESTION)
    for want, got in zip(expected, actual):
        check_same(want, got)


@pytest.mark.parametrize("mode", ["paged"], indirect=True)
def test_rows_of_a_batch_speculate_on_pages(speculative):
    """On pages every decoding row verifies its own proposals in the step's one
    pass (the batch decoder speculates for a sequence once it is alone)."""
    steps = trace_steps(speculative, REPEAT, POEM, REPEAT)
    together = [s for s in steps if len(s) == 3]
    verified = [s for s in together if len(s[0]) > 1 and len(s[2]) > 1]
    assert len(verified) >= 3, steps


@BATCH_ONLY
def test_a_lone_sequence_joins_the_batch_and_leaves_again(plain, speculative):
    before = proposals(speculative)

    async def staggered(engine):
        loop = asyncio.get_running_loop()
        first = engine.submit(generation(engine, REPEAT, max_tokens=64), loop)
        events = []
        async for event in first:
            events.append(event)
            if len(events) == 4:
                break
        # The first sequence speculates alone by now; the second makes a batch.
        second = asyncio.create_task(collect(engine, generation(engine, QUESTION)))
        async for event in first:
            events.append(event)
        return events, await second

    expected = asyncio.run(staggered(plain))
    actual = asyncio.run(staggered(speculative))
    for want, got in zip(expected, actual):
        check_same(want, got)
    proposed, accepted = (a - b for a, b in zip(proposals(speculative), before))
    assert accepted > 20


def test_cancel_stops_speculation_within_a_step(speculative):
    before = speculative.stats.memory["batch_decode_tokens"]

    async def cancel_after_three():
        stream = speculative.submit(
            generation(speculative, REPEAT, max_tokens=400, ignore_eos=True),
            asyncio.get_running_loop(),
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                stream.cancel()
                return

    asyncio.run(cancel_after_three())
    wait_idle(speculative)
    # Three replies and a step or two of at most 9 tokens each.
    made = speculative.stats.memory["batch_decode_tokens"] - before
    assert made < 40, made
    (events,) = run(speculative, generation(speculative, REPEAT, max_tokens=64))
    assert text_of(events) == PARAGRAPH


# -- draft models -----------------------------------------------------------


def flat_costs(engine) -> None:
    """Every k and every proposal costs one pass: each step verifies all it can."""

    def set_costs(model, options):
        engine.served.decoder.costs, engine.served.decoder.per_proposal = FLAT, 0.0

    on_engine_thread(engine, set_costs)


@pytest.fixture(scope="module")
def short_plain(short_default, mode):
    """Plain decoding on the default model's first layers: draft models are about
    the proposals, which its shapes and tokenizer make as the whole model's do."""
    engine = load_engine("speculative:off", *MODES[mode], model=str(short_default))
    yield engine
    engine.shutdown()


def test_the_model_as_its_own_draft_accepts_everything(
    short_plain, short_default, mode
):
    engine = load_engine(
        *MODES[mode], model=str(short_default), draft=str(short_default)
    )
    try:
        flat_costs(engine)
        for text in (REPEAT, POEM):
            (expected,) = run(short_plain, generation(short_plain, text, max_tokens=48))
            (actual,) = run(engine, generation(engine, text, max_tokens=48))
            check_same(expected, actual)
            metrics = engine.last_metrics
            assert metrics.draft_tokens_proposed > 30
            assert metrics.draft_tokens_accepted >= 0.95 * metrics.draft_tokens_proposed
    finally:
        engine.shutdown()


@BATCH_ONLY
def test_a_random_draft_is_mostly_rejected_and_changes_nothing(
    short_plain, short_default, tmp_path, mode
):
    draft = make_tiny_draft(tmp_path / "draft")
    engine = load_engine(*MODES[mode], model=str(short_default), draft=str(draft))
    try:
        flat_costs(engine)
        expected, actual = both(short_plain, engine, REPEAT, max_tokens=48)
        check_same(expected[0], actual[0])
        metrics = engine.last_metrics
        assert metrics.draft_tokens_proposed > 0
        assert metrics.draft_tokens_accepted < 0.5 * metrics.draft_tokens_proposed
    finally:
        engine.shutdown()


def test_a_draft_with_another_vocabulary_fails_the_load(tmp_path):
    draft = make_tiny_draft(tmp_path / "draft", vocabulary_changed=True)
    engine = Engine()
    try:
        with pytest.raises(ModelLoadError, match="DraftModel: its vocabulary"):
            engine.load(LoadPlan(draft=str(draft), options=LoadOptions())).result()
        with pytest.raises(InvalidArgument, match="DraftModel"):
            engine.load(LoadPlan(options=LoadOptions(speculative="draft"))).result()
    finally:
        engine.shutdown()
