"""In-process engine tests of load options, each test with its own engine:
unbatchable models fall back to one sequence each, the batch size caps the rows
per step, ``dequantize:false`` keeps the quantized kernels, rotating KV caches are
reused until they wrap, ``Threads`` caps the BLAS, and CPU pacing is chosen at load
and reported."""

import json
import logging
import os
import re
import threading

import mlx.core as mx
import pytest

from mlx_backend.cpu.blas import (
    BLAS_THREAD_ENV,
    blas_threads,
    choose_blas_threads,
    physical_cores,
    set_blas_threads,
)
from mlx_backend.cpu.pacing import CPU_PACING_ENV
from mlx_backend.models.loading import LoadPlan
from python_utils import parse_options
from tests.engine_helpers import generation, load_engine, run, stats_after, text_of
from tests.support import ANSWER, PERSON_SCHEMA, check_person


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
        if mx.default_device() == mx.cpu:
            # The SIMD kernels where built (cpu/kernels), else MLX's.
            assert "kernels" in engine.info.compute_path.description
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


def test_pacing_is_chosen_at_load_and_reported(monkeypatch):
    """``cpu_pacing`` sets the batch decoder's; ``auto`` measures it on the CPU.
    The load message and Status say which, and replies are the same, under a
    grammar too. The paged decoder is never paced, whatever the option says."""
    on_cpu = mx.default_device() == mx.cpu

    def person(engine) -> str:
        grammar = engine.info.grammars.compile(json.dumps(PERSON_SCHEMA))
        request = generation(
            engine, "Describe a person as JSON.", max_tokens=200, grammar=grammar
        )
        (events,) = run(engine, request)
        return text_of(events)

    engine = load_engine("cpu_pacing:off", "paged:false")
    try:
        unpaced = person(engine)
        check_person(unpaced)
    finally:
        engine.shutdown()
    engine = load_engine("cpu_pacing:on", "paged:false")
    try:
        assert person(engine) == unpaced
        path = engine.info.compute_path
        expected = "CPU pacing on (cpu_pacing:on)" if on_cpu else "(not the CPU)"
        assert expected in path.description
        assert stats_after(engine)["cpu_paced"] == int(on_cpu)
        (events,) = run(engine, generation(engine, max_tokens=40))
        assert text_of(events) == ANSWER
        monkeypatch.setenv(CPU_PACING_ENV, "auto")
        options = parse_options(["paged:false"])
        engine.load(LoadPlan(identity="default", options=options)).result()
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
        if on_cpu:
            options = parse_options(["cpu_pacing:on"])
            engine.load(LoadPlan(identity="default", options=options)).result()
            path = engine.info.compute_path
            assert "CPU pacing off (the paged pass queues" in path.description
            assert stats_after(engine)["cpu_paced"] == 0
    finally:
        engine.shutdown()
