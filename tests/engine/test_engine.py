"""In-process engine tests on the embedded model: the decoder contract, parity of
the batched and single paths, forced tokens, cancellation and unload, load
options, shared prefixes prefilled once, bursts admitted together, BLAS threads
and CPU pacing at load.

No gRPC here: requests go straight to ``Engine.submit`` as the servicer hands
them over, and each test loads the options it needs.
"""

import asyncio
import dataclasses
import json
import logging
import os
import re
import threading
import time

import mlx.core as mx
import pytest

import mlx_backend.engine.loop as loop_module
from mlx_backend.cpu.blas import (
    BLAS_THREAD_ENV,
    blas_threads,
    choose_blas_threads,
    physical_cores,
    set_blas_threads,
)
from mlx_backend.cpu.pacing import CPU_PACING_ENV
from mlx_backend.decoders.base import KVState
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.single import SingleDecoder
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import Aborted, FailedPrecondition
from mlx_backend.models.loading import LoadPlan
from mlx_backend.output.reply_pipeline import Finished, Output
from mlx_backend.request_parsing import GenerationRequest, SamplingParams
from mlx_cache import common_length
from python_utils import parse_options
from tests.support import (
    ANSWER,
    ANSWER_PIECES,
    PERSON_SCHEMA,
    QUESTIONS,
    chat_prompt,
    check_person,
    collect,
    drive,
    generation,
    load_engine,
    make_forcing_processor,
    on_engine_thread,
    run,
    stats_after,
    text_of,
    wait_idle,
)

# Options that make the single-sequence decoder (rotating KV caches can't batch).
SINGLE = ("max_kv_size:4096",)


@pytest.fixture(scope="module", params=["batched", "single"])
def engine(request):
    engine = load_engine(*(SINGLE if request.param == "single" else ()))
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
            assert b_value == pytest.approx(s_value, abs=1e-3)
            assert [t for t, _ in b_top] == [t for t, _ in s_top]
            assert len(b_top) == 2
        # Each hands back its KV state: the prompt and the tokens fed after it.
        for state in (b_state, s_state):
            assert isinstance(state, KVState)
            assert tuple(state.tokens[: len(prompt)]) == prompt
            assert state.cache[0].offset >= len(prompt)


def test_engine_paths_give_the_same_replies():
    """Text and logprob entries, whichever decoder the load options pick."""
    replies = []
    for options in ((), SINGLE):
        engine = load_engine(*options)
        try:
            requests = [
                generation(engine, q, max_tokens=16, logprobs=2) for q in QUESTIONS
            ]
            replies.append(run(engine, *requests))
        finally:
            engine.shutdown()
    for batched, single in zip(*replies):
        assert text_of(batched) == text_of(single)
        entries = [
            [lp for e in events for lp in e.logprobs] for events in (batched, single)
        ]
        assert len(entries[0]) == len(entries[1]) == batched[-1].completion_tokens
        for a, b in zip(*entries):
            assert a.token == b.token
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
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


# -- load options, each test with its own engine ---------------------------------


def test_unbatchable_models_fall_back_to_one_sequence_each(caplog):
    caplog.set_level(logging.INFO, logger="mlx_backend")
    engine = load_engine("max_kv_size:256")
    try:
        assert "requests run one sequence each: max_kv_size" in caplog.text
        assert not engine.served.decoder.capabilities.batching
        replies = run(engine, generation(engine), generation(engine))
        assert [text_of(r) for r in replies] == [ANSWER, ANSWER]
        assert stats_after(engine)["batch_decode_steps"] == 0
    finally:
        engine.shutdown()


def test_batch_size_caps_the_rows_per_step():
    engine = load_engine("max_batch_size:2", "prefill_step_size:16")
    try:
        replies = run(engine, *[generation(engine) for _ in range(4)])
        assert [text_of(r) for r in replies] == [ANSWER] * 4
        # Never more than two rows per step, even with eight prompts per prefill.
        stats = stats_after(engine)
        assert 1 < stats["batch_decode_tokens"] / stats["batch_decode_steps"] <= 2
    finally:
        engine.shutdown()


