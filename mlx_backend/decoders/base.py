"""Decoders: the generation paths, each behind one contract the engine drives.

A decoder holds the sequences being generated. ``add`` gives it one (its prompt
remainder, KV cache, sampler and processors), ``step`` runs one step for all of
them and returns a typed ``StepResult`` per sequence, ``remove`` takes one out
with its KV state, and ``reset`` drops them all. The engine never asks which
decoder runs; a new generation path is one new ``Decoder`` class.
"""

import asyncio
import copy
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import can_trim_prompt_cache

from mlx_backend.cpu.path import (
    Pacing,
    blas_threads,
    choose_pacing,
    pace_step,
    pacing_setting,
)
from mlx_backend.sampling import see_cached_prompt
from mlx_utils import (
    Scored,
    gather_logprobs,
    make_kv_cache,
    model_signature,
    unbatchable_reason,
)
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# MLX streams belong to the thread that made them: one per engine thread.
_thread = threading.local()


def thread_stream() -> mx.Stream:
    """The calling thread's stream for decode steps: small evaluations on its
    default stream, such as logprobs, need not wait behind the next step."""
    if not hasattr(_thread, "stream"):
        _thread.stream = mx.new_stream(mx.default_device())
    return _thread.stream


@dataclass(frozen=True)
class Capabilities:
    """What a decoder can do; the engine refuses requests that need more."""

    # Sequences share forward passes.
    batching: bool
    # KV caches can be trimmed, so prompt-cache hits can be exact and drafts undone.
    trimmable_cache: bool
    logprobs: bool = True
    grammar: bool = True
    # KV states of prompt prefixes are handed back as prefill passes them.
    prefix_snapshots: bool = False


@dataclass(frozen=True)
class KVState:
    """A sequence's KV cache and the tokens it was given, for the prompt cache."""

    cache: list
    tokens: list[int]


@dataclass(frozen=True)
class NewSequence:
    """What a decoder needs to start generating one sequence."""

    prompt: tuple[int, ...]
    # The prompt tokens ``kv_cache`` lacks (at least one, for the first logits).
    rest: tuple[int, ...]
    kv_cache: list
    sampler: Callable
    processors: list
    max_tokens: int
    # Alternatives per token for its logprob entries; None: no logprobs.
    logprobs: int | None = None
    # The prompt tokens penalty processors look back over.
    history: int = 64
    # Polled between prefill chunks, so a long prompt stops within one chunk.
    cancelled: Callable[[], bool] = lambda: False
    # Prompt lengths whose KV state is handed back as prefill passes them
    # (``StepResult.snapshots``), where the decoder can.
    snapshots: tuple[int, ...] = ()
    # Proposed tokens a step may verify, where the decoder speculates (0: none).
    draft_tokens: int = 0


@dataclass(frozen=True)
class StepResult:
    """One sequence's share of a step."""

    key: int
    tokens: tuple[int, ...] = ()
    # Per token, when asked for: its logprob and its best alternatives.
    logprobs: tuple[Scored | None, ...] = ()
    # The decoder is done with the sequence (token limit, cancelled prefill, error).
    done: bool = False
    # The KV state of a sequence that left the decoder within the step.
    state: KVState | None = None
    # Without its traceback: it must not hold MLX arrays on the handlers' thread.
    error: Exception | None = None
    # Copies of the KV state of the prompt prefixes that prefill passed this step.
    snapshots: tuple[KVState, ...] = ()
    # Speculative decoding: tokens proposed this step, and how many the model kept.
    proposed: int = 0
    accepted: int = 0


class Decoder(ABC):
    """One generation path. Every method runs on the engine thread."""

    capabilities: Capabilities
    # Steps that decoded sequences together, and the tokens they made.
    batch_steps = 0
    batch_tokens = 0
    # Speculative decoding: tokens proposed, and those the model kept.
    draft_proposed = 0
    draft_accepted = 0

    @abstractmethod
    def add(self, sequence: NewSequence) -> int:
        """Start generating ``sequence``; the key its results carry."""

    @abstractmethod
    def step(self) -> list[StepResult]:
        """One step for every sequence: a result for each one it advanced."""

    @abstractmethod
    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        """Take a sequence out; its KV state when asked for and sound."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every sequence and keep serving."""

    def close(self) -> None:
        """Drop every sequence for good (the model is unloaded)."""
        self.reset()


