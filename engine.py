"""The generation engine: one thread that owns the model and every MLX object.

gRPC handlers never touch MLX. They parse a request into a ``GenerationRequest``,
``submit`` it and read events from the returned ``RequestStream``; control work
(load, free) is sent to the same thread with ``call``. The thread loop reads as
schedule (admit requests, run control work) -> step (one token for each active
sequence) -> emit (events to the handlers' queues).
"""

import asyncio
import copy
import dataclasses
import gc
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from chat_output import (
    Delta,
    OutputMarkers,
    OutputOptions,
    OutputParser,
    make_output_markers,
    merge_deltas,
)
from grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarState,
    make_grammar_processor,
)
from mlx_cache import ThreadSafeLRUPromptCache
from mlx_utils import (
    ComputePath,
    ContinuationDetokenizer,
    EmbeddingBatch,
    LoadedModel,
    ScoreBatch,
    TokenBytes,
    gather_logprobs,
    hidden_state_model,
    load_model,
    make_forcing_processor,
    make_kv_cache,
    make_processors,
    make_seeded_sampler,
    make_token_bytes,
    memory_snapshot,
    pace_step,
    physical_memory,
    prepare_for_cpu,
    release_memory,
    see_cached_prompt,
    unbatchable_reason,
)
from python_utils import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    LoadOptions,
    ResourceExhausted,
)

logger = logging.getLogger(__name__)

# Memory readings are refreshed every this many decode steps.
STATS_INTERVAL = 16
# The share of physical memory the prompt cache may take by default.
PROMPT_CACHE_MEMORY_FRACTION = 0.1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_context_size: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationRequest:
    """One parsed generation request, ready for the engine thread."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    output: OutputOptions = OutputOptions()
    # Testing aid: generate exactly these tokens (the forced_tokens load option).
    forced_tokens: tuple[int, ...] | None = None
    # Logprobs with this many alternatives per token; None: no logprobs.
    logprobs: int | None = None
    grammar: CompiledGrammar | None = None
    # The load the prompt was tokenized for; a request for a replaced model is refused.
    model_generation: int = 0


@dataclass(frozen=True)
class EmbeddingRequest:
    tokens: tuple[int, ...]
    model_generation: int = 0


@dataclass(frozen=True)
class ScoreRequest:
    prompt: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]
    model_generation: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its bytes, logprob and the best alternatives."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class Output:
    """Streamed text, with the logprobs of the tokens it completes."""

    delta: Delta
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last event of a generation; ``delta`` is what was not yet streamed."""

    delta: Delta
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float
    generation_seconds: float
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RequestMetrics:
    """What GetMetrics reports of the most recently finished request."""

    tokens_generated: int = 0
    tokens_per_second: float = 0.0
    prompt_tokens_processed: int = 0
    slot_id: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What handlers may read about the loaded model (no MLX objects but the tokenizer)."""

    name: str
    source: str
    tokenizer: object
    context_size: int
    vocab_size: int
    options: LoadOptions
    generation: int
    compute_path: ComputePath = ComputePath("")
    markers: OutputMarkers = OutputMarkers()
    token_bytes: TokenBytes = TokenBytes(())
    # Whether the model's final hidden states can be read (for Embedding).
    embeddings: bool = False
    grammars: GrammarCompiler | None = None


@dataclass(frozen=True)
class EngineStats:
    state: str  # "uninitialized", "loading", "ready", "busy" or "error"
    active: int
    memory: dict[str, int]


class _Outbox:
    """Events for the handlers, sent once per engine step.

    One ``call_soon_threadsafe`` per event loop and step wakes the handlers'
    loop once for a whole batch, not once for every token of every stream.
    """

    def __init__(self):
        self._pending: list[tuple[RequestStream, object]] = []

    def put(self, stream: "RequestStream", event) -> None:
        self._pending.append((stream, event))

    def flush(self) -> None:
        if not self._pending:
            return
        by_loop: dict = {}
        for stream, event in self._pending:
            by_loop.setdefault(stream.loop, []).append((stream, event))
        self._pending = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                # The handlers' loop is gone; nobody is listening any more.
                for stream, _ in items:
                    stream.cancelled = True


def _deliver(items: list) -> None:
    for stream, event in items:
        stream.queue.put_nowait(event)


class RequestStream:
    """The handler's end of one generation, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: _Outbox):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._outbox = outbox
        self.cancelled = False
        # Events put by the engine, and those the handler has taken.
        self._put = 0
        self._taken = 0

    def put(self, event) -> None:
        """Queue ``event`` for the handler (engine thread only)."""
        self._put += 1
        self._outbox.put(self, event)

    @property
    def backlog(self) -> int:
        """Events the handler has not taken yet: its client is not reading."""
        return self._put - self._taken

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[Output | Finished]:
        while True:
            event = await self.queue.get()
            self._taken += 1
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                return


