"""In-process engine tests on the embedded model: the decoder contract, parity of
the batched and single paths (paced and unpaced too), forced tokens, refused
capabilities, cancellation and unload. Load options, and shared prefixes with
bursts, have files of their own.

No gRPC here: requests go straight to ``Engine.submit`` as the servicer hands
them over, and each test loads the options it needs.
"""

import asyncio
import dataclasses
import json
import logging
import re

import mlx.core as mx
import pytest

from mlx_backend.decoders.base import KVState
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.single import SingleDecoder
from mlx_backend.errors import Aborted, FailedPrecondition, InvalidArgument
from mlx_backend.output.reply_pipeline import Finished, Output
from mlx_backend.request_parsing import (
    GenerationRequest,
    SamplingParams,
    ScoreRequest,
)
from tests.engine_helpers import (
    chat_prompt,
    drive,
    generation,
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
    wait_idle,
)
from tests.support import (
    ANSWER,
    ANSWER_PIECES,
    PERSON_SCHEMA,
    QUESTIONS,
    check_person,
    device_tolerance,
    make_forcing_processor,
)

# Options that make the single-sequence decoder (rotating KV caches can't batch),
# and the one-pass decoder over paged KV.
SINGLE = ("max_kv_size:4096",)
PAGED = ("paged:true",)
DECODERS = {"batched": (), "single": SINGLE, "paged": PAGED}


@pytest.fixture(scope="module", params=list(DECODERS))
def engine(request):
    engine = load_engine(*DECODERS[request.param])
    yield engine
    engine.shutdown()


def test_greedy_answer(engine):
    (events,) = run(engine, generation(engine))
    assert text_of(events) == ANSWER
    final = events[-1]
    assert isinstance(final, Finished)
    assert (final.finish_reason, final.prompt_tokens) == ("stop", 37)
    assert all(isinstance(e, Output) for e in events[:-1])


def test_batched_and_single_decoders_agree(engine):
    def both(model, options):
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        batched = drive(
            BatchDecoder(model, options, True), model, options, prompts, 12, 2
        )
        single = drive(
            SingleDecoder(model, options, True), model, options, prompts, 12, 2
        )
        return prompts, batched, single

    prompts, batched, single = on_engine_thread(engine, both)
    for prompt, (b_tokens, b_scores, b_state), (s_tokens, s_scores, s_state) in zip(
        prompts, batched, single
    ):
        assert b_tokens == s_tokens and len(b_tokens) == 12
        for (b_value, b_top), (s_value, s_top) in zip(b_scores, s_scores):
            assert b_value == pytest.approx(s_value, abs=device_tolerance(1e-3, 10))
            assert [t for t, _ in b_top] == [t for t, _ in s_top]
            assert len(b_top) == 2
        # Each hands back its KV state: the prompt and the tokens fed after it.
        for state in (b_state, s_state):
            assert isinstance(state, KVState)
            assert tuple(state.tokens[: len(prompt)]) == prompt
            assert state.cache[0].offset >= len(prompt)


def test_a_score_starts_from_a_replys_kept_state(engine):
    """A Score after a reply to the same prompt starts from the reply's kept KV
    state (the one-pass decoder's holds pages: the job gets a copy of them) and
    scores as the model over the whole text does."""
    prompt = chat_prompt(engine, QUESTIONS[2])
    run(engine, generation(engine, QUESTIONS[2], max_tokens=4))
    before = stats_after(engine)["prompt_cache_reused_tokens"]
    candidate = (11, 12, 13)
    request = ScoreRequest(prompt, (candidate,), engine.info.load_id)
    (scores,) = engine.compute(request).result()
    reused = stats_after(engine)["prompt_cache_reused_tokens"] - before
    if engine.served.decoder.capabilities.trimmable_cache:
        assert reused == len(prompt) - 1

    def whole(model, options):
        logits = model(mx.array([*prompt, *candidate])[None])[0, len(prompt) - 1 : -1]
        rows = logits.astype(mx.float32)
        rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        return [rows[i, t].item() for i, t in enumerate(candidate)]

    expected = on_engine_thread(engine, whole)
    assert scores == pytest.approx(expected, abs=device_tolerance(1e-3, 10))


