"""Admission under the memory budget and prefill under the step token budget, on
an in-process engine (engine/memory_budget.py, decoders/step_budget.py)."""

import asyncio
import threading
import time

import pytest

from mlx_backend.caches.paged import pages_for
from mlx_backend.decoders.paged import PagedDecoder
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import ResourceExhausted
from mlx_backend.models.loading import LoadPlan
from mlx_backend.request_parsing import GenerationRequest
from python_utils import parse_options
from tests.engine_helpers import load_engine, run, stats_after, text_of
from tests.tiny_models import make_tiny_draft

REPLY_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer llama with the default model's tokenizer."""
    return make_tiny_draft(tmp_path_factory.mktemp("budgets") / "tiny", layers=2)


def load_folder(folder, *options: str) -> Engine:
    engine = Engine()
    plan = LoadPlan(
        model=str(folder), identity=str(folder), options=parse_options(list(options))
    )
    engine.load(plan).result()
    return engine


def prompts(engine: Engine, count: int, length: int) -> list[tuple[int, ...]]:
    """``count`` prompts of ``length`` tokens that share no prefix."""
    tokenizer = engine.info.tokenizer
    words = "river stone cloud maple harbor violin copper lantern meadow orbit"
    out = []
    for i in range(count):
        text = f"{i} " + " ".join(words.split()[(i + j) % 10] for j in range(length))
        out.append(tuple(tokenizer.encode(text))[:length])
    return out