def test_dequantize_option_off_keeps_quantized_kernels():
    engine = load_engine("dequantize:false")
    try:
        assert "quantized kernels" in engine.info.compute_path.description
        assert engine.stats.memory["dequantized_weights"] == 0
        (events,) = run(engine, generation(engine))
        assert text_of(events) == ANSWER
    finally:
        engine.shutdown()


def test_rotating_kv_caches_are_reused_until_they_wrap():
    engine = load_engine("max_kv_size:48")
    try:
        before = stats_after(engine)["prompt_cache_reused_tokens"]
        # 37 prompt tokens and 4 more stay inside the window: trimmed and reused.
        short = [run(engine, generation(engine, max_tokens=4))[0] for _ in "ab"]
        reused = stats_after(engine)["prompt_cache_reused_tokens"]
        assert text_of(short[1]) == text_of(short[0])
        assert reused - before == 37 - 1
    finally:
        engine.shutdown()
    # 37 + 16 tokens wrap the window: the entry cannot be trimmed, so a repeat
    # starts afresh and answers the same.
    engine = load_engine("max_kv_size:48")
    try:
        wrap = generation(engine, max_tokens=16, ignore_eos=True)
        long = [run(engine, wrap)[0] for _ in "ab"]
        assert text_of(long[1]) == text_of(long[0])
        assert stats_after(engine)["prompt_cache_reused_tokens"] == 0
    finally:
        engine.shutdown()


# -- shared prefixes ----------------------------------------------------------------

BAKERY = "You are a patient assistant for a small bakery in Lyon. " * 16
LIBRARY = "You answer questions about the opening hours of a public library. " * 14
BAKERY_QUESTIONS = ("Do you sell bread?", "When do you open?", "Where are you?")


def system_prompt(engine: Engine, system: str, question: str) -> tuple[int, ...]:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]
    tokenizer = engine.info.tokenizer
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def reference():
    """Each prompt's greedy reply alone, with neither prompt cache nor sharing."""
    engine = load_engine("max_cache_entries:0", "prefix_sharing:false")
    replies: dict[tuple[int, ...], str] = {}

    def reply_to(prompt: tuple[int, ...]) -> str:
        if prompt not in replies:
            request = GenerationRequest(
                prompt=prompt, max_tokens=12, load_id=engine.info.load_id
            )
            replies[prompt] = text_of(run(engine, request)[0])
        return replies[prompt]

    yield reply_to
    engine.shutdown()


@pytest.fixture
def sharing():
    engine = load_engine()
    yield engine
    engine.shutdown()


def burst(engine: Engine, prompts, cancel_first: bool = False) -> list[list]:
    """The prompts' events, submitted at once; the first one cancelled once its
    prefill has started, when asked."""

    async def main():
        loop = asyncio.get_running_loop()
        streams = [
            engine.submit(
                GenerationRequest(prompt=p, max_tokens=12, load_id=engine.info.load_id),
                loop,
            )
            for p in prompts
        ]

        async def drain(stream):
            return [event async for event in stream]

        tasks = [asyncio.ensure_future(drain(s)) for s in streams]
        if cancel_first:
            while engine.stats.active == 0:
                await asyncio.sleep(0.005)
            streams[0].cancel()
            tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=cancel_first)

    return asyncio.run(main())


def test_a_burst_prefills_its_shared_prefix_once(sharing, reference, caplog):
    caplog.set_level(logging.INFO, logger="mlx_backend")
    prompts = [system_prompt(sharing, BAKERY, q) for q in BAKERY_QUESTIONS]
    prompts.append(system_prompt(sharing, BAKERY, "Do you sell cakes?"))
    # What each later prompt shares with the first, which prefills it.
    shared = [common_length(prompts[0], p) for p in prompts[1:]]
    assert min(shared) > 150
    replies = burst(sharing, prompts)
    assert [text_of(r) for r in replies] == [reference(p) for p in prompts]
    stats = stats_after(sharing)
    # The first prompt whole, then each other prompt's own tokens.
    assert stats["prompt_tokens_prefilled"] == sum(map(len, prompts)) - sum(shared)
    assert stats["prompt_cache_reused_tokens"] == sum(shared)
    assert "prefix was prefilled once for 3 more requests" in caplog.text
    assert all(r[-1].prompt_tokens == len(p) for r, p in zip(replies, prompts))