class BatchDecoder(Decoder):
    """Continuous batching on mlx-lm's ``BatchGenerator``: every sequence decodes in
    one forward pass per step, and prompts are prefilled a chunk per step."""

    def __init__(
        self,
        model: nn.Module,
        options: LoadOptions,
        trimmable: bool,
        pace: bool = False,
    ):
        self._model = model
        self._options = options
        self.capabilities = Capabilities(
            batching=True, trimmable_cache=trimmable, prefix_snapshots=True
        )
        # Each row's logprob width (None: no logprobs), by BatchGenerator uid.
        self._rows: dict[int, int | None] = {}
        # Each row's prompt prefixes still to snapshot, in prefill order.
        self._snapshots: dict[int, list[tuple[int, ...]]] = {}
        self._pace = pace
        self._batch = self._make_batch()

    def _make_batch(self) -> BatchGenerator:
        options = self._options
        return BatchGenerator(
            self._model,
            completion_batch_size=options.max_batch_size,
            # BatchGenerator raises its decode limit to the prefill batch size.
            prefill_batch_size=min(options.prefill_batch_size, options.max_batch_size),
            prefill_step_size=options.prefill_step_size,
            stream=thread_stream(),
        )

    def add(self, sequence: NewSequence) -> int:
        processors = list(sequence.processors)
        if self._pace:
            processors.insert(0, pace_step)
        prompt, rest = sequence.prompt, list(sequence.rest)
        reused = len(prompt) - len(rest)
        # Prefill stops at each snapshot length; BatchGenerator itself splits off
        # the last prompt token, which starts generation.
        cuts = sorted(
            {n - reused for n in sequence.snapshots} & set(range(1, len(rest)))
        )
        segments = [rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)])]
        # EOS, stop strings and the token limit are checked by the reply pipeline.
        (uid,) = self._batch.insert_segments(
            [segments],
            max_tokens=[sequence.max_tokens],
            caches=[sequence.kv_cache],
            all_tokens=[list(sequence.prompt[:reused])],
            samplers=[sequence.sampler],
            logits_processors=[processors],
        )
        self._rows[uid] = sequence.logprobs
        ends = [reused + cut for cut in cuts]
        if len(rest) > 1 and len(prompt) - 1 in sequence.snapshots:
            ends.append(len(prompt) - 1)
        if ends:
            self._snapshots[uid] = [prompt[:end] for end in sorted(set(ends))]
        return uid

    def step(self) -> list[StepResult]:
        try:
            prompt_responses, responses = self._batch.next()
        except Exception as e:
            logger.exception("batched generation failed")
            error = e.with_traceback(None)
            # Each handler raises its own copy, with its own traceback.
            failed = [
                StepResult(key, done=True, error=copy.copy(error)) for key in self._rows
            ]
            self.reset()
            return failed
        snapshots = self._take_snapshots(prompt_responses)
        responses = [r for r in responses if r.uid in self._rows]
        if responses:
            self.batch_steps += 1
            self.batch_tokens += len(responses)
        scored = self._score(responses)
        results = []
        for response in responses:
            done = response.finish_reason is not None
            state = None
            if done:
                # The row already left the batch, with its KV cache.
                del self._rows[response.uid]
                self._snapshots.pop(response.uid, None)
                state = KVState(response.prompt_cache, response.all_tokens)
            results.append(
                StepResult(
                    response.uid,
                    (response.token,),
                    (scored.get(response.uid),),
                    done=done,
                    state=state,
                    snapshots=snapshots.pop(response.uid, ()),
                )
            )
        # Rows still in prefill report only their snapshots.
        results += [
            StepResult(uid, snapshots=taken) for uid, taken in snapshots.items()
        ]
        return results

    def _take_snapshots(self, prompt_responses) -> dict[int, tuple[KVState, ...]]:
        """Copies of the KV state of each prompt prefix whose prefill just ended."""
        taken: dict[int, list[KVState]] = {}
        for response in prompt_responses:
            pending = self._snapshots.get(response.uid)
            if not response.end_of_segment or not pending:
                continue
            tokens = pending.pop(0)
            if not pending:
                del self._snapshots[response.uid]
            cache, _ = self._batch.extract_cache([response.uid])[response.uid]
            taken.setdefault(response.uid, []).append(KVState(cache, list(tokens)))
        return {uid: tuple(states) for uid, states in taken.items()}

    def _score(self, responses) -> dict[int, Scored]:
        """Logprob entries of the step's tokens, in one evaluation for every row
        that asked for them."""
        wanted = [(r, self._rows[r.uid]) for r in responses]
        wanted = [(r, n) for r, n in wanted if n is not None]
        if not wanted:
            return {}
        top = max(n for _, n in wanted)
        values = gather_logprobs(
            [r.logprobs for r, _ in wanted], [r.token for r, _ in wanted], top
        )
        return {
            r.uid: (logprob, best[:n])
            for (r, n), (logprob, best) in zip(wanted, values)
        }

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        self._snapshots.pop(key, None)
        if key not in self._rows:
            return None
        del self._rows[key]
        removed = self._batch.remove([key], return_prompt_caches=keep_state)
        state = removed.get(key) if keep_state else None
        return None if state is None else KVState(*state)

    def reset(self) -> None:
        self._close_batch()
        self._batch = self._make_batch()

    def close(self) -> None:
        self._close_batch()

    def _close_batch(self) -> None:
        self._rows.clear()
        self._snapshots.clear()
        try:
            self._batch.close()
        except Exception:
            logger.exception("closing the batch generator failed")