def test_engine_paths_give_the_same_replies():
    """Text and logprob entries, whichever decoder the load options pick."""
    replies = []
    for options in DECODERS.values():
        engine = load_engine(*options)
        try:
            requests = [
                generation(engine, q, max_tokens=16, logprobs=2) for q in QUESTIONS
            ]
            replies.append(run(engine, *requests))
        finally:
            engine.shutdown()
    for batched, *others in zip(*replies):
        for other in others:
            assert text_of(batched) == text_of(other)
            entries = [
                [lp for e in events for lp in e.logprobs] for events in (batched, other)
            ]
            assert len(entries[0]) == len(entries[1]) == batched[-1].completion_tokens
            for a, b in zip(*entries):
                assert a.token == b.token
                assert a.logprob == pytest.approx(
                    b.logprob, abs=device_tolerance(1e-3, 10)
                )
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert len(a.top) == 2
    first = [lp.token.decode() for e in replies[1][0] for lp in e.logprobs]
    assert first == ANSWER_PIECES


def test_grammar_on_either_decoder(engine):
    grammar = engine.info.grammars.compile(json.dumps(PERSON_SCHEMA))
    requests = [
        generation(
            engine,
            "Describe a person as JSON.",
            max_tokens=200,
            grammar=grammar,
            sampling=SamplingParams(temperature=0.8, seed=seed),
        )
        for seed in range(2)
    ]
    for events in run(engine, *requests):
        check_person(text_of(events))