def test_sharing_off_prefills_every_prompt(reference):
    engine = load_engine("prefix_sharing:false")
    try:
        prompts = [system_prompt(engine, BAKERY, q) for q in BAKERY_QUESTIONS]
        replies = burst(engine, prompts)
        assert [text_of(r) for r in replies] == [reference(p) for p in prompts]
        assert stats_after(engine)["prompt_tokens_prefilled"] == sum(map(len, prompts))
    finally:
        engine.shutdown()


def test_cancel_then_resend_reuses_all_but_the_new_tokens(sharing):
    first, second = (system_prompt(sharing, BAKERY, q) for q in BAKERY_QUESTIONS[:2])

    async def cancel_then_resend():
        loop = asyncio.get_running_loop()
        stream = sharing.submit(
            GenerationRequest(
                prompt=first, max_tokens=200, load_id=sharing.info.load_id
            ),
            loop,
        )
        async for _ in stream:
            break  # the first token: the user presses stop and asks again
        stream.cancel()
        resent = sharing.submit(
            GenerationRequest(
                prompt=second, max_tokens=4, load_id=sharing.info.load_id
            ),
            loop,
        )
        before = sharing.stats.memory["prompt_cache_reused_tokens"]
        events = [event async for event in resent]
        return before, events

    before, events = asyncio.run(cancel_then_resend())
    reused = stats_after(sharing)["prompt_cache_reused_tokens"] - before
    assert reused == common_length(first, second)
    assert isinstance(events[-1], Finished)


def test_cancelling_the_member_that_prefills_the_prefix(reference):
    engine = load_engine("prefill_step_size:32")
    try:
        prompts = [system_prompt(engine, BAKERY, q) for q in BAKERY_QUESTIONS]
        cancelled, *replies = burst(engine, prompts, cancel_first=True)
        assert isinstance(cancelled, BaseException)
        assert [text_of(r) for r in replies] == [reference(p) for p in prompts[1:]]
    finally:
        engine.shutdown()


def test_mixed_bursts_share_within_each_group(sharing, reference):
    groups = [
        [system_prompt(sharing, BAKERY, q) for q in BAKERY_QUESTIONS[:2]],
        [system_prompt(sharing, LIBRARY, q) for q in ("Open on Sunday?", "Late?")],
    ]
    alone = chat_prompt(sharing, "Name three colors.")
    prompts = [groups[0][0], groups[1][0], alone, groups[0][1], groups[1][1]]
    replies = burst(sharing, prompts)
    assert [text_of(r) for r in replies] == [reference(p) for p in prompts]
    shared = [common_length(*group) for group in groups]
    assert min(shared) > 150
    assert stats_after(sharing)["prompt_tokens_prefilled"] == sum(
        map(len, prompts)
    ) - sum(shared)


def admissions(engine: Engine, delay: float) -> list[tuple[int, float]]:
    """Two requests submitted ``delay`` seconds apart to the idle engine: the step at
    which each joined the decoder, and the seconds after the first's submission."""
    decoder, joined, steps = engine.served.decoder, [], [0]
    add, step = decoder.add, decoder.step

    def record(sequence):
        joined.append((steps[0], time.monotonic()))
        return add(sequence)

    def count():
        steps[0] += 1
        return step()

    async def main():
        start = time.monotonic()
        first = asyncio.ensure_future(collect(engine, generation(engine, max_tokens=4)))
        await asyncio.sleep(delay)
        await asyncio.gather(
            first, collect(engine, generation(engine, QUESTIONS[1], max_tokens=4))
        )
        return start

    def patch(*_):
        decoder.add, decoder.step = record, count

    def unpatch(*_):
        del decoder.add, decoder.step

    on_engine_thread(engine, patch)
    try:
        start = asyncio.run(main())
    finally:
        on_engine_thread(engine, unpatch)
    return [(step, at - start) for step, at in joined]


