"""The generation engine: one thread that owns the model and every MLX object.

gRPC handlers never touch MLX. They parse a request into a ``GenerationRequest``,
``submit`` it and read events from the returned ``RequestStream``; control work
(load, free) is sent to the same thread with ``call``. Each turn of the thread's
loop takes the inbox's messages, sweeps cancelled streams, steps the decoder,
emits each sequence's events and retires finished ones, runs a chunk of any
Score or Embedding job, and publishes its state.
"""

import asyncio
import dataclasses
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlx_backend.caches.prompt_files import PromptFiles, make_fingerprint
from mlx_backend.caches.quantized_kv import adopt
from mlx_backend.cpu.blas import (
    blas_threads,
    choose_blas_threads,
    physical_cores,
    physical_memory,
    set_blas_threads,
)
from mlx_backend.cpu.pacing import make_pacing
from mlx_backend.decoders.base import (
    Decoder,
    KVState,
    NewSequence,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.factory import make_decoder, make_plain_decoder
from mlx_backend.distributed.group import (
    HEARTBEAT_SECONDS,
    Exit,
    LeaderDecoder,
    LeaderJobs,
    Load,
    Lockstep,
    Ping,
    Unload,
    join_group,
    leader_settings,
    make_group_prompt_cache,
)
from mlx_backend.distributed.sharding import Sharding, choose_mode
from mlx_backend.engine.jobs import EmbeddingRequest, JobQueue, ScoreRequest
from mlx_backend.errors import (
    Aborted,
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from mlx_backend.models.loading import (
    LoadedModel,
    ModelInfo,
    load_draft,
    load_model,
    prepare_model,
)
from mlx_backend.models.lora import Adapter, check_adapters
from mlx_backend.output.reply_pipeline import Finished, Output, ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest
from mlx_backend.sampling import make_request_processors, make_request_sampler
from mlx_cache import ThreadSafeLRUPromptCache, common_length
from mlx_utils import (
    check_kv_cache,
    make_kv_cache,
    memory_snapshot,
    model_signature,
    release_memory,
)
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# Memory readings are refreshed every this many decode steps.
STATS_INTERVAL = 16
# A request that wakes an idle engine waits for others that arrive within this gap
# of the last one, for at most this long, so that a burst is prefilled together.
BURST_GAP_SECONDS = 0.005
BURST_SECONDS = 0.03
# The share of physical memory the prompt cache may take by default.
PROMPT_CACHE_MEMORY_FRACTION = 0.1
# A request waits for another's prefill only to skip at least this many tokens:
# below it, copying the shared KV state costs about what prefilling it does.
SHARED_PREFIX_MIN_TOKENS = 64


@dataclass(frozen=True)
class RequestMetrics:
    """What GetMetrics reports of the most recently finished request."""

    tokens_generated: int = 0
    tokens_per_second: float = 0.0
    prompt_tokens_processed: int = 0
    slot_id: int = 0
    # Speculative decoding: tokens proposed for the request, and those kept.
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0


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


# Inbox messages, from any thread to the engine thread.
@dataclass(frozen=True)
class Submit:
    request: GenerationRequest
    stream: RequestStream


@dataclass(frozen=True)
class Compute:
    request: EmbeddingRequest | ScoreRequest
    future: Future


@dataclass(frozen=True)
class Call:
    fn: Callable
    args: tuple
    future: Future


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(eq=False)
class _Sequence:
    """One request being generated: its decoder key, stream and reply pipeline."""

    key: int
    request: GenerationRequest
    stream: RequestStream
    reply: ReplyPipeline
    # Prompt tokens served from the prompt cache, and the slot number it holds.
    reused: int
    slot: int
    proposed: int = 0
    accepted: int = 0


class Engine:
    """Owns the model and runs every MLX call on its own thread."""

    def __init__(self):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = _Outbox()
        self._sequences: dict[int, _Sequence] = {}
        # Submitted requests, admitted after the step's cancellations retire.
        self._waiting: list[Submit] = []
        # Prompt prefixes that running sequences are prefilling, with the requests
        # waiting to start from their KV state; and each sequence's prefixes.
        self._pending: dict[tuple[int, ...], list[Submit]] = {}
        self._prefixes: dict[int, list[tuple[int, ...]]] = {}
        self._decoder: Decoder | None = None
        self._jobs = JobQueue(self._fetch_cache, self._save_cache)
        self._loaded: LoadedModel | None = None
        self._generation = 0
        self._steps = 0
        self._state = "uninitialized"
        self._closed = False
        self.info: ModelInfo | None = None
        self.stats = EngineStats("uninitialized", 0, {})
        self.last_metrics = RequestMetrics()
        self._prompt_cache = ThreadSafeLRUPromptCache(max_size=0)
        # PromptCachePath files and prompt_cache_dir; whether the prompt cache
        # changed since the folder was last written.
        self._files: PromptFiles | None = None
        self._cache_changed = False
        # Prompt tokens served from the prompt cache, and those prefilled.
        self._reused_tokens = 0
        self._prefilled_tokens = 0
        # Serving over a distributed group: rank 0's channel to the workers.
        self._lockstep: Lockstep | None = None
        self._thread = threading.Thread(
            target=self._run, name="mlx-engine", daemon=True
        )
        self._thread.start()

    # -- any thread ---------------------------------------------------------

    def submit(self, request: GenerationRequest, loop) -> RequestStream:
        self._check_open()
        stream = RequestStream(loop, self._outbox)
        self._inbox.put(Submit(request, stream))
        return stream

    def compute(self, request: EmbeddingRequest | ScoreRequest) -> Future:
        """An embedding vector, or a Score request's per-token logprobs for each
        candidate, computed a chunk at a time between decode steps."""
        self._check_open()
        future: Future = Future()
        self._inbox.put(Compute(request, future))
        return future

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the engine thread between steps."""
        self._check_open()
        future: Future = Future()
        self._inbox.put(Call(fn, args, future))
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
        draft: str = "",
        adapters: tuple[Adapter, ...] = (),
        **kwargs,
    ) -> Future:
        """Load ``name``; a failure before its weights load keeps the current model.

        ``identity`` is the ``Model`` string requests' ``ModelIdentity`` must match;
        ``draft`` is ``DraftModel``, the proposer of speculative decoding;
        ``adapters`` are the LoRA adapters to apply.
        """
        return self.call(
            self._load, name, identity, draft, adapters, options, context_size, kwargs
        )

    def free(self):
        return self.call(self._free)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._inbox.put(Stop())
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------

    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._schedule()
                if running and self._busy():
                    with self._watching():
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
            self._abort_all("the backend is shutting down", keep_decoder=False)
            self._sync_files()
            if self._lockstep is not None and self._lockstep.broken is None:
                self._lockstep.flush(Exit(), wait=True)
        finally:
            self._drain_inbox()
            self._outbox.flush()

    def _drain_inbox(self) -> None:
        """Answer whatever was queued behind the stop request."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case Submit(stream=stream):
                    stream.put(Aborted("the backend is shutting down"))
                case Compute(future=future) | Call(future=future):
                    if future.set_running_or_notify_cancel():
                        future.set_exception(Aborted("the backend is shutting down"))

    def _busy(self) -> bool:
        return bool(self._sequences or self._waiting or self._jobs)

    def _schedule(self) -> bool:
        """Take the inbox's messages; block while idle. False when asked to stop."""
        burst_ends = None
        while True:
            busy = self._busy()
            if not busy:
                self._outbox.flush()  # before waiting for work
                self._sync_files()
            idle_wait = None if self._lockstep is None else HEARTBEAT_SECONDS
            block, timeout = not busy, idle_wait
            if burst_ends is not None:
                # The rest of a burst: each may come within the gap of the last.
                timeout = min(BURST_GAP_SECONDS, burst_ends - time.monotonic())
                block = timeout > 0
            try:
                message = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                if busy:
                    return True
                self._heartbeat()
                continue
            match message:
                case Stop():
                    return False
                case Submit():
                    if not self._sequences and burst_ends is None:
                        # Requests that come together arrive over some milliseconds:
                        # the first prefilled alone would hold the rest a step.
                        burst_ends = time.monotonic() + BURST_SECONDS
                    self._waiting.append(message)
                case Compute(request, future):
                    self._queue_job(request, future)
                case Call(fn, args, future):
                    self._run_call(fn, args, future)
            self._publish()

    def _step(self) -> None:
        # Cancelled rows retire first, so that their KV state serves new requests.
        self._sweep()
        self._admit_waiting()
        if self._sequences:
            self._emit(self._decoder.step())
        if self._jobs:
            # On the decode steps' stream: one BLAS thread team, and one order of
            # collectives on every rank of a group.
            with mx.stream(thread_stream()):
                self._jobs.step(self._loaded.model, self.info.options, self._publish)
        self._steps += 1
        if self._steps % STATS_INTERVAL == 0:
            self._publish()

    def _sweep(self) -> None:
        """Retire the sequences whose handler is gone or whose client stopped reading."""
        for followers in self._pending.values():
            followers[:] = [f for f in followers if not f.stream.cancelled]
        if not self._sequences:
            return
        limit = self.info.options.max_stream_backlog
        for seq in list(self._sequences.values()):
            if seq.stream.cancelled:
                self._cancel(seq)
            elif seq.stream.backlog > limit:
                # A client that stops reading must not make the server buffer its
                # whole reply; the other streams go on.
                logger.warning(
                    "ending a stream after %d tokens: its client left %d replies unread",
                    seq.reply.generated,
                    seq.stream.backlog,
                )
                seq.stream.put(
                    ResourceExhausted(
                        f"PredictStream: the client left {seq.stream.backlog} replies "
                        f"unread (max_stream_backlog is {limit}); the stream was ended"
                    )
                )
                self._retire(seq)

    def _cancel(self, seq: _Sequence, state: KVState | None = None) -> None:
        if seq.reply.first_token_at is None:
            logger.info("generation cancelled during prefill")
        else:
            logger.info("generation cancelled after %d tokens", seq.reply.generated)
        self._retire(seq, state)

    def _emit(self, results: list[StepResult]) -> None:
        """Each sequence's tokens through its reply pipeline to its stream."""
        for result in results:
            seq = self._sequences.get(result.key)
            if seq is None:
                continue
            if result.error is not None:
                seq.stream.put(result.error)
                self._retire(seq, result.state)
                continue
            for snapshot in result.snapshots:
                self._share(snapshot)
            seq.proposed += result.proposed
            seq.accepted += result.accepted
            if seq.stream.cancelled:  # during the step
                self._cancel(seq, result.state)
                continue
            try:
                for token, scored in zip(result.tokens, result.logprobs):
                    event = seq.reply.add(token, scored)
                    if event is not None:
                        seq.stream.put(event)
                    if seq.reply.finished:
                        break
                if result.done and not seq.reply.finished:
                    seq.stream.put(seq.reply.finish("length"))
            except BackendError as e:
                seq.stream.put(e)
                self._retire(seq, result.state)
                continue
            if seq.reply.finished:
                self._retire(seq, result.state)

    def _admit_waiting(self) -> None:
        """Start the waiting requests, except those that can wait for a prefix
        another sequence is prefilling."""
        waiting, self._waiting = self._waiting, []
        for i, message in enumerate(waiting):
            if message.stream.cancelled:
                continue
            prefix, lead = self._plan_sharing(message.request, waiting[i + 1 :])
            if prefix is not None:
                self._pending[prefix].append(message)
                continue
            self._admit(message.request, message.stream, lead)
        if waiting:
            self._publish()

    def _plan_sharing(
        self, request: GenerationRequest, later: list[Submit]
    ) -> tuple[tuple[int, ...] | None, int]:
        """A running sequence's prefix to wait for, or else the length of the
        prefix this request shares with those that arrived after it (0: none)."""
        if (
            self._loaded is None
            or request.load_id != self._generation
            or not self.info.options.prefix_sharing
            or not self._decoder.capabilities.prefix_snapshots
        ):
            return None, 0
        prompt = request.prompt
        cached = self._prompt_cache.cached_length(self._generation, prompt)
        shared = {p: common_length(p, prompt) for p in self._pending}
        # The shortest of the longest matches: its prefill ends first.
        best = max(shared, key=lambda p: (shared[p], -len(p)), default=None)
        if best is not None:
            saved = shared[best] - cached
            # Waiting past the shared part (another prompt's own suffix) is worth
            # at most a quarter of the prefill it saves.
            if (
                saved >= SHARED_PREFIX_MIN_TOKENS
                and len(best) - shared[best] <= saved // 4
            ):
                return best, 0
        lead = max((common_length(prompt, m.request.prompt) for m in later), default=0)
        lead = min(lead, len(prompt) - 1)
        return None, lead if lead - cached >= SHARED_PREFIX_MIN_TOKENS else 0

    def _share(self, snapshot: KVState) -> None:
        """A prompt prefix was prefilled: its KV state serves the requests that
        waited for it, and later ones."""
        prefix = tuple(snapshot.tokens)
        followers = self._pending.pop(prefix, [])
        self._save_cache(
            self._generation, snapshot.cache, prefix, max(1, len(followers))
        )
        if followers:
            logger.info(
                "a %d-token prefix was prefilled once for %d more requests",
                len(prefix),
                len(followers),
            )
        self._waiting[:0] = followers

    def _admit(
        self, request: GenerationRequest, stream: RequestStream, lead: int = 0
    ) -> None:
        if stream.cancelled:
            return
        if self._loaded is None:
            stream.put(FailedPrecondition("no model is loaded: call LoadModel first"))
            return
        if request.load_id != self._generation:
            stream.put(Aborted("the model was replaced while the request was queued"))
            return
        if self._lockstep is not None and self._lockstep.broken:
            stream.put(Unavailable(self._lockstep.broken))
            return
        try:
            seq = self._start(request, stream, lead)
        except Exception as e:
            logger.exception("could not start a generation")
            stream.put(e)
            return
        self._sequences[seq.key] = seq
        logger.info(
            "prompt: %d tokens, %d from the prompt cache",
            len(request.prompt),
            seq.reused,
        )

    def _start(
        self, request: GenerationRequest, stream: RequestStream, lead: int
    ) -> _Sequence:
        info = self.info
        capabilities = self._decoder.capabilities
        if request.logprobs is not None and not capabilities.logprobs:
            raise FailedPrecondition(
                "Logprobs: this model's decoder cannot report them"
            )
        if request.grammar is not None and not capabilities.grammar:
            raise FailedPrecondition("Grammar: this model's decoder cannot apply one")
        processors, grammar = make_request_processors(
            request, info.tokenizer.eos_token_ids, info.vocab_size
        )
        reply = ReplyPipeline(
            request, info.tokenizer, info.markers, info.token_bytes, grammar
        )
        if request.prompt_file is not None:
            self._restore(request.prompt_file.path, request.prompt)
        kv_cache, rest = self._fetch_cache(request.prompt)
        prompt = request.prompt
        snapshots = []
        if capabilities.prefix_snapshots and info.options.prefix_sharing:
            # The shared prefix for those that arrived with it, and the prompt once
            # prefilled, for those that come while it generates.
            snapshots = [n for n in (lead,) if n > len(prompt) - len(rest)]
            if len(rest) > SHARED_PREFIX_MIN_TOKENS:
                snapshots = sorted({*snapshots, len(prompt) - 1})
        # Only processors that depend on nothing but the tokens can run at
        # proposed positions: grammars and extra hooks keep their own state.
        draft_tokens = 0
        if request.grammar is None and not request.processors:
            draft_tokens = request.draft_tokens or info.options.num_draft_tokens
        key = self._decoder.add(
            NewSequence(
                prompt=request.prompt,
                rest=rest,
                kv_cache=kv_cache,
                sampler=make_request_sampler(request),
                processors=processors,
                max_tokens=request.max_tokens,
                logprobs=request.logprobs,
                history=request.sampling.repetition_context_size,
                cancelled=lambda: stream.cancelled,
                snapshots=tuple(snapshots),
                draft_tokens=draft_tokens,
            )
        )
        for n in snapshots:
            self._pending.setdefault(prompt[:n], [])
        self._prefixes[key] = [prompt[:n] for n in snapshots]
        reused = len(request.prompt) - len(rest)
        return _Sequence(key, request, stream, reply, reused, self._free_slot())

    def _free_slot(self) -> int:
        """The lowest slot number no running sequence holds (as llama.cpp numbers them)."""
        taken = {seq.slot for seq in self._sequences.values()}
        return next(slot for slot in range(len(taken) + 1) if slot not in taken)

    def _retire(self, seq: _Sequence, state: KVState | None = None) -> None:
        """Drop a sequence; its KV state goes to the prompt cache."""
        kept = self._decoder.remove(seq.key)
        state = state or kept
        del self._sequences[seq.key]
        for prefix in self._prefixes.pop(seq.key, ()):
            # Prefill ended early: whoever waited for it starts on its own.
            self._waiting[:0] = self._pending.pop(prefix, [])
        if state is not None:
            self._save_cache(seq.request.load_id, state.cache, state.tokens)
            file = seq.request.prompt_file
            if file is not None and not file.read_only:
                tokens = state.tokens if file.everything else seq.request.prompt
                self._files.write(file.path, state.cache, tokens)
        final = seq.reply.finished
        if final is not None:
            self.last_metrics = RequestMetrics(
                tokens_generated=final.completion_tokens,
                tokens_per_second=(
                    final.completion_tokens / final.generation_seconds
                    if final.generation_seconds > 0
                    else 0.0
                ),
                prompt_tokens_processed=len(seq.request.prompt) - seq.reused,
                slot_id=seq.slot,
                draft_tokens_proposed=seq.proposed,
                draft_tokens_accepted=seq.accepted,
            )
        if not self._sequences:
            self._publish()

    # -- the prompt cache ---------------------------------------------------

    def _fetch_cache(self, prompt: tuple[int, ...]) -> tuple[list, tuple[int, ...]]:
        """The nearest KV cache for ``prompt`` and the prompt tokens it lacks."""
        kv_cache, rest = self._prompt_cache.fetch_for_prompt(self._generation, prompt)
        if kv_cache is None:
            kv_cache = make_kv_cache(self._loaded.model, self.info.options)
        self._reused_tokens += len(prompt) - len(rest)
        self._prefilled_tokens += len(rest)
        return kv_cache, tuple(rest)

    def _save_cache(
        self, generation: int, kv_cache: list, tokens, holders: int = 1
    ) -> None:
        """Keep a KV cache for the next request (or ``holders`` requests) to reuse."""
        self._prompt_cache.insert_state(generation, tokens, kv_cache, holders)
        self._cache_changed = True

    def _restore(self, path: Path, prompt: tuple[int, ...]) -> None:
        """A PromptCachePath file's KV state joins the prompt cache when it serves
        more of ``prompt`` than the cache does."""
        if self._lockstep is not None:
            raise FailedPrecondition(
                "PromptCachePath: prompt cache files are not used over a "
                "distributed group"
            )
        cached = self._prompt_cache.cached_length(self._generation, prompt)
        state = self._files.read(path, prompt, cached)
        if state is None:
            return
        cache, tokens = state
        self._save_cache(self._generation, self._adopt(cache), tokens)
        if self._prompt_cache.cached_length(self._generation, prompt) <= cached:
            logger.warning(
                "the prompt cache can't keep the %d-token KV state of %s "
                "(max_cache_entries, max_cache_bytes)",
                len(tokens),
                path,
            )
            self._files.unkept(path)
            return
        logger.info("restored %d tokens' KV state from %s", len(tokens), path)

    def _adopt(self, cache: list) -> list:
        return adopt(cache, make_kv_cache(self._loaded.model, self.info.options))

    def _sync_files(self) -> None:
        """While idle, prompt_cache_dir comes to hold the prompt cache's entries."""
        if self._files is None or not self._cache_changed:
            return
        self._cache_changed = False
        self._files.sync_folder(self._prompt_cache.entries(self._generation))

    # -- embeddings, scores and control work --------------------------------

    def _queue_job(self, request: EmbeddingRequest | ScoreRequest, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if self._loaded is None:
            future.set_exception(
                FailedPrecondition("no model is loaded: call LoadModel first")
            )
        elif request.load_id != self._generation:
            future.set_exception(
                Aborted("the model was replaced while the request was queued")
            )
        elif self._lockstep is not None and self._lockstep.broken:
            future.set_exception(Unavailable(self._lockstep.broken))
        else:
            self._jobs.add(request, future)

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

    def _abort_all(self, reason: str, keep_decoder: bool = True) -> None:
        # Unload clears the cache, shutdown ends it, and a failed loop's state
        # is suspect: nothing here is worth keeping.
        waiting = self._waiting + [m for f in self._pending.values() for m in f]
        for stream in [m.stream for m in waiting] + [
            seq.stream for seq in self._sequences.values()
        ]:
            stream.put(Aborted(reason))
        self._sequences.clear()
        self._waiting, self._pending, self._prefixes = [], {}, {}
        self._jobs.abort(Aborted(reason))
        # Tell the handlers now: an unload may be followed by a long load.
        self._outbox.flush()
        if self._decoder is None:
            return
        if keep_decoder:
            self._decoder.reset()
        else:
            self._decoder.close()
            self._decoder = None

    def _watching(self):
        """Over a group, a turn that hangs in a collective ends the process."""
        return nullcontext() if self._lockstep is None else self._lockstep.watching()

    def _heartbeat(self) -> None:
        """While idle, check that every rank of the group is still there."""
        if self._lockstep.broken is None:
            try:
                with self._watching():
                    self._lockstep.flush(Ping(), wait=True)
            except Unavailable:
                pass
        self._publish()

    def _publish(self) -> None:
        state = self._state
        if state == "ready" and self._sequences:
            state = "busy"
        if self._lockstep is not None and self._lockstep.broken:
            state = "error"
        memory = memory_snapshot()
        if self.info is not None:
            memory.update(self.info.compute_path.breakdown())
            memory.update(grammars_compiled=self.info.grammars.compilations)
        decoder = self._decoder
        memory.update(
            prompt_cache_entries=len(self._prompt_cache),
            prompt_cache_bytes=self._prompt_cache.nbytes,
            prompt_cache_reused_tokens=self._reused_tokens,
            prompt_tokens_prefilled=self._prefilled_tokens,
            batch_decode_steps=decoder.batch_steps if decoder else 0,
            batch_decode_tokens=decoder.batch_tokens if decoder else 0,
            draft_tokens_proposed=decoder.draft_proposed if decoder else 0,
            draft_tokens_accepted=decoder.draft_accepted if decoder else 0,
            distributed_ranks=self._lockstep.size if self._lockstep else 1,
        )
        self.stats = EngineStats(state, len(self._sequences), memory)

    # -- loading ------------------------------------------------------------

    def _unload(self) -> None:
        self._abort_all("the model was unloaded", keep_decoder=False)
        self._sync_files()
        self._files = None
        if self._lockstep is not None and self._lockstep.broken is None:
            self._lockstep.record(Unload())
        self._prompt_cache.clear()
        self._loaded = None
        self.info = None
        self._generation += 1
        gc.unfreeze()
        gc.collect()
        release_memory()

    def _load(
        self,
        name: str,
        identity: str,
        draft_name: str,
        adapters: tuple[Adapter, ...],
        options: LoadOptions,
        context_size: int,
        kwargs,
    ) -> ModelInfo:
        previous = self._state
        self._state = "loading"
        self._publish()
        try:
            if options.speculative == "draft" and not draft_name:
                raise InvalidArgument("Options: speculative:draft needs a DraftModel")
            lockstep = self._join(options)
            if lockstep is not None and draft_name:
                raise InvalidArgument(
                    "DraftModel: speculative decoding does not run distributed"
                )
            if lockstep is not None and adapters:
                raise InvalidArgument(
                    "LoraAdapters: LoRA adapters are not served distributed"
                )
            if lockstep is not None and options.prompt_cache_dir:
                raise InvalidArgument(
                    "Options: prompt_cache_dir is not used over a distributed group"
                )
            # Resolved and checked beside the running model, which a failure keeps.
            loaded = load_model(
                name, trust_remote_code=options.trust_remote_code, **kwargs
            )
            check_adapters(loaded.model, adapters)
            check_kv_cache(loaded.model, options)
            sharding = None
            if lockstep is not None:
                mode = choose_mode(
                    loaded.model, lockstep.size, options.distributed_mode
                )
                sharding = Sharding(lockstep.group, mode)
                total_layers = len(loaded.model.layers)
            draft = None
            if draft_name:
                model_path = kwargs.get("model_path", "")
                draft = load_draft(draft_name, model_path, loaded, options)
        except Exception:
            self._state = previous
            raise
        self._unload()
        max_bytes = (
            int(physical_memory() * PROMPT_CACHE_MEMORY_FRACTION)
            if options.max_cache_bytes is None
            else options.max_cache_bytes
        )
        generation = self._generation + 1
        threads = self._set_threads(options)
        if lockstep is not None:
            lockstep.stall_seconds = options.distributed_step_timeout
            lockstep.record(
                Load(name, kwargs, options, context_size, generation, mode, max_bytes)
            )
            lockstep.flush()
        try:
            loaded, info, decoder = self._prepare(
                loaded,
                identity,
                options,
                context_size,
                generation,
                draft,
                sharding,
                adapters,
            )
        except Exception:
            self._state = "error"
            raise
        info = self._open_files(loaded, info, adapters, kwargs.get("model_path", ""))
        path = info.compute_path
        if threads:
            path = dataclasses.replace(
                path, description=f"{path.description}; {threads}"
            )
        path = dataclasses.replace(path, blas_threads=blas_threads() or 0)
        info = dataclasses.replace(info, compute_path=path)
        self._loaded, self.info, self._decoder = loaded, info, decoder
        self._generation = info.load_id
        self._prompt_cache = make_group_prompt_cache(
            lockstep,
            options,
            max_bytes,
            total_layers if lockstep is not None else 0,
            can_trim_prompt_cache,
            trim_prompt_cache,
        )
        for cache, tokens in self._files.load_folder(options.max_cache_entries):
            self._save_cache(self._generation, self._adopt(cache), tokens)
        self._cache_changed = False
        self._state = "ready"
        # The loaded model's objects live until the next load: keep the garbage
        # collector from scanning them while tokens stream.
        gc.collect()
        gc.freeze()
        return info

    def _set_threads(self, options: LoadOptions) -> str:
        """Cap the fast BLAS's threads for this model; what was set, for the load
        message (empty: nothing, as on a GPU or without a fast BLAS)."""
        if mx.default_device() != mx.cpu:
            return ""
        if self._lockstep is not None and not options.threads:
            return ""  # the group's ranks share the cores (distributed.share_cores)
        threads, why = choose_blas_threads(
            options.threads, physical_cores(), os.environ
        )
        if threads is None:
            threads = blas_threads()
        elif not set_blas_threads(threads):
            return ""
        logger.info("BLAS threads: %s (%s)", threads, why)
        return f"{threads} BLAS threads ({why})"

    def _open_files(
        self,
        loaded: LoadedModel,
        info: ModelInfo,
        adapters: tuple[Adapter, ...],
        model_path: str,
    ) -> ModelInfo:
        """The loaded model's prompt cache files: a KV state on disk serves only
        the model, tokenizer, KV layout and adapters that made it."""
        options = info.options
        layout = (
            f"kv_bits={options.kv_bits},kv_group_size={options.kv_group_size},"
            f"quantized_kv_start={options.quantized_kv_start},"
            f"max_kv_size={options.max_kv_size},fuse_lora={options.fuse_lora},"
            f"adapters={[(str(a.path), a.scale) for a in adapters]}"
        )
        identity = f"{info.source}; {model_signature(loaded.model, loaded.config)}"
        fingerprint = make_fingerprint(identity, info.tokenizer.vocab, layout)
        layers = len(make_kv_cache(loaded.model, options))
        folder = None
        if options.prompt_cache_dir:
            # Each model's entries in a folder of their own.
            folder = Path(options.prompt_cache_dir) / fingerprint[:16]
        self._files = PromptFiles(fingerprint, layers, folder)
        roots = (model_path, options.prompt_cache_dir)
        return dataclasses.replace(
            info, prompt_file_roots=tuple(Path(r).resolve() for r in roots if r)
        )

    def _prepare(
        self,
        loaded,
        identity,
        options,
        context_size,
        generation,
        draft,
        sharding,
        adapters=(),
    ):
        """The model's weights, its ModelInfo and decoder; over a group, every
        rank's outcome, which all ranks must share."""
        lockstep = self._lockstep if sharding is not None else None
        error = None
        try:
            loaded, info = prepare_model(
                loaded, identity, options, context_size, generation, sharding, adapters
            )
            pacing = make_pacing(
                loaded.model, info.options, lockstep is None, os.environ
            )
            path = info.compute_path
            info = dataclasses.replace(
                info,
                compute_path=dataclasses.replace(
                    path,
                    description=f"{path.description}; {pacing.describe()}",
                    paced=pacing.paced,
                ),
            )
            if lockstep is None:
                decoder = make_decoder(loaded.model, info.options, draft, pacing.paced)
            else:
                decoder = make_plain_decoder(loaded.model, info.options, pacing.paced)
                if not decoder.capabilities.batching:
                    raise InvalidArgument(
                        "distributed serving needs a model whose KV caches batch"
                    )
                decoder = LeaderDecoder(decoder, lockstep)
        except Exception as e:
            if lockstep is None:
                raise
            error = e
        if lockstep is not None:
            lockstep.agree(error)
        return loaded, info, decoder

    def _join(self, options: LoadOptions) -> Lockstep | None:
        """Rank 0's group, joined at the first load that names one."""
        if self._lockstep is not None:
            self._lockstep.check()
            return self._lockstep
        settings = leader_settings(options, os.environ)
        if settings is None:
            return None
        group = join_group(settings)
        self._lockstep = Lockstep(group)
        self._jobs = LeaderJobs(self._jobs, self._lockstep)
        logger.info(
            "rank 0 of a %s group of %d ranks (%s)",
            settings.backend,
            group.size(),
            settings.hostfile,
        )
        return self._lockstep

    def _free(self) -> None:
        self._unload()
        self._state = "uninitialized"