@dataclass
class _Job:
    """Embedding or Score work: ``start()`` makes it, ``work.advance()`` runs a
    chunk (True when done), ``finish(work)`` answers the futures."""

    futures: list[Future]
    start: Callable
    finish: Callable
    work: object = None


class _Cancelled(Exception):
    """Raised from the prefill progress callback to stop a cancelled prompt."""


class _Sequence:
    """One request on the engine thread: generated tokens in, classified text out.

    A batched sequence is a row of the engine's ``BatchGenerator`` (``uid``); a
    sequence that cannot be batched runs its own mlx-lm ``generate_step``.
    """

    def __init__(
        self,
        request: GenerationRequest,
        stream: RequestStream,
        info: ModelInfo,
        reused: int,
        slot: int,
    ):
        tokenizer = info.tokenizer
        self.request = request
        self.stream = stream
        self.reused = reused
        self.slot = slot
        self.token_bytes = info.token_bytes
        # Logprob entries of tokens whose text has not gone out yet.
        self.logprobs: list[TokenLogprob] = []
        self.grammar: GrammarState | None = None
        self.eos = frozenset() if request.ignore_eos else tokenizer.eos_token_ids
        self.detokenizer = ContinuationDetokenizer(tokenizer, request.prompt)
        self.output = OutputParser(info.markers, request.stop, request.output)
        self.generated = 0
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.metrics: RequestMetrics | None = None
        self.uid: int | None = None
        # The single path: its generate_step, KV cache, and every token the model
        # has been given a step for, prompt first.
        self.tokens = None
        self.kv_cache: list | None = None
        self.fed: list[int] = []

    def start_single(self, model, kv_cache, rest, sampler, processors, step_size):
        self.kv_cache = kv_cache
        self.fed = list(self.request.prompt)
        self.tokens = generate_step(
            mx.array(rest),
            model,
            max_tokens=self.request.max_tokens,
            sampler=sampler,
            logits_processors=see_cached_prompt(
                processors,
                self.request.prompt[: self.reused],
                self.request.sampling.repetition_context_size,
            ),
            prefill_step_size=step_size,
            prompt_cache=kv_cache,
            prompt_progress_callback=self._check_cancelled,
        )

    def _check_cancelled(self, processed: int, total: int) -> None:
        # Called between prefill chunks, so a long prompt stops within one chunk.
        if self.stream.cancelled:
            raise _Cancelled()

    def advance(self) -> bool:
        """Single path: generate one token and emit it; True when done."""
        try:
            token, logprobs = next(self.tokens)
        except StopIteration:
            return self.finish("length")
        # generate_step runs the step for a token before yielding it.
        self.fed.append(token)
        top = self.request.logprobs
        scored = None if top is None else gather_logprobs([logprobs], [token], top)[0]
        return self.emit(token, scored)

    def emit(self, token: int, scored: tuple | None = None) -> bool:
        """Emit one generated token's text; True when the sequence is done.

        ``scored`` is the token's logprob and its best alternatives, when asked for.
        """
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.grammar is not None and self.grammar.error is not None:
            self.stream.put(
                InvalidArgument(
                    f"Grammar: generation stopped after {self.generated} tokens: "
                    f"{self.grammar.error}"
                )
            )
            return True
        if token in self.eos:
            return self.finish("stop")
        if self.grammar is not None and self.grammar.ends_before(self.generated):
            # The grammar is complete; its end-of-sequence ends even an IgnoreEOS reply.
            return self.finish("stop")
        self.generated += 1
        if scored is not None:
            self.logprobs.append(self._logprob_entry(token, *scored))
        self.detokenizer.add_token(token)
        if self.generated >= self.request.max_tokens:
            return self.finish("length")
        delta, stopped = self.output.feed(self.detokenizer.last_segment)
        if stopped:
            return self.finish("stop", delta)
        if delta:
            self.stream.put(Output(delta, self._take_logprobs()))
        return False

    def _logprob_entry(self, token: int, logprob: float, top: list) -> TokenLogprob:
        text = self.token_bytes.of(token)
        alternatives = tuple((self.token_bytes.of(t), value) for t, value in top)
        return TokenLogprob(text, logprob, alternatives)

    def _take_logprobs(self) -> tuple[TokenLogprob, ...]:
        entries = tuple(self.logprobs)
        self.logprobs.clear()
        return entries

    def finish(self, reason: str, delta: Delta | None = None) -> bool:
        if delta is None:
            # Flush what the detokenizer still holds.
            self.detokenizer.finalize()
            delta, stopped = self.output.feed(self.detokenizer.last_segment)
            if stopped:
                reason = "stop"
        # Then what the parser holds back: unfinished markers, an open tool call.
        delta = merge_deltas((delta, self.output.finish()))
        now = time.perf_counter()
        first = self.first_token_at or now
        self.metrics = RequestMetrics(
            tokens_generated=self.generated,
            tokens_per_second=self.generated / (now - first) if now > first else 0.0,
            prompt_tokens_processed=len(self.request.prompt) - self.reused,
            slot_id=self.slot,
        )
        self.stream.put(
            Finished(
                delta=delta,
                prompt_tokens=len(self.request.prompt),
                completion_tokens=self.generated,
                prompt_seconds=first - self.started,
                generation_seconds=now - first,
                finish_reason=reason,
                logprobs=self._take_logprobs(),
            )
        )
        return True

    def close_single(self, failed: bool) -> tuple[list, list[int]] | None:
        """End the single path's generator; its KV cache and tokens, if sound."""
        self.tokens.close()
        if failed:
            try:
                # A failed step can leave arrays that fail again when evaluated.
                mx.eval([layer.state for layer in self.kv_cache])
            except Exception:
                logger.warning("not caching the KV state of a failed generation")
                return None
        return self.kv_cache, self.fed