class _Cancelled(Exception):
    """Raised from the prefill progress callback to stop a cancelled prompt."""


@dataclass
class _SingleRow:
    tokens: Iterator
    kv_cache: list
    logprobs: int | None
    # Every token the model has been given a step for, prompt first.
    fed: list[int]


class SingleDecoder(Decoder):
    """One mlx-lm ``generate_step`` per sequence, for models whose KV caches can't
    be merged into a batch."""

    def __init__(self, model: nn.Module, options: LoadOptions, trimmable: bool):
        self._model = model
        self._step_size = options.prefill_step_size
        self.capabilities = Capabilities(batching=False, trimmable_cache=trimmable)
        self._rows: dict[int, _SingleRow] = {}
        self._next_key = 0

    def add(self, sequence: NewSequence) -> int:
        reused = len(sequence.prompt) - len(sequence.rest)

        def check_cancelled(processed: int, total: int) -> None:
            if sequence.cancelled():
                raise _Cancelled()

        tokens = generate_step(
            mx.array(sequence.rest),
            self._model,
            max_tokens=sequence.max_tokens,
            sampler=sequence.sampler,
            logits_processors=see_cached_prompt(
                sequence.processors, sequence.prompt[:reused], sequence.history
            ),
            prefill_step_size=self._step_size,
            prompt_cache=sequence.kv_cache,
            prompt_progress_callback=check_cancelled,
        )
        key = self._next_key
        self._next_key += 1
        self._rows[key] = _SingleRow(
            tokens, sequence.kv_cache, sequence.logprobs, list(sequence.prompt)
        )
        return key

    def step(self) -> list[StepResult]:
        results = []
        for key, row in list(self._rows.items()):
            try:
                token, logprobs = next(row.tokens)
            except StopIteration:
                results.append(StepResult(key, done=True))
                continue
            except _Cancelled:
                results.append(StepResult(key, done=True))
                continue
            except Exception as e:
                logger.exception("generation failed")
                # A failed step can leave arrays that fail again when evaluated.
                state = self._remove(key, keep_state=True, failed=True)
                error = e.with_traceback(None)
                results.append(StepResult(key, done=True, state=state, error=error))
                continue
            # generate_step runs the step for a token before yielding it.
            row.fed.append(token)
            scored = None
            if row.logprobs is not None:
                scored = gather_logprobs([logprobs], [token], row.logprobs)[0]
            results.append(StepResult(key, (token,), (scored,)))
        return results

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        return self._remove(key, keep_state, failed=False)

    def _remove(self, key: int, keep_state: bool, failed: bool) -> KVState | None:
        row = self._rows.pop(key, None)
        if row is None:
            return None
        row.tokens.close()
        if not keep_state:
            return None
        if failed:
            try:
                mx.eval([layer.state for layer in row.kv_cache])
            except Exception:
                logger.warning("not caching the KV state of a failed generation")
                return None
        return KVState(row.kv_cache, row.fed)

    def reset(self) -> None:
        for row in self._rows.values():
            row.tokens.close()
        self._rows.clear()


def make_plain_decoder(
    model: nn.Module, options: LoadOptions, pace: bool = False
) -> Decoder:
    """The decoder for a loaded model: batched when its KV caches can be merged,
    with paced CPU steps when ``pace`` (``make_pacing``)."""
    trimmable = can_trim_prompt_cache(make_kv_cache(model, options))
    why = unbatchable_reason(model, options)
    if why:
        logger.info("requests run one sequence each: %s", why)
        return SingleDecoder(model, options, trimmable)
    return BatchDecoder(model, options, trimmable, pace)


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
# Load-time measurements, kept for a reload of the same weights and settings.
_measured: dict[tuple, object] = {}


def measured_once(model: nn.Module, key: tuple, measure: Callable[[], object]):
    """``measure()``, run on the engine thread's stream the first time ``model``'s
    weights load with this ``key`` and BLAS thread count, and kept for the next."""
    full = (model_signature(model, {}), blas_threads(), *key)
    if full not in _measured:
        with mx.stream(thread_stream()):
            _measured[full] = measure()
    return _measured[full]


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
