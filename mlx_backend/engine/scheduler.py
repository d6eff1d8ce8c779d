"""The scheduler: which requests run, and what becomes of each step's results.

``schedule`` sweeps the running sequences whose client is gone, then admits the
waiting requests into the decoder, each from the longest prefix the prompt store
holds. A request that shares a long prefix with one being prefilled waits for its
KV state instead (prefix sharing). ``update`` runs each sequence's step results
through its reply pipeline to its stream, and retires the finished ones, whose KV
state goes to the prompt store.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from mlx_backend.decoders.base import KVState, NewSequence, StepResult
from mlx_backend.engine.loader import ServedModel
from mlx_backend.engine.loop import RequestStream, Submit
from mlx_backend.engine.stats import RequestMetrics, make_request_metrics
from mlx_backend.errors import (
    Aborted,
    BackendError,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from mlx_backend.output.reply_pipeline import ReplyPipeline
from mlx_backend.request_parsing import GenerationRequest
from mlx_backend.sampling import make_request_processors, make_request_sampler
from mlx_cache import common_length

logger = logging.getLogger(__name__)

# A request waits for another's prefill only to skip at least this many tokens:
# below it, copying the shared KV state costs about what prefilling it does.
SHARED_PREFIX_MIN_TOKENS = 64


def snapshot_boundaries(reused: int, length: int, interval: int) -> set[int]:
    """Where prefill keeps the KV state of a prompt whose cache can't be trimmed:
    every ``interval`` tokens (0: none) and the end (less the token that starts
    generation), past the ``reused`` tokens it starts from."""
    end = length - 1
    if end <= reused:
        return set()
    marks = set(range(interval, end, interval)) if interval else set()
    return {n for n in marks if n > reused} | {end}


def admission_refusal(
    served: ServedModel | None, load_id: int, unavailable: str | None
) -> BackendError | None:
    """Why a request for load ``load_id`` can't start now (generation, Score or
    Embedding alike); None when it can."""
    if served is None:
        return FailedPrecondition("no model is loaded: call LoadModel first")
    if load_id != served.info.load_id:
        return Aborted("the model was replaced while the request was queued")
    if unavailable:
        return Unavailable(unavailable)
    return None


@dataclass(eq=False)
class Running:
    """One request being generated: its decoder key, stream and reply pipeline."""

    key: int
    request: GenerationRequest
    stream: RequestStream
    reply: ReplyPipeline
    # Prompt tokens served from the prompt cache, and the slot number it holds.
    reused: int
    slot: int
    # The prompt and reply tokens its KV cache may come to hold.
    reserved: int
    proposed: int = 0
    accepted: int = 0


class Scheduler:
    """Waiting and running requests. Every method runs on the engine thread and
    takes the model being served (None when there is none)."""

    def __init__(self):
        self.running: dict[int, Running] = {}
        # Submitted requests, admitted after the step's cancellations retire.
        self.waiting: list[Submit] = []
        # Prompt prefixes that running sequences are prefilling, with the requests
        # waiting to start from their KV state; and each sequence's prefixes.
        self._pending: dict[tuple[int, ...], list[Submit]] = {}
        self._prefixes: dict[int, list[tuple[int, ...]]] = {}
        self.last_metrics = RequestMetrics()
        # Bytes of the device's memory that other work (fine-tuning jobs) holds.
        self.lent: Callable[[], int] = lambda: 0

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, served: ServedModel | None, unavailable: str | None) -> bool:
        """Retire the cancelled, then start the waiting requests, except those that
        can wait for a prefix another sequence is prefilling; whether any waited.
        ``unavailable`` says why the distributed group can't serve, if it can't."""
        self._sweep(served)
        waiting, self.waiting = self.waiting, []
        for i, message in enumerate(waiting):
            if message.stream.cancelled:
                continue
            if self.waiting:
                # One ahead waits for memory: the rest keep their order behind it.
                self.waiting.append(message)
                continue
            prefix, lead = self._plan_sharing(served, message.request, waiting[i + 1 :])
            if prefix is not None:
                self._pending[prefix].append(message)
                continue
            if not self._admit(served, unavailable, message, lead):
                self.waiting.append(message)
        return bool(waiting)

    def reserved_kv_bytes(self, served: ServedModel | None) -> int:
        """The KV the running sequences may come to hold, as the budget counts it."""
        if served is None or served.budget is None:
            return 0
        return served.budget.kv_bytes([seq.reserved for seq in self.running.values()])

    def breakdown(self, served: ServedModel | None) -> dict[str, int]:
        """What Status reports of admission under the memory budget."""
        figures = {
            "requests_waiting": len(self.waiting)
            + sum(map(len, self._pending.values())),
            "kv_live_bytes": served.decoder.kv_nbytes() if served else 0,
            "kv_pool_free_bytes": served.decoder.free_pool_nbytes() if served else 0,
        }
        if served is not None and served.budget is not None:
            figures.update(served.budget.breakdown())
            figures.update(
                budget_kv_bytes=self.reserved_kv_bytes(served),
                budget_prompt_cache_bytes=served.store.cache.nbytes,
                budget_fine_tune_bytes=served.budget.room
                - served.budget.room_beside(self.lent()),
            )
        return figures

    def update(self, served: ServedModel, results: list[StepResult]) -> None:
        """Each sequence's tokens through its reply pipeline to its stream."""
        for result in results:
            seq = self.running.get(result.key)
            if seq is None:
                continue
            if result.error is not None:
                seq.stream.put(result.error)
                self._retire(served, seq, result.state)
                continue
            for snapshot in result.snapshots:
                # The prompt's end: the row leaves the prompt batch next step.
                ending = len(snapshot.tokens) == len(seq.request.prompt) - 1
                self._share(served, snapshot, later=ending)
            seq.proposed += result.proposed
            seq.accepted += result.accepted
            if seq.stream.cancelled:  # during the step
                self._cancel(served, seq, result.state)
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
                self._retire(served, seq, result.state)
                continue
            if seq.reply.finished:
                self._retire(served, seq, result.state)

    def abort(self, reason: str) -> None:
        """End every waiting and running request with ``reason`` (the decoder's
        sequences are the caller's to drop)."""
        waiting = self.waiting + [m for f in self._pending.values() for m in f]
        streams = [m.stream for m in waiting]
        streams += [seq.stream for seq in self.running.values()]
        for stream in streams:
            stream.put(Aborted(reason))
        self.running.clear()
        self.waiting, self._pending, self._prefixes = [], {}, {}

    def _sweep(self, served: ServedModel | None) -> None:
        """Retire the sequences whose handler is gone or whose client stopped reading."""
        for followers in self._pending.values():
            followers[:] = [f for f in followers if not f.stream.cancelled]
        if not self.running:
            return
        limit = served.info.options.max_stream_backlog
        for seq in list(self.running.values()):
            if seq.stream.cancelled:
                self._cancel(served, seq)
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
                self._retire(served, seq)

    def _cancel(
        self, served: ServedModel, seq: Running, state: KVState | None = None
    ) -> None:
        if seq.reply.first_token_at is None:
            logger.info("generation cancelled during prefill")
        else:
            logger.info("generation cancelled after %d tokens", seq.reply.generated)
        self._retire(served, seq, state)

    def _plan_sharing(
        self, served: ServedModel | None, request: GenerationRequest, later: list
    ) -> tuple[tuple[int, ...] | None, int]:
        """A running sequence's prefix to wait for, or else the length of the
        prefix this request shares with those that arrived after it (0: none)."""
        if (
            served is None
            or request.load_id != served.info.load_id
            or not served.info.options.prefix_sharing
            or not served.decoder.capabilities.prefix_snapshots
        ):
            return None, 0
        prompt = request.prompt
        cached = served.store.cached_length(prompt)
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

    def _share(
        self, served: ServedModel, snapshot: KVState, later: bool = False
    ) -> None:
        """A prompt prefix was prefilled: its KV state serves the requests that
        waited for it, and later ones (``later``: its copy settles over the next
        steps, the batch being done with the arrays it is copied from)."""
        prefix = tuple(snapshot.tokens)
        followers = self._pending.pop(prefix, [])
        served.store.keep(snapshot.cache, prefix, max(1, len(followers)), later)
        self._fit_cache(served)
        if followers:
            logger.info(
                "a %d-token prefix was prefilled once for %d more requests",
                len(prefix),
                len(followers),
            )
        self.waiting[:0] = followers

    def _admit(
        self,
        served: ServedModel | None,
        unavailable: str | None,
        message: Submit,
        lead: int,
    ) -> bool:
        """Start a request, or end it with its refusal; False: it waits for memory."""
        request, stream = message.request, message.stream
        refusal = admission_refusal(served, request.load_id, unavailable)
        if refusal is None:
            try:
                if not self._fits(served, request):
                    return False
            except ResourceExhausted as e:
                refusal = e
        if refusal is not None:
            stream.put(refusal)
            return True
        try:
            seq = self._start(served, request, stream, lead)
        except Exception as e:
            logger.exception("could not start a generation")
            stream.put(e)
            return True
        self.running[seq.key] = seq
        logger.info(
            "prompt: %d tokens, %d from the prompt cache",
            len(request.prompt),
            seq.reused,
        )
        return True

    def _fits(self, served: ServedModel, request: GenerationRequest) -> bool:
        """Whether the request's KV fits the memory budget beside the running
        sequences', once the prompt cache gives up what it must; raises when it
        could not fit even alone."""
        budget = served.budget
        if budget is None:
            return True
        tokens = len(request.prompt) + request.max_tokens
        budget.check_alone(tokens)
        lengths = [seq.reserved for seq in self.running.values()]
        need = budget.kv_bytes([*lengths, tokens])
        lent = self.lent()
        room = budget.room_beside(lent)
        if need > room:
            if not self.running:
                # Only the job's end makes room: waiting would spin the engine loop
                # for the whole job.
                raise ResourceExhausted(
                    f"Tokens: the prompt and reply ({tokens} tokens) need {need} "
                    f"bytes of KV cache, and a fine-tuning job holds {lent} bytes of "
                    f"the memory budget, leaving {room}; send fewer tokens or retry "
                    "when the job ends"
                )
            return False
        served.store.shrink(room - need)
        return True

    def _fit_cache(self, served: ServedModel) -> None:
        """What the prompt cache just kept must leave the running sequences room."""
        if served.budget is not None:
            room = served.budget.room_beside(self.lent())
            served.store.shrink(room - self.reserved_kv_bytes(served))

    def _start(
        self,
        served: ServedModel,
        request: GenerationRequest,
        stream: RequestStream,
        lead: int,
    ) -> Running:
        info, decoder = served.info, served.decoder
        capabilities = decoder.capabilities
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
            request, info.tokenizer, info.chat_format, info.token_bytes, grammar
        )
        if request.prompt_file is not None:
            served.store.restore(request.prompt_file.path, request.prompt)
        kv_cache, rest = served.store.fetch(request.prompt, pages=True)
        prompt = request.prompt
        snapshots = set()
        reused = len(prompt) - len(rest)
        if capabilities.prefix_snapshots and info.options.prefix_sharing:
            # The shared prefix for those that arrived with it, and the prompt once
            # prefilled, for those that come while it generates.
            snapshots = {n for n in (lead,) if n > reused}
            if len(rest) > SHARED_PREFIX_MIN_TOKENS:
                snapshots.add(len(prompt) - 1)
        if (
            capabilities.prefix_snapshots
            and info.cache_kinds.snapshots
            and info.options.prompt_snapshots
        ):
            snapshots |= snapshot_boundaries(
                reused, len(prompt), info.options.snapshot_interval
            )
        snapshots = sorted(snapshots)
        # Only processors that depend on nothing but the tokens can run at
        # proposed positions: grammars and extra hooks keep their own state.
        draft_tokens = 0
        if request.grammar is None and not request.processors:
            draft_tokens = request.draft_tokens or info.options.num_draft_tokens
        key = decoder.add(
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
        return Running(
            key,
            request,
            stream,
            reply,
            reused,
            self._free_slot(),
            reserved=len(prompt) + request.max_tokens,
        )

    def _free_slot(self) -> int:
        """The lowest slot number no running sequence holds (as llama.cpp numbers them)."""
        taken = {seq.slot for seq in self.running.values()}
        return next(slot for slot in range(len(taken) + 1) if slot not in taken)

    def _retire(
        self, served: ServedModel, seq: Running, state: KVState | None = None
    ) -> None:
        """Drop a sequence; its KV state goes to the prompt store."""
        kept = served.decoder.remove(seq.key)
        state = state or kept
        del self.running[seq.key]
        for prefix in self._prefixes.pop(seq.key, ()):
            # Prefill ended early: whoever waited for it starts on its own.
            self.waiting[:0] = self._pending.pop(prefix, [])
        if state is not None:
            # Out of the batch: its copy settles over the next steps.
            served.store.keep(state.cache, state.tokens, later=True)
            self._fit_cache(served)
            file = seq.request.prompt_file
            if file is not None and not file.read_only:
                tokens = state.tokens if file.everything else seq.request.prompt
                served.store.write(file.path, state.cache, tokens)
        final = seq.reply.finished
        if final is not None:
            self.last_metrics = make_request_metrics(
                final,
                prefilled=len(seq.request.prompt) - seq.reused,
                slot=seq.slot,
                proposed=seq.proposed,
                accepted=seq.accepted,
            )