def requests(engine: Engine, prompts_: list, max_tokens: int) -> list:
    return [
        GenerationRequest(
            prompt=p,
            load_id=engine.info.load_id,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        for p in prompts_
    ]


def sample_stats(engine: Engine, samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        stats = engine.stats
        samples.append((stats.active, stats.memory))
        time.sleep(0.002)


def test_requests_that_outgrow_the_budget_wait_and_finish_with_their_text(tiny):
    free = load_folder(tiny)
    batch = prompts(free, 12, 60)
    expected = [text_of(events) for events in run(free, *requests(free, batch, 24))]
    figures = stats_after(free)
    weights, prefill = figures["budget_weights_bytes"], figures["budget_prefill_bytes"]
    per_request = free.served.budget.kv_bytes([60 + REPLY_TOKENS])
    # On pages (the CPU's default) a sequence counts its whole pages, and rows
    # aren't padded to the longest.
    paged = isinstance(free.served.decoder, PagedDecoder)
    assert free.served.budget.rectangular is not paged
    if paged:
        assert (
            per_request
            == pages_for(60 + REPLY_TOKENS) * free.served.decoder._kv.page_nbytes
        )
    free.shutdown()
    # Room for three at a time: the twelve would need four times the KV room.
    room = 3 * per_request + per_request // 3
    engine = load_folder(tiny, f"memory_budget:{weights + prefill + room}")
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_stats, args=(engine, samples, stop))
    sampler.start()
    try:
        events = run(engine, *requests(engine, batch, REPLY_TOKENS))
    finally:
        stop.set()
        sampler.join()
    assert [text_of(e) for e in events] == expected
    assert 12 * per_request >= 3.5 * room
    assert max(active for active, _ in samples) == 3
    assert any(memory.get("requests_waiting", 0) > 0 for _, memory in samples)
    for _, memory in samples:
        if "budget_kv_bytes" not in memory:
            continue
        used = memory["budget_kv_bytes"] + memory["budget_prompt_cache_bytes"]
        assert used <= room
        assert memory["kv_live_bytes"] <= memory["budget_kv_bytes"]
    engine.shutdown()


def test_a_request_that_can_never_fit_is_refused_at_once(tiny):
    probe = load_folder(tiny)
    figures = stats_after(probe)
    per_request = probe.served.budget.kv_bytes([60 + REPLY_TOKENS])
    probe.shutdown()
    budget = (
        figures["budget_weights_bytes"]
        + figures["budget_prefill_bytes"]
        + 2 * per_request
    )
    engine = load_folder(tiny, f"memory_budget:{budget}")
    (prompt,) = prompts(engine, 1, 60)
    (huge,) = requests(engine, [prompt], 4000)
    (events,) = run(engine, huge)
    assert len(events) == 1 and isinstance(events[0], ResourceExhausted)
    message = str(events[0])
    assert "Tokens:" in message and "4060 tokens" in message
    room = budget - figures["budget_weights_bytes"] - figures["budget_prefill_bytes"]
    assert str(room) in message
    # The server goes on serving what fits.
    (small,) = requests(engine, [prompt], REPLY_TOKENS)
    (events,) = run(engine, small)
    assert events[-1].finish_reason == "length"
    engine.shutdown()


def test_a_request_waiting_for_memory_can_be_cancelled(tiny):
    probe = load_folder(tiny)
    figures = stats_after(probe)
    per_request = probe.served.budget.kv_bytes([60 + 200])
    probe.shutdown()
    budget = (
        figures["budget_weights_bytes"]
        + figures["budget_prefill_bytes"]
        + per_request
        + per_request // 2
    )
    engine = load_folder(tiny, f"memory_budget:{budget}")
    first, second, third = requests(engine, prompts(engine, 3, 60), 200)

    async def main():
        loop = asyncio.get_running_loop()
        running = engine.submit(first, loop)
        waiting = engine.submit(second, loop)
        tokens = 0
        async for _ in running:
            tokens += 1
            if tokens == 3:
                assert engine.stats.memory["requests_waiting"] == 1
                waiting.cancel()
            if tokens == 20:
                assert engine.stats.memory["requests_waiting"] == 0
        return tokens

    assert asyncio.run(main()) > 20
    (events,) = run(engine, third)
    assert events[-1].finish_reason == "length"
    engine.shutdown()


@pytest.fixture(scope="module")
def budgets():
    """The default model with a small step budget, and with none."""
    on = load_engine("step_token_budget:32", "speculative:off")
    off = load_engine("step_token_budget:0", "speculative:off")
    yield on, off
    on.shutdown()
    off.shutdown()


def fairness_run(engine: Engine) -> dict:
    """Two streams decode; a long prompt arrives, then a short one. Each
    stream's token arrival times and texts."""
    long_prompt, *others = prompts(engine, 4, 320)
    short = others[2][:12]
    streams = requests(engine, [others[0][:20], others[1][:20]], 64)
    (late_long,) = requests(engine, [long_prompt], 8)
    (late_short,) = requests(engine, [short], 8)

    async def consume(request, times, events):
        async for event in engine.submit(request, asyncio.get_running_loop()):
            times.append(time.perf_counter())
            events.append(event)

    async def main():
        times = {name: [] for name in ("a", "b", "long", "short")}
        events = {name: [] for name in times}
        tasks = [
            asyncio.create_task(consume(r, times[n], events[n]))
            for n, r in (("a", streams[0]), ("b", streams[1]))
        ]
        while len(times["a"]) < 3 or len(times["b"]) < 3:
            await asyncio.sleep(0.005)
        sent = time.perf_counter()
        tasks.append(
            asyncio.create_task(consume(late_long, times["long"], events["long"]))
        )
        await asyncio.sleep(0.05)
        tasks.append(
            asyncio.create_task(consume(late_short, times["short"], events["short"]))
        )
        await asyncio.gather(*tasks)
        return sent, times, {n: text_of(e) for n, e in events.items()}

    sent, times, texts = asyncio.run(main())
    return {"sent": sent, "times": times, "texts": texts}


def test_a_short_prompt_goes_before_a_long_one_while_streams_decode(budgets):
    on, off = budgets
    budgeted = fairness_run(on)
    times = budgeted["times"]
    long_first = times["long"][0]
    assert times["short"][0] < long_first
    for name in ("a", "b"):
        during = [t for t in times[name] if budgeted["sent"] < t < long_first]
        assert len(during) >= 5, name
    # The budget changes what each step carries, never the tokens.
    assert fairness_run(off)["texts"] == budgeted["texts"]
