"""CPU step pacing: whether a batched decode step runs its forward pass to the end
before the next step's graph is built, decided per CPU by measuring at load."""

import asyncio
import logging
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from mlx_backend.decoders.base import thread_stream
from mlx_backend.decoders.measured import measured_once
from mlx_backend.switches import host_setting
from mlx_utils import make_kv_cache, unbatchable_reason
from python_utils import CPU_PACING_MODES, LoadOptions

logger = logging.getLogger(__name__)

CPU_PACING_ENV = "MLX_BACKEND_CPU_PACING"


# Fast BLAS libraries by family, in order of preference. MKL's sgemm is about twice
# OpenBLAS 0.3.21's for the one-row products of decoding (measured on x86_64).
def pace_step(tokens: mx.array, logits: mx.array) -> mx.array:
    """A logits processor that runs the step's forward pass to its end before the
    rest of the step's graph is built.

    The Python thread then builds no graphs while the cores run the matmuls. Whether
    that pays depends on the machine: a 2-core Intel Xeon decoded 15% faster with
    it and a 2-core AMD EPYC 9-25% slower, so ``choose_pacing`` decides by
    measuring.
    """
    mx.eval(logits)
    return logits


# Unpaced steps must beat paced ones by this share to be kept: what overlapping
# costs comes in spells that a short measurement can miss (on a 2-core Xeon, 5 of
# 18 loads measured a tie or unpaced faster, where 150-token runs were 6-35% faster
# paced), and what it gains shows in every step.
PACING_MARGIN = 0.05