def test_requests_that_wake_the_engine_together_prefill_together(sharing, monkeypatch):
    """A request that wakes the idle engine waits for others arriving within the
    gap, so a burst is prefilled in one step; a lone one waits only the gap."""
    monkeypatch.setattr(loop_module, "BURST_GAP_SECONDS", 0.3)
    monkeypatch.setattr(loop_module, "BURST_SECONDS", 2.0)
    (first, _), (second, _) = admissions(sharing, 0.1)
    assert first == second
    monkeypatch.setattr(loop_module, "BURST_GAP_SECONDS", 0.1)
    (_, waited), _ = admissions(sharing, 1.0)
    assert 0.1 <= waited < 1.0
    # Without the window the first is prefilled alone; the second joins later.
    monkeypatch.setattr(loop_module, "BURST_SECONDS", 0.0)
    (first, _), (second, _) = admissions(sharing, 0.1)
    assert second > first


def test_threads_cap_the_blas(monkeypatch):
    """ModelOptions.Threads caps the fast BLAS, read back through its own API;
    unset, the BLAS runs a thread per physical core."""
    assert choose_blas_threads(0, 4, {}) == (4, "physical cores")
    assert choose_blas_threads(1, 4, {"MKL_NUM_THREADS": "2"}) == (1, "Threads")
    assert choose_blas_threads(0, 4, {"MKL_NUM_THREADS": "2"}) == (
        None,
        "MKL_NUM_THREADS",
    )
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
    before = blas_threads()
    if before is None:
        pytest.skip("no fast BLAS in this process")
    # The suite's workers share the cores through these (conftest).
    for name in BLAS_THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    # A count other than the default, so the option is seen to apply.
    threads = 1 if physical_cores() > 1 else 2
    engine = load_engine(f"threads:{threads}")
    try:
        assert blas_threads() == threads
        assert stats_after(engine)["blas_threads"] == threads
        assert f"{threads} BLAS threads (Threads)" in (
            engine.info.compute_path.description
        )
        engine.load(LoadPlan(identity="default", options=parse_options([]))).result()
        assert blas_threads() == physical_cores()
        assert stats_after(engine)["blas_threads"] == physical_cores()
    finally:
        engine.shutdown()
        set_blas_threads(before)


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


def test_pacing_is_chosen_at_load_and_reported(monkeypatch):
    """``cpu_pacing`` sets it; ``auto`` measures it on the CPU. The load message
    and Status say which, and replies are the same, under a grammar too."""
    on_cpu = mx.default_device() == mx.cpu

    def person(engine) -> str:
        grammar = engine.info.grammars.compile(json.dumps(PERSON_SCHEMA))
        request = generation(
            engine, "Describe a person as JSON.", max_tokens=200, grammar=grammar
        )
        (events,) = run(engine, request)
        return text_of(events)

    engine = load_engine("cpu_pacing:off")
    try:
        unpaced = person(engine)
        check_person(unpaced)
    finally:
        engine.shutdown()
    engine = load_engine("cpu_pacing:on")
    try:
        assert person(engine) == unpaced
        path = engine.info.compute_path
        expected = "CPU pacing on (cpu_pacing:on)" if on_cpu else "(not the CPU)"
        assert expected in path.description
        assert stats_after(engine)["cpu_paced"] == int(on_cpu)
        (events,) = run(engine, generation(engine, max_tokens=40))
        assert text_of(events) == ANSWER
        monkeypatch.setenv(CPU_PACING_ENV, "auto")
        engine.load(LoadPlan(identity="default", options=parse_options([]))).result()
        path = engine.info.compute_path
        if on_cpu:
            assert re.search(
                r"CPU pacing (on|off) \(auto, measured: tok/s paced [\d.]+, "
                r"unpaced [\d.]+\)",
                path.description,
            ), path.description
        assert stats_after(engine)["cpu_paced"] == int(path.paced)
        # The event loop the measurement woke with each token is gone.
        assert "pacing-loop" not in {t.name for t in threading.enumerate()}
        (events,) = run(engine, generation(engine, max_tokens=40))
        assert text_of(events) == ANSWER
    finally:
        engine.shutdown()
