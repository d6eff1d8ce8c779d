"""In-process engine tests of shared prefixes: a burst of prompts with a common
system prompt prefills it once and replies as each prompt would alone, sharing
off prefills every prompt, a cancelled request's prefix serves its resend, the
member that prefills the prefix can be cancelled, mixed bursts share within each
group, and requests that wake the engine together are admitted together. The
model is a tiny llama (conftest's ``tiny_llama``): what is shared, not what the
weights say, is under test. On the one-pass decoder over paged KV, the burst
stores its prefix once."""

import asyncio
import logging
import time

import pytest

import mlx_backend.engine.loop as loop_module
from mlx_backend.caches.paged import PAGE_TOKENS, pages_for
from mlx_backend.engine.engine import Engine
from mlx_backend.output.reply_pipeline import Finished
from mlx_backend.request_parsing import GenerationRequest
from mlx_cache import common_length
from tests.engine_helpers import (
    chat_prompt,
    collect,
    generation,
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
)
from tests.support import QUESTIONS

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
def reference(tiny_llama):
    """Each prompt's greedy reply alone, with neither prompt cache nor sharing."""
    engine = load_engine(
        "max_cache_entries:0", "prefix_sharing:false", model=str(tiny_llama)
    )
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


# The batch decoder snapshots a prefix by copying its KV; the one-pass decoder's
# snapshot holds the prefix's pages, which the burst's other prompts share.
DECODERS = {"batched": (), "paged": ("paged:true",)}


@pytest.fixture(params=list(DECODERS))
def sharing(request, tiny_llama):
    engine = load_engine(*DECODERS[request.param], model=str(tiny_llama))
    yield engine
    engine.shutdown()


def test_a_paged_burst_stores_its_shared_prefix_once(reference, tiny_llama):
    """Eight prompts after one system prompt: the pages held at any step are the
    prefix's once, and each prompt's own (from the page its suffix starts in)."""
    engine = load_engine("paged:true", model=str(tiny_llama))
    decoder = engine.served.decoder
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} (order {i})" for i in range(8)]
    peak, step = [0], decoder.step

    def measured():
        results = step()
        peak[0] = max(peak[0], decoder.pages_nbytes())
        return results

    try:
        prompts = [system_prompt(engine, BAKERY, q) for q in questions]
        prefix = min(common_length(prompts[0], p) for p in prompts[1:])
        on_engine_thread(engine, lambda *_: setattr(decoder, "step", measured))
        replies = burst(engine, prompts)
        assert [text_of(r) for r in replies] == [reference(p) for p in prompts]
        page = decoder._kv.page_nbytes
        own = sum(pages_for(len(p) + 12) - prefix // PAGE_TOKENS for p in prompts)
        assert peak[0] <= (pages_for(prefix) + own) * page
        assert peak[0] < len(prompts) * pages_for(prefix) * page
    finally:
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


def test_sharing_off_prefills_every_prompt(reference, tiny_llama):
    engine = load_engine("prefix_sharing:false", model=str(tiny_llama))
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


def test_cancelling_the_member_that_prefills_the_prefix(reference, tiny_llama):
    engine = load_engine("prefill_step_size:32", model=str(tiny_llama))
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