def make_request_processors(
    request: GenerationRequest, tokenizer, vocab_size: int
) -> tuple[list, GrammarState | None]:
    """The request's logits processors: bias (and banned EOS), penalties, the
    grammar, forcing; and the grammar's state."""
    sampling = request.sampling
    logit_bias = sampling.logit_bias
    if request.ignore_eos:
        # As llama.cpp does: never sample EOS, rather than sampling past it.
        logit_bias = {**logit_bias, **{t: -math.inf for t in tokenizer.eos_token_ids}}
    processors = make_processors(
        logit_bias,
        sampling.repetition_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        sampling.repetition_context_size,
    )
    grammar = None
    if request.grammar is not None:
        # After the ban, so a finished grammar's end-of-sequence overrides it.
        grammar, processor = make_grammar_processor(
            request.grammar, tokenizer.eos_token_ids, vocab_size
        )
        processors.append(processor)
    if request.forced_tokens is not None:
        # Last: a forced token is generated even where the grammar forbids it.
        eos = min(tokenizer.eos_token_ids)
        processors.append(make_forcing_processor(request.forced_tokens, eos))
    return processors, grammar


class Engine:
    """Owns the model and runs every MLX call on its own thread."""

    def __init__(self):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = _Outbox()
        self._active: list[_Sequence] = []
        # Batched sequences by BatchGenerator uid; None when the model can't batch.
        self._batch: BatchGenerator | None = None
        self._batched: dict[int, _Sequence] = {}
        self._stream: mx.Stream | None = None
        # Embedding and Score requests waiting, and the job running one chunk per step.
        self._side: list[tuple[EmbeddingRequest | ScoreRequest, Future]] = []
        self._job: _Job | None = None
        self._loaded: LoadedModel | None = None
        self._generation = 0
        self._steps = 0
        self._state = "uninitialized"
        self._closed = False
        self.info: ModelInfo | None = None
        self.stats = EngineStats("uninitialized", 0, {})
        self.last_metrics = RequestMetrics()
        self._prompt_cache = ThreadSafeLRUPromptCache(max_size=0)
        # Prompt tokens served from the prompt cache, and those prefilled.
        self._reused_tokens = 0
        self._prefilled_tokens = 0
        # Batched decode steps and the tokens they made (tokens/steps: batch size).
        self._batch_steps = 0
        self._batch_tokens = 0
        self._thread = threading.Thread(
            target=self._run, name="mlx-engine", daemon=True
        )
        self._thread.start()

    # -- any thread ---------------------------------------------------------

    def submit(self, request: GenerationRequest, loop) -> RequestStream:
        self._check_open()
        stream = RequestStream(loop, self._outbox)
        self._inbox.put((request, stream))
        return stream

    def compute(self, request: EmbeddingRequest | ScoreRequest) -> Future:
        """An embedding vector, or a Score request's per-token logprobs for each
        candidate, computed a chunk at a time between decode steps."""
        self._check_open()
        future: Future = Future()
        self._inbox.put((request, future))
        return future

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the engine thread between steps."""
        self._check_open()
        future: Future = Future()
        self._inbox.put((fn, args, future))
        return future

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise Aborted("the backend is shutting down")

    def load(
        self,
        name: str,
        options: LoadOptions,
        context_size: int,
        identity: str = "",
        **kwargs,
    ) -> Future:
        """Load ``name``; a failure before its weights load keeps the current model.

        ``identity`` is the ``Model`` string requests' ``ModelIdentity`` must match.
        """
        return self.call(self._load, name, identity, options, context_size, kwargs)

    def free(self):
        return self.call(self._free)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------

    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._schedule()
                if running and self._busy():
                    self._step()
            except Exception:
                # Never let the thread die: every waiting handler would hang.
                logger.exception("engine loop failed")
                try:
                    self._abort_all("the generation engine failed")
                except Exception:
                    logger.exception("could not abort the running generations")
            self._outbox.flush()
        self._closed = True
        try:
            self._abort_all("the backend is shutting down", rebuild=False)
        finally:
            self._drain_inbox()
            self._outbox.flush()

    def _drain_inbox(self) -> None:
        """Answer whatever was queued behind the stop request."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            if isinstance(item[0], GenerationRequest):
                item[1].put(Aborted("the backend is shutting down"))
            elif item[-1].set_running_or_notify_cancel():
                item[-1].set_exception(Aborted("the backend is shutting down"))

    def _busy(self) -> bool:
        return bool(self._active or self._side or self._job)

    def _schedule(self) -> bool:
        """Admit new work; block while idle. False when asked to stop."""
        while True:
            busy = self._busy()
            if not busy:
                self._outbox.flush()  # before waiting for work
            try:
                item = self._inbox.get(block=not busy)
            except queue.Empty:
                return True
            if item is None:
                return False
            if isinstance(item[0], GenerationRequest):
                self._admit(*item)
            elif isinstance(item[0], (EmbeddingRequest, ScoreRequest)):
                self._queue_side(*item)
            else:
                self._run_call(*item)
            self._publish()

    def _admit(self, request: GenerationRequest, stream: RequestStream) -> None:
        if stream.cancelled:
            return
        if self._loaded is None:
            stream.put(FailedPrecondition("no model is loaded: call LoadModel first"))
            return
        if request.model_generation != self._generation:
            stream.put(Aborted("the model was replaced while the request was queued"))
            return
        try:
            seq = self._start(request, stream, self._free_slot())
        except Exception as e:
            logger.exception("could not start a generation")
            stream.put(e)
            return
        self._active.append(seq)
        self._reused_tokens += seq.reused
        self._prefilled_tokens += len(request.prompt) - seq.reused
        logger.info(
            "prompt: %d tokens, %d from the prompt cache",
            len(request.prompt),
            seq.reused,
        )

    def _free_slot(self) -> int:
        """The lowest slot number no running sequence holds (as llama.cpp numbers them)."""
        taken = {seq.slot for seq in self._active}
        return next(slot for slot in range(len(taken) + 1) if slot not in taken)

    def _fetch_cache(self, prompt: tuple[int, ...]) -> tuple[list, tuple[int, ...]]:
        """The nearest KV cache for ``prompt`` and the prompt tokens it lacks."""
        kv_cache, rest = self._prompt_cache.fetch_nearest_cache(
            self._generation, prompt
        )
        if kv_cache is not None and not rest:
            # An exact hit still runs the last prompt token, for the next logits.
            if can_trim_prompt_cache(kv_cache):
                trim_prompt_cache(kv_cache, 1)
                return kv_cache, prompt[-1:]
            kv_cache = None
        if kv_cache is None:
            return (
                make_kv_cache(self._loaded.model, self.info.options.max_kv_size),
                prompt,
            )
        return kv_cache, rest

    def _start(
        self, request: GenerationRequest, stream: RequestStream, slot: int
    ) -> _Sequence:
        tokenizer = self._loaded.tokenizer
        kv_cache, rest = self._fetch_cache(request.prompt)
        reused = len(request.prompt) - len(rest)
        seq = _Sequence(request, stream, self.info, reused, slot)
        sampling = request.sampling
        sampler = make_seeded_sampler(
            sampling.temperature,
            sampling.top_p,
            sampling.min_p,
            sampling.top_k,
            sampling.seed,
        )
        processors, seq.grammar = make_request_processors(
            request, tokenizer, self.info.vocab_size
        )
        if self._batch is None:
            seq.start_single(
                self._loaded.model,
                kv_cache,
                rest,
                sampler,
                processors,
                self.info.options.prefill_step_size,
            )
            return seq
        if mx.default_device() == mx.cpu:
            processors.insert(0, pace_step)
        # EOS, stop strings and the token limit are checked by _Sequence.emit.
        (seq.uid,) = self._batch.insert(
            [list(rest)],
            max_tokens=[request.max_tokens],
            caches=[kv_cache],
            all_tokens=[list(request.prompt[:reused])],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self._batched[seq.uid] = seq
        return seq

    def _run_call(self, fn, args, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:
            self._publish()
            future.set_exception(e)
        else:
            # Status must show the new state once the caller has the result.
            self._publish()
            future.set_result(result)

    def _step(self) -> None:
        limit = self.info.options.max_stream_backlog
        for seq in list(self._active):
            if seq.stream.cancelled:
                if seq.first_token_at is None:
                    logger.info("generation cancelled during prefill")
                else:
                    logger.info("generation cancelled after %d tokens", seq.generated)
                self._retire(seq)
            elif seq.stream.backlog > limit:
                # A client that stops reading must not make the server buffer its
                # whole reply; the other streams go on.
                logger.warning(
                    "ending a stream after %d tokens: its client left %d replies unread",
                    seq.generated,
                    seq.stream.backlog,
                )
                seq.stream.put(
                    ResourceExhausted(
                        f"PredictStream: the client left {seq.stream.backlog} replies "
                        f"unread (max_stream_backlog is {limit}); the stream was ended"
                    )
                )
                self._retire(seq)
        if self._batched:
            self._step_batch()
        if self._side or self._job:
            self._step_side()
        for seq in [s for s in self._active if s.uid is None]:
            try:
                done = seq.advance()
            except _Cancelled:
                logger.info("generation cancelled during prefill")
                done = True
            except Exception as e:
                logger.exception("generation failed")
                # Without its traceback the error holds no MLX arrays on the loop thread.
                seq.stream.put(e.with_traceback(None))
                self._retire(seq, failed=True)
                continue
            if done:
                self._retire(seq)
        self._steps += 1
        if self._steps % STATS_INTERVAL == 0:
            self._publish()

    def _step_batch(self) -> None:
        """One decode step for every batched sequence, and one prefill chunk."""
        try:
            _, responses = self._batch.next()
        except Exception as e:
            logger.exception("batched generation failed")
            error = e.with_traceback(None)
            for seq in self._batched.values():
                # Each handler raises its own copy, with its own traceback.
                seq.stream.put(copy.copy(error))
                self._active.remove(seq)
            self._reset_batch(rebuild=True)
            return
        if responses:
            self._batch_steps += 1
            self._batch_tokens += len(responses)
        scored = self._score_responses(responses)
        for response in responses:
            seq = self._batched.get(response.uid)
            if seq is None:
                continue
            done = seq.emit(response.token, scored.get(response.uid))
            if response.finish_reason is None:
                if done:
                    self._retire(seq)
                continue
            if not done:
                seq.finish("length")
            # The row already left the batch, with its KV cache.
            self._retire(seq, state=(response.prompt_cache, response.all_tokens))

    def _score_responses(self, responses) -> dict[int, tuple]:
        """Logprob entries of the step's tokens, for the rows that asked for them."""
        wanted = [
            (r, seq.request.logprobs)
            for r in responses
            if (seq := self._batched.get(r.uid)) and seq.request.logprobs is not None
        ]
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

    # -- embeddings and scores ----------------------------------------------

    def _queue_side(self, request: EmbeddingRequest | ScoreRequest, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if self._loaded is None:
            future.set_exception(
                FailedPrecondition("no model is loaded: call LoadModel first")
            )
        elif request.model_generation != self._generation:
            future.set_exception(
                Aborted("the model was replaced while the request was queued")
            )
        else:
            self._side.append((request, future))

    def _step_side(self) -> None:
        """One chunk of the running embedding or score job; else the next job."""
        if self._job is None:
            self._job = self._next_job()
        job = self._job
        try:
            if job.work is None:
                job.work = job.start()
            if job.work.advance():
                self._job = None
                self._publish()  # before the caller can ask Status
                job.finish(job.work)
        except Exception as e:
            logger.exception("embedding or scoring failed")
            self._job = None
            error = e.with_traceback(None)
            for future in job.futures:
                if not future.done():
                    future.set_exception(copy.copy(error))

    def _next_job(self) -> _Job:
        """The first waiting Score, or every waiting embedding up to a batch."""
        options = self.info.options
        request, future = self._side[0]
        if isinstance(request, ScoreRequest):
            del self._side[0]

            def start() -> ScoreBatch:
                kv_cache, rest = self._fetch_cache(request.prompt)
                self._reused_tokens += len(request.prompt) - len(rest)
                self._prefilled_tokens += len(rest)
                return ScoreBatch(
                    self._loaded.model,
                    kv_cache,
                    rest,
                    request.candidates,
                    options.prefill_step_size,
                    options.max_batch_size,
                )

            def finish(work: ScoreBatch) -> None:
                self._save_cache(request, work.cache, request.prompt)
                future.set_result(work.scores)

            return _Job([future], start, finish)
        embeddings = [
            item for item in self._side if isinstance(item[0], EmbeddingRequest)
        ][: options.max_batch_size]
        self._side = [item for item in self._side if item not in embeddings]
        futures = [future for _, future in embeddings]

        def start() -> EmbeddingBatch:
            return EmbeddingBatch(
                self._loaded.model,
                [request.tokens for request, _ in embeddings],
                options.embedding_pooling,
                options.prefill_step_size,
            )

        def finish(work: EmbeddingBatch) -> None:
            for future, vector in zip(futures, work.vectors()):
                future.set_result(vector)

        return _Job(futures, start, finish)

    def _retire(
        self,
        seq: _Sequence,
        failed: bool = False,
        save_cache: bool = True,
        state: tuple | None = None,
    ) -> None:
        """Drop a sequence; its KV cache goes to the prompt cache unless aborted."""
        if seq.uid is not None:
            del self._batched[seq.uid]
            if state is None:
                removed = self._batch.remove([seq.uid], return_prompt_caches=save_cache)
                state = removed.get(seq.uid)
        else:
            state = seq.close_single(failed)
        self._active.remove(seq)
        if save_cache and state is not None:
            self._save_cache(seq.request, *state)
        if seq.metrics is not None:
            self.last_metrics = seq.metrics
        if not self._active:
            self._publish()

    def _save_cache(
        self, request: GenerationRequest | ScoreRequest, kv_cache: list, tokens
    ) -> None:
        """Keep a KV cache for the next request to reuse."""
        # Cancelled prefill keeps whole chunks, so the offset can fall short.
        length = min(getattr(kv_cache[0], "offset", 0), len(tokens))
        if length > 1:
            # Evaluated now: a lazy slice would pin the whole batch's KV buffers.
            mx.eval([layer.state for layer in kv_cache])
            self._prompt_cache.insert_cache(
                request.model_generation, list(tokens[:length]), kv_cache
            )

    def _abort_all(self, reason: str, rebuild: bool = True) -> None:
        # Unload clears the cache, shutdown ends it, and a failed loop's state
        # is suspect: nothing here is worth keeping.
        for seq in self._active:
            seq.stream.put(Aborted(reason))
            if seq.uid is None:
                seq.tokens.close()
        self._active.clear()
        running = self._job.futures if self._job else []
        for future in running + [future for _, future in self._side]:
            future.set_exception(Aborted(reason))
        self._job, self._side = None, []
        # Tell the handlers now: an unload may be followed by a long load.
        self._outbox.flush()
        self._reset_batch(rebuild)

    def _reset_batch(self, rebuild: bool) -> None:
        """Drop every batched row; a fresh BatchGenerator when ``rebuild``."""
        self._batched.clear()
        if self._batch is None:
            return
        try:
            self._batch.close()
        except Exception:
            logger.exception("closing the batch generator failed")
        self._batch = (
            self._make_batch(self._loaded.model, self.info.options) if rebuild else None
        )

    def _publish(self) -> None:
        state = self._state
        if state == "ready" and self._active:
            state = "busy"
        memory = memory_snapshot()
        if self.info is not None:
            memory.update(self.info.compute_path.breakdown())
            memory.update(grammars_compiled=self.info.grammars.compilations)
        memory.update(
            prompt_cache_entries=len(self._prompt_cache),
            prompt_cache_bytes=self._prompt_cache.nbytes,
            prompt_cache_reused_tokens=self._reused_tokens,
            prompt_tokens_prefilled=self._prefilled_tokens,
            batch_decode_steps=self._batch_steps,
            batch_decode_tokens=self._batch_tokens,
        )
        self.stats = EngineStats(state, len(self._active), memory)

    def _unload(self) -> None:
        self._abort_all("the model was unloaded", rebuild=False)
        self._prompt_cache.clear()
        self._loaded = None
        self.info = None
        self._generation += 1
        gc.unfreeze()
        gc.collect()
        release_memory()

    def _load(
        self, name: str, identity: str, options: LoadOptions, context_size: int, kwargs
    ) -> ModelInfo:
        previous = self._state
        self._state = "loading"
        self._publish()
        try:
            # Resolved and checked beside the running model, which a failure keeps.
            loaded = load_model(
                name, trust_remote_code=options.trust_remote_code, **kwargs
            )
        except Exception:
            self._state = previous
            raise
        self._unload()
        try:
            loaded, info, batch = self._prepare(loaded, identity, options, context_size)
        except Exception:
            self._state = "error"
            raise
        self._loaded, self.info, self._batch = loaded, info, batch
        self._generation = info.generation
        self._prompt_cache = ThreadSafeLRUPromptCache(
            max_size=options.max_cache_entries,
            can_trim_fn=can_trim_prompt_cache,
            trim_fn=trim_prompt_cache,
            max_bytes=(
                int(physical_memory() * PROMPT_CACHE_MEMORY_FRACTION)
                if options.max_cache_bytes is None
                else options.max_cache_bytes
            ),
        )
        self._state = "ready"
        # The loaded model's objects live until the next load: keep the garbage
        # collector from scanning them while tokens stream.
        gc.collect()
        gc.freeze()
        return info

    def _prepare(
        self,
        loaded: LoadedModel,
        identity: str,
        options: LoadOptions,
        context_size: int,
    ) -> tuple[LoadedModel, ModelInfo, BatchGenerator | None]:
        """Load the weights and build what serving the model needs."""
        mx.eval(loaded.model.parameters())
        model, compute_path = prepare_for_cpu(
            loaded.model, options.dequantize, options.dequantize_max_bytes
        )
        loaded = dataclasses.replace(loaded, model=model)
        if options.prefill_step_size is None:
            options = dataclasses.replace(
                options, prefill_step_size=compute_path.prefill_step_size
            )
        logger.info("compute path: %s", compute_path.description)
        config_limit = loaded.config.get("max_position_embeddings") or 4096
        vocab_size = loaded.config.get("vocab_size") or len(loaded.tokenizer.vocab)
        token_bytes = make_token_bytes(loaded.tokenizer)
        info = ModelInfo(
            name=identity,
            source=loaded.source,
            tokenizer=loaded.tokenizer,
            context_size=context_size or config_limit,
            vocab_size=vocab_size,
            options=options,
            generation=self._generation + 1,
            compute_path=compute_path,
            markers=make_output_markers(loaded.tokenizer),
            token_bytes=token_bytes,
            embeddings=hidden_state_model(loaded.model) is not None,
            grammars=GrammarCompiler(loaded.tokenizer, token_bytes, vocab_size),
        )
        why = unbatchable_reason(loaded.model, options.max_kv_size)
        if why:
            logger.info("requests run one sequence each: %s", why)
        return loaded, info, None if why else self._make_batch(loaded.model, options)

    def _make_batch(self, model, options: LoadOptions) -> BatchGenerator:
        if self._stream is None:
            # Its own stream: small evaluations on the thread's default stream,
            # such as logprobs, need not wait behind the next step.
            self._stream = mx.new_stream(mx.default_device())
        return BatchGenerator(
            model,
            completion_batch_size=options.max_batch_size,
            # BatchGenerator raises its decode limit to the prefill batch size.
            prefill_batch_size=min(options.prefill_batch_size, options.max_batch_size),
            prefill_step_size=options.prefill_step_size,
            stream=self._stream,
        )

    def _free(self) -> None:
        self._unload()
        self._state = "uninitialized"