def mean_speeds(rounds: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The mean paced and unpaced tokens/s over measured (paced, unpaced) rounds."""
    paced, unpaced = zip(*rounds)
    return statistics.fmean(paced), statistics.fmean(unpaced)


@dataclass(frozen=True)
class Pacing:
    """Whether batched CPU decode steps are paced (``pace_step``), and why; shown
    in the load log, LoadModel and Status."""

    paced: bool
    # What decided: the option, a measurement, or why there was none.
    reason: str
    # One stream's tokens/s in each measured round: (paced, unpaced).
    rounds: tuple[tuple[float, float], ...] = ()

    def describe(self) -> str:
        text = f"CPU pacing {'on' if self.paced else 'off'} ({self.reason}"
        if self.rounds:
            paced, unpaced = mean_speeds(self.rounds)
            text += f": tok/s paced {paced:.1f}, unpaced {unpaced:.1f}"
            if len(self.rounds) > 1:
                ratios = ", ".join(f"{p / u:.2f}" for p, u in self.rounds)
                text += f"; paced/unpaced by round {ratios}"
        return text + ")"


def pacing_setting(option: str, environ) -> tuple[str, str]:
    """The pacing mode and what set it: the option when it says on or off, else
    the host's ``MLX_BACKEND_CPU_PACING``, else ``auto``."""
    return host_setting(option, "cpu_pacing", environ, CPU_PACING_ENV, CPU_PACING_MODES)


def choose_pacing(option: str, rounds: Sequence[tuple[float, float]] = ()) -> Pacing:
    """Pacing as the option ``cpu_pacing`` sets it, or for ``auto`` as measured:
    unpaced only when the unpaced mean speed beats the paced one by
    ``PACING_MARGIN``, or when nothing was measured.

    Args:
        option: ``on``, ``off`` or ``auto``.
        rounds: One stream's tokens/s per measured round, (paced, unpaced).
    """
    if option != "auto":
        return Pacing(option == "on", f"cpu_pacing:{option}")
    if not rounds:
        return Pacing(False, "auto, not measured")
    paced, unpaced = mean_speeds(rounds)
    return Pacing(
        unpaced <= paced * (1 + PACING_MARGIN), "auto, measured", tuple(rounds)
    )


# Pacing is measured over one greedy decode: a paced segment, then an unpaced one,
# each timed only after it settles. On a 2-core Xeon unpaced steps ran at the paced
# speed for 10-20 steps after a switch, then fell into spells 30% slower that lasted
# 20-100 steps: the unpaced segment settles longer and is timed longer.
PACING_WARMUP = 4
# (paced, seconds to settle, seconds timed), in order.
PACING_SEGMENTS = ((True, 0.25, 0.45), (False, 0.45, 1.0))
PACING_MAX_SEGMENT_TOKENS = 64
# Pacing saves some ms a step: the slower steps of a model too big for the CPU
# are not measured.
PACING_MAX_STEP_S = 0.2


def measure_pacing(model: nn.Module, options: LoadOptions) -> list[tuple[float, float]]:
    """One stream's tokens/s with paced and unpaced steps, as one (paced,
    unpaced) round; empty when a step is too slow for pacing to matter.

    One decode serves both: a switch takes effect at the next step. Each token
    wakes an event loop on another thread, as a served token wakes the server's.
    """
    # Rebound by the loop below; each step reads it.
    paced = False

    def switchable(tokens: mx.array, logits: mx.array) -> mx.array:
        return pace_step(tokens, logits) if paced else logits

    batch = BatchGenerator(
        model, prefill_step_size=options.prefill_step_size, stream=thread_stream()
    )
    tokens = PACING_WARMUP + len(PACING_SEGMENTS) * 2 * PACING_MAX_SEGMENT_TOKENS
    batch.insert(
        [list(range(1, 9))],
        max_tokens=[tokens + 1],
        caches=[make_kv_cache(model, options)],
        logits_processors=[[switchable]],
    )

    def arrivals() -> Iterator[float]:
        while True:
            if batch.next()[1]:
                hand_off()
                yield time.perf_counter()

    def tokens_for(seconds: float, least: int) -> int:
        return min(max(least, round(seconds / step_s)), PACING_MAX_SEGMENT_TOKENS)

    ticks = arrivals()
    figures: dict[bool, float] = {}
    loop = asyncio.new_event_loop()
    # Serving wakes the event loop's thread with each step's tokens, and that wake
    # slows unpaced steps on some CPUs (measured without it, they looked as fast as
    # paced ones on the Xeon while serving 15-20% slower): the measurement does too.
    hand_off = partial(loop.call_soon_threadsafe, lambda: None)
    waker = threading.Thread(target=loop.run_forever, name="pacing-loop", daemon=True)
    waker.start()
    try:
        warmup = [next(ticks) for _ in range(PACING_WARMUP)]
        step_s = (warmup[-1] - warmup[1]) / (PACING_WARMUP - 2)
        if step_s > PACING_MAX_STEP_S:
            logger.info(
                "a decode step takes %.0f ms: pacing not measured", step_s * 1e3
            )
            return []
        for paced, settle_s, timed_s in PACING_SEGMENTS:
            timed = tokens_for(timed_s, 3)
            for _ in range(tokens_for(settle_s, 2)):
                start = next(ticks)
            for _ in range(timed):
                end = next(ticks)
            figures[paced] = timed / (end - start)
    finally:
        batch.close()
        loop.call_soon_threadsafe(loop.stop)
        waker.join()
        loop.close()
    return [(figures[True], figures[False])]


def make_pacing(model: nn.Module, options: LoadOptions, alone: bool, environ) -> Pacing:
    """Whether the model's batched CPU decode steps are paced: as ``cpu_pacing``
    or the host's ``MLX_BACKEND_CPU_PACING`` says, or for ``auto`` as measured on
    this machine (the better mode differs by CPU)."""
    if mx.default_device() != mx.cpu:
        return Pacing(False, "not the CPU")
    mode, source = pacing_setting(options.cpu_pacing, environ)
    if mode != "auto":
        return Pacing(mode == "on", source)
    if not alone:
        # Every rank would have to run the measurement's collectives together.
        return Pacing(False, "auto, not measured over a distributed group")
    if unbatchable_reason(model, options):
        return Pacing(False, "auto, not measured: only batched steps are paced")

    def measure() -> Pacing:
        start = time.perf_counter()
        pacing = choose_pacing("auto", measure_pacing(model, options))
        logger.info(
            "%s; measured in %.2f s", pacing.describe(), time.perf_counter() - start
        )
        return pacing

    layout = (options.kv_bits, options.kv_group_size, options.quantized_kv_start)
    return measured_once(model, ("pacing", *layout), measure)