def mask_all_from(step: int):
    """A processor that, from its ``step``-th call on, leaves no finite logit: as
    a LogitBias of -1e39 (-inf in float32) on every token a grammar allows."""
    calls = 0

    def mask(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        return logits if calls <= step else mx.full(logits.shape, -mx.inf)

    return mask


@pytest.mark.parametrize("step, limit", [(0, 32), (3, 32), (3, 4)])
def test_a_step_left_with_nothing_to_sample_ends_the_request(engine, step, limit):
    # Sampling a row of -inf gives token 0 ("<|endoftext|>" here, "!" in GPT-2
    # style vocabularies) and would go on; the request ends at that token with
    # INVALID_ARGUMENT, also when it is the last one allowed (no processor call
    # comes after it), and the sequence beside it is served as alone.
    grammar = engine.info.grammars.compile("root ::= [a-z ,.]+")
    masked = generation(
        engine, grammar=grammar, processors=(mask_all_from(step),), max_tokens=limit
    )
    events, plain = run(engine, masked, generation(engine))
    error = events[-1]
    assert isinstance(error, InvalidArgument)
    assert str(error) == (
        f"Grammar: generation stopped after {step} tokens: no token was left to "
        "sample: the other logits processors masked every token the grammar allows"
    )
    # What went out before fits the grammar.
    assert re.fullmatch(r"[a-z ,.]*", text_of(events[:-1]))
    assert text_of(plain) == ANSWER


def test_forced_tokens_through_the_request_processors(engine):
    tokenizer = engine.info.tokenizer
    forced = tokenizer.encode(" forty-two, and more", add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    events, plain = run(
        engine,
        generation(engine, processors=(make_forcing_processor(forced, eos),)),
        generation(engine),
    )
    assert text_of(events) == " forty-two, and more"
    assert (events[-1].finish_reason, events[-1].completion_tokens) == (
        "stop",
        len(forced),
    )
    # The processor belongs to its request: the other row in the step is untouched.
    assert text_of(plain) == ANSWER


def test_requests_beyond_the_decoders_capabilities_are_refused(engine):
    decoder = engine.served.decoder
    advertised = decoder.capabilities
    decoder.capabilities = dataclasses.replace(
        advertised, logprobs=False, grammar=False
    )
    grammar = engine.info.grammars.compile('root ::= "yes"')
    try:
        logprobs, grammar, plain = run(
            engine,
            generation(engine, logprobs=2),
            generation(engine, grammar=grammar),
            generation(engine),
        )
    finally:
        decoder.capabilities = advertised
    assert isinstance(logprobs[-1], FailedPrecondition)
    assert str(logprobs[-1]).startswith("Logprobs:")
    assert isinstance(grammar[-1], FailedPrecondition)
    assert str(grammar[-1]).startswith("Grammar:")
    assert text_of(plain) == ANSWER


def test_cancel_stops_the_generation_within_a_few_steps(engine):
    before = engine.stats.memory["batch_decode_tokens"]
    decoded = []

    async def cancel_after_three():
        stream = engine.submit(
            generation(engine, max_tokens=400, ignore_eos=True),
            asyncio.get_running_loop(),
        )
        async for event in stream:
            decoded.append(event)
            if len(decoded) == 3:
                stream.cancel()
                return

    asyncio.run(cancel_after_three())
    wait_idle(engine)
    made = engine.stats.memory["batch_decode_tokens"] - before
    if engine.info.options.max_kv_size is None:
        assert made < 20, made
    # The next request is served as usual.
    (events,) = run(engine, generation(engine))
    assert text_of(events) == ANSWER


@pytest.mark.parametrize("options", [(), SINGLE], ids=["batched", "single"])
def test_cancel_during_prefill(options, caplog):
    caplog.set_level(logging.INFO, logger="mlx_backend")
    engine = load_engine("prefill_step_size:32", *options)
    try:
        long = GenerationRequest(
            prompt=chat_prompt(engine, "Tell me about Paris. " * 60),
            max_tokens=8,
            load_id=engine.info.load_id,
        )

        async def cancel_in_prefill():
            stream = engine.submit(long, asyncio.get_running_loop())
            while engine.stats.active == 0:
                await asyncio.sleep(0.01)
            stream.cancel()

        asyncio.run(cancel_in_prefill())
        reused = stats_after(engine)["prompt_cache_reused_tokens"]
        assert "generation cancelled during prefill" in caplog.text
        # It stopped chunks short of the prompt's end, and the next request is served.
        (events,) = run(engine, long)
        gained = stats_after(engine)["prompt_cache_reused_tokens"] - reused
        assert gained < len(long.prompt) - 32
        assert isinstance(events[-1], Finished)
    finally:
        engine.shutdown()


def test_unload_aborts_running_generations():
    engine = load_engine()
    try:
        load_id_before = engine.info.load_id

        async def free_while_generating():
            stream = engine.submit(
                GenerationRequest(
                    prompt=chat_prompt(engine),
                    max_tokens=400,
                    ignore_eos=True,
                    load_id=load_id_before,
                ),
                asyncio.get_running_loop(),
            )
            events = []
            with pytest.raises(Aborted, match="unloaded"):
                async for event in stream:
                    events.append(event)
                    if len(events) == 2:
                        await asyncio.wrap_future(engine.free())
            return events

        events = asyncio.run(free_while_generating())
        assert 2 <= len(events) < 400
        assert engine.stats.state == "uninitialized" and engine.info is None
        (late,) = run(
            engine,
            GenerationRequest(prompt=(1, 2, 3), max_tokens=4, load_id=load_id_before),
        )
        assert isinstance(late[-1], FailedPrecondition)
    finally:
        engine.shutdown()


def test_pacing_keeps_the_greedy_tokens(engine):
    """Paced and unpaced batched steps decode the same tokens, alone and batched."""
    if engine.info.options.max_kv_size is not None:
        pytest.skip("only batched steps are paced")

    def decode(model, options):
        prompts = [chat_prompt(engine, q) for q in QUESTIONS]
        return [
            [
                drive(
                    BatchDecoder(model, options, True, pace), model, options, p, 16, 2
                )
                for p in (prompts[:1], prompts)
            ]
            for pace in (False, True)
        ]

    unpaced, paced = on_engine_thread(engine, decode)
    for plain, with_pacing in zip(unpaced, paced):
        assert [t for t, _, _ in plain] == [t for t, _, _ in with_pacing]
    assert unpaced[0][0][0] == unpaced[1][0][0]  # alone as in the batch
