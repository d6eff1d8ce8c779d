"""One forward pass per step over paged KV: decode rows and prompt chunks share it.

Every step flattens its tokens into one axis: first one token for each decoding
sequence, then chunks of the prompts being prefilled, shortest first, within the
step's token budget. Projections and MLPs run once over all of them, so the
weights are read once a step whatever it carries, and attention runs per
sequence over its pages (``caches/paged.py``). A prompt chunk thus costs its own
compute beside the decode rows, and a long prompt advances at close to its pace
alone while the streams keep theirs. A sequence that joins, grows or leaves
writes or frees only its own pages, and its KV state goes to the prompt cache as
its pages, held, not copied; a sequence that starts from such a state shares them.

Steps overlap the host: a step is queued (``mx.async_eval``) from the previous
step's sampled tokens, still lazy, before the host reads those.

With speculation on (``speculate``), a decoding row may carry proposed tokens
after its last one, and the pass samples every position of its segment; the
proposals are kept up to the first the model disagrees with, and the rest of
its KV is written over by the next pass. What a step proposes is planned from
the tokens themselves, so a step that verifies reads the previous one first,
and so does the step after it: each row's acceptance estimate says whether
giving up that overlap pays (``plan_drafts``).
"""

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, TokenBuffer

from mlx_backend.caches.mla import install_mla_ops, is_mla
from mlx_backend.caches.page_tables import PagedStore
from mlx_backend.caches.paged import LayerShape, MissingKeys, Segment, Table
from mlx_backend.caches.paged_attention import install_paged_ops
from mlx_backend.caches.quantized_kv import QuantizedKVCache
from mlx_backend.caches.recurrent import (
    RecurrentLayer,
    RecurrentLayout,
    RecurrentShape,
    State,
    fresh_state,
    install_recurrent_ops,
)
from mlx_backend.decoders.base import (
    Capabilities,
    Decoder,
    KVState,
    NewSequence,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.proposers import DraftProposer, NgramProposer
from mlx_backend.decoders.speculative import (
    FIRST_BACKOFF_TOKENS,
    LEAVE_COST,
    DraftRow,
    plan_drafts,
)
from mlx_backend.decoders.step_budget import (
    KEYS_UNIT,
    NO_STEP_BUDGET,
    PassPacer,
    PassWork,
    StepBudget,
)
from mlx_backend.models.loading import hidden_state_model, output_head
from mlx_backend.sampling import SeededSampler
from mlx_utils import gather_logprobs, make_kv_cache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Row:
    key: int
    sampler: Callable
    processors: list
    logprobs: int | None
    max_tokens: int
    cancelled: Callable[[], bool]
    # Prompt tokens not yet in a pass; the KV pages (a table per group of
    # layers) and the tokens they hold (or a queued pass writes), prompt first.
    prompt: list[int]
    tables: list[Table] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # Tokens sampled for it, those returned, and the processors' view of its
    # tokens.
    sampled: int = 0
    returned: int = 0
    context: TokenBuffer | None = None
    # Prompt lengths whose KV state is handed back once a pass holds them.
    snapshots: list[int] = field(default_factory=list)
    # Speculation: its proposer and estimate, the proposals a step may verify,
    # the tokens penalties look back over, and proposals a queued pass verifies.
    draft: DraftRow | None = None
    draft_tokens: int = 0
    history: int = 0
    unverified: int = 0
    # Each recurrent layer's state after its tokens (lazy while a pass runs);
    # before a pass that verifies, the states it started from; and the tokens
    # before its last that the next pass feeds again (a rejected proposal's
    # state can't be taken back: the state before the pass is, and the kept
    # tokens run again).
    states: list[State] = field(default_factory=list)
    states_before: list[State] = field(default_factory=list)
    before: int = 0
    replay: int = 0

    @property
    def held(self) -> int:
        return len(self.tokens)

    def draft_room(self, unread: int = 0) -> int:
        """Proposals its next pass may verify within its token limit, ``unread``
        of its sampled tokens not yet returned."""
        return max(
            min(self.draft_tokens, self.max_tokens - self.returned - unread - 1), 0
        )


@dataclass(frozen=True)
class _Queued:
    """A step queued on the device: the rows that sampled, the proposals each
    verifies, their tokens and log probabilities (lazy: a row's positions in
    turn), its work (decode rows, and prompt chunks), and whether it was planned
    after the last step was read (its time then counts the host's planning)."""

    rows: tuple[_Row, ...]
    drafts: tuple[tuple[int, ...], ...]
    replays: tuple[int, ...]
    tokens: mx.array
    logprobs: mx.array
    decode_work: PassWork
    chunk_work: PassWork
    read_first: bool = False

    @property
    def verifies(self) -> bool:
        return any(self.drafts)

    def starts(self) -> list[int]:
        """Each row's first position among the sampled tokens."""
        return [first for first, _ in spans(self.drafts)]


def spans(drafts) -> list[tuple[int, int]]:
    """Each sampling row's (first position, positions) among a step's sampled
    tokens: its input's, then one per proposal it verifies."""
    out, at = [], 0
    for draft in drafts:
        out.append((at, 1 + len(draft)))
        at += 1 + len(draft)
    return out


class PagedDecoder(Decoder):
    """Sequences over paged KV, one forward pass per step for all of them."""

    def __init__(
        self,
        model: nn.Module,
        options: LoadOptions,
        shapes: list[LayerShape | RecurrentShape],
        budget: StepBudget = NO_STEP_BUDGET,
    ):
        install_paged_ops()
        self._model = model
        self._body = hidden_state_model(model)
        self._head = output_head(model)
        self._options = options
        self._shapes = shapes
        self.capabilities = Capabilities(
            batching=True, trimmable_cache=True, prefix_snapshots=True
        )
        self.pacer = PassPacer(budget, options.prefill_step_size)
        # Each model layer's place among the paged ones, or among the recurrent.
        self._places = places(shapes)
        self._recurrent = [s for s in shapes if isinstance(s, RecurrentShape)]
        self._kv = PagedStore(paged_shapes(shapes))
        self._rows: dict[int, _Row] = {}
        self._next_key = 0
        self._queued: _Queued | None = None
        self._last_read: float | None = None
        # Snapshots taken while planning a step, to report with its results.
        self._snapshots: dict[int, list[KVState]] = {}
        # Speculation (``speculate``): each row's proposer, and what a pass
        # over n tokens and a proposal cost, in single-token passes.
        self._make_proposer: Callable[[], NgramProposer | DraftProposer] | None = None
        self.costs: tuple[float, ...] = ()
        self.per_proposal = 0.0

    def speculate(
        self,
        make_proposer: Callable[[], NgramProposer | DraftProposer],
        costs: tuple[float, ...],
        per_proposal: float = 0.0,
    ) -> None:
        """Let decoding rows verify proposals: ``make_proposer`` makes each
        sequence's proposer; ``costs`` and ``per_proposal`` are what
        ``measure_verify_costs`` measured."""
        self._make_proposer = make_proposer
        self.costs, self.per_proposal = costs, per_proposal
        self.speculates = True

    # -- the contract --------------------------------------------------------

    def add(self, sequence: NewSequence) -> int:
        key = self._next_key
        self._next_key += 1
        reused = len(sequence.prompt) - len(sequence.rest)
        rest = sequence.rest
        tables = self._kv.tables()
        if reused:
            paged = [
                c
                for c, s in zip(sequence.kv_cache, self._shapes)
                if isinstance(s, LayerShape)
            ]
            try:
                # On the steps' stream: the writes and copies keep the steps' order.
                with mx.stream(thread_stream()):
                    tables = self._kv.take(paged, reused)
            except MissingKeys as e:
                logger.info("a cached state can't be loaded (%s): prefilled", e)
                reused, rest = 0, sequence.prompt
        row = _Row(
            key,
            sequence.sampler,
            list(sequence.processors),
            sequence.logprobs,
            sequence.max_tokens,
            sequence.cancelled,
            prompt=list(rest),
            tables=tables,
            snapshots=sorted(n for n in set(sequence.snapshots) if n > reused),
            states=[fresh_state(s.size) for s in self._recurrent],
        )
        if row.processors:
            # Penalties look back over the prompt, cached part included.
            row.context = TokenBuffer(list(sequence.prompt))
        if self._make_proposer is not None and sequence.draft_tokens > 0:
            row.draft = DraftRow(self._make_proposer())
            row.draft_tokens, row.history = sequence.draft_tokens, sequence.history
        if reused:
            # A recurrent layer's state is its whole (the prompt cache reuses
            # such a state only where it ends).
            row.states = [
                tuple(c.cache)
                for c, s in zip(sequence.kv_cache, self._shapes)
                if isinstance(s, RecurrentShape)
            ]
            row.tokens = list(sequence.prompt[:reused])
        self._rows[key] = row
        return key

    def step(self) -> list[StepResult]:
        try:
            if self._queued is not None and (
                self._queued.verifies or self._drafts_pay()
            ):
                results = self._read(self._queued)
                queued = self._queue_step(read=True)
            else:
                queued = self._queue_step()
                results = self._read(self._queued)
        except Exception as e:
            logger.exception("paged generation failed")
            error = e.with_traceback(None)
            failed = [
                StepResult(key, done=True, error=copy.copy(error)) for key in self._rows
            ]
            self.reset()
            return failed
        self._queued = queued
        if self._snapshots:
            results = self._with_snapshots(results)
        return results

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        row = self._rows.pop(key, None)
        if row is None:
            return None
        self._snapshots.pop(key, None)
        state = None
        # A queued pass's proposals are not the sequence's (yet), nor are the
        # tokens its recurrent states have to run again; a pass that verifies
        # leaves its recurrent states past its proposals: the state before it.
        held, states = row.held - row.unverified - row.replay, row.states
        if self._recurrent and row.unverified:
            held, states = row.before, row.states_before
        if keep_state and held:
            state = self._kept(row, held, states)
        self._kv.release(row.tables)
        return state

    def _kept(
        self, row: _Row, length: int, states: list[State] | None = None
    ) -> KVState:
        """``row``'s first ``length`` tokens as a KV state: its pages held, its
        recurrent layers' ``states`` (by default its own, which are at its last
        token) as mlx-lm's, copied out of the step's batch."""
        pages = self._kv.prefix(row.tables, length)
        layers = []
        for paged, place in self._places:
            if paged:
                layers.append(pages[place])
                continue
            cache = ArraysCache(self._recurrent[place].size)
            # A row's state may be a view of the step's batch: a copy of its own.
            cache.cache = [
                None if a is None else mx.take(a, mx.array([0]), axis=0)
                for a in (states or row.states)[place]
            ]
            layers.append(cache)
        return KVState(layers, row.tokens[:length])

    def kv_nbytes(self) -> int:
        # The sequences' own pages: those only kept states hold are the prompt
        # cache's bytes.
        pages = self._kv.held_nbytes([row.tables for row in self._rows.values()])
        states = sum(s.nbytes for s in self._recurrent) * len(self._rows)
        return pages + states

    def pages_nbytes(self) -> int:
        """Bytes of every page held: its sequences' and their kept states'."""
        return self._kv.nbytes()

    def free_pool_nbytes(self) -> int:
        # The arenas' pages nothing holds: a new arena is about ARENA_BYTES.
        return self._kv.free_nbytes()

    @property
    def step_token_budget(self) -> int:
        return self.pacer.tokens

    def reset(self) -> None:
        self._rows.clear()
        self._snapshots.clear()
        self._queued = None
        self._last_read = None
        # A failed step's writes may be in its arenas: its kept states go unused.
        self._kv.closed = True
        self._kv = PagedStore(paged_shapes(self._shapes))

    # -- a step ----------------------------------------------------------------

    def _queue_step(self, read: bool = False) -> _Queued | None:
        """Plan, build and queue this step's pass; None when no row samples.
        ``read``: the previous step's tokens are read, so decoding rows feed
        them from the host and may verify proposals after them."""
        queued = self._queued
        last = {}
        if queued is not None:
            last = {r.key: s for r, s in zip(queued.rows, queued.starts())}
        decoding = [
            r
            for r in self._rows.values()
            if not r.prompt and r.sampled < r.max_tokens and r.key in last
        ]
        prompts = sorted(
            (r for r in self._rows.values() if r.prompt and not r.cancelled()),
            key=lambda r: len(r.prompt),
        )
        prompts = prompts[: max(self._options.max_batch_size - len(decoding), 0)]
        if not decoding and not prompts:
            return None
        drafts = self._drafts(decoding) if read else [()] * len(decoding)
        # Tokens each row feeds again before its last (a step that verified
        # reads first: only then are there any).
        replays = [row.replay for row in decoding]
        segments, inputs, chunk, ends = [], [], [], []
        for row, draft, again in zip(decoding, drafts, replays):
            # Its input is the token the last step sampled (still lazy unless
            # ``read``), then its proposals.
            start = segments[-1].start + segments[-1].tokens if segments else 0
            context = row.held + len(draft) + (not read)
            count = again + 1 + len(draft)
            segments.append(self._extend(row, start, count, context))
            ends += range(start + again, start + count)
            row.tokens += draft
            row.unverified = len(draft)
            row.sampled += 1 + len(draft)
            row.replay = 0
            if draft and self._recurrent:
                row.states_before = list(row.states)
                row.before = row.held - len(draft) - 1 - again
        if read and decoding:
            ids = [
                t
                for row, draft, again in zip(decoding, drafts, replays)
                for t in row.tokens[len(row.tokens) - len(draft) - 1 - again :]
            ]
            inputs.append(mx.array(ids, dtype=mx.uint32))
        elif decoding:
            picks = mx.array([last[r.key] for r in decoding], dtype=mx.int32)
            inputs.append(queued.tokens[picks].astype(mx.uint32))
        rows = self._work(segments)
        sizes = self.pacer.chunks(
            rows, [(r.held, self._chunk_room(r)) for r in prompts], read
        )
        # The rows that sample this step: decoding ones, then prompts' last chunks.
        sampling = list(decoding)
        decoded = rows.tokens
        # The rows that prefill a chunk, and the prompt lengths to snapshot.
        chunked, snapshots = [], []
        for row, size in zip(prompts, sizes):
            if not size:
                break
            part = row.prompt[:size]
            start = decoded + len(chunk)
            segments.append(self._extend(row, start, len(part), row.held + len(part)))
            chunked.append(row)
            chunk += part
            row.tokens += part
            del row.prompt[: len(part)]
            while row.snapshots and row.snapshots[0] <= row.held:
                snapshots.append((row, row.snapshots.pop(0)))
            if not row.prompt:
                sampling.append(row)
                drafts.append(())
                ends.append(start + len(part) - 1)
                row.sampled += 1
        if chunk:
            inputs.append(mx.array(chunk, dtype=mx.uint32))
        tokens = inputs[0] if len(inputs) == 1 else mx.concatenate(inputs)
        layout = self._kv.layout(segments)
        # Another load in this process may have routed ``mx.fast`` since.
        install_paged_ops()
        with mx.stream(thread_stream()):
            views = self._views(layout, segments, decoding, chunked)
            if not sampling:
                # Prompt chunks alone: their KV is the step's whole result.
                (self._body or self._model)(tokens[None], cache=views)
                states = self._took_states(views, decoding + chunked)
                self._take_snapshots(snapshots)
                mx.async_eval(self._kv.planes, states)
                return None
            logits = self._forward(tokens, views, mx.array(ends, dtype=mx.int32))
            states = self._took_states(views, decoding + chunked)
            self._take_snapshots(snapshots)
            starts = [s.start + n for s, n in zip(segments, replays)]
            sampled, logprobs, contexts = self._sample(
                logits, sampling, drafts, tokens, starts
            )
            mx.async_eval(sampled, logprobs, contexts, states)
        return _Queued(
            tuple(sampling),
            tuple(tuple(d) for d in drafts),
            tuple(replays) + (0,) * (len(sampling) - len(decoding)),
            sampled,
            logprobs,
            rows,
            self._work(segments[len(decoding) :]),
            read_first=read,
        )

    def _chunk_room(self, row: _Row) -> int:
        """The most tokens ``row``'s next chunk may take: the rest of its
        prompt, up to its next snapshot where it has recurrent layers (their
        state exists only where a chunk ends)."""
        if self._recurrent and row.snapshots:
            return min(len(row.prompt), row.snapshots[0] - row.held)
        return len(row.prompt)

    def _views(self, layout, segments, decoding, chunked) -> list:
        """Each layer's cache for the step: its pages, or the recurrent states
        of its segments (the decoding rows', then the chunks')."""
        runs = RecurrentLayout(
            tuple(s.tokens for s in segments[: len(decoding)]),
            tuple((s.start, s.tokens) for s in segments[len(decoding) :]),
        )
        rows = decoding + chunked
        states = [[r.states[i] for r in rows] for i in range(len(self._recurrent))]
        return layer_views(self._kv, self._shapes, layout, runs, states)

    def _took_states(self, views: list, rows: list[_Row]) -> list[mx.array]:
        """The rows' recurrent states after the step's pass (lazy: queued with
        it, so that no state's graph outlives its step)."""
        arrays = []
        for view, (_, place) in zip(views, self._places):
            if isinstance(view, RecurrentLayer):
                for row, state in zip(rows, view.new_states):
                    row.states[place] = state
                    arrays += [a for a in state if a is not None]
        return arrays

    def _take_snapshots(self, snapshots: list[tuple[_Row, int]]) -> None:
        """Kept states of prompts' first tokens, reported with the step's results."""
        for row, n in snapshots:
            self._snapshots.setdefault(row.key, []).append(self._kept(row, n))

    def _drafts(self, decoding: list[_Row]) -> list[list[int]]:
        """The proposals each decoding row verifies this step (most empty)."""
        available, proposals = [], {}
        for i, row in enumerate(decoding):
            limit = self._draft_limit(row)
            if limit and row.draft.proposer.cheap:
                proposals[i] = row.draft.proposer.propose(row.tokens, limit)
                limit = len(proposals[i])
            available.append(limit)
        if not any(available):
            return [[] for _ in decoding]
        rates = [r.draft.acceptance if r.draft else 0.0 for r in decoding]
        plan = plan_drafts(rates, available, self.costs, self.per_proposal)
        drafts = []
        for i, (row, k) in enumerate(zip(decoding, plan)):
            if k and i not in proposals:
                proposals[i] = row.draft.proposer.propose(row.tokens, k)
            drafts.append(proposals[i][:k] if k else [])
            if k:
                # Its verification scores these proposals, not the last guess.
                row.draft.guess = None
        return drafts

    def _draft_limit(self, row: _Row, unread: int = 0) -> int:
        """The proposals ``row`` may verify in its next pass, ``unread`` of its
        tokens not yet read: none while it backs off, none past its token limit,
        and none while a draft model still catches up on its prompt (a chunk a
        step)."""
        if row.draft is None or row.returned < row.draft.backoff_until:
            return 0
        if row.replay > row.draft_tokens:
            # Its recurrent states wait for more kept tokens than a pass
            # proposes: those run alone first (each rejection adds to them).
            return 0
        limit = row.draft_room(unread)
        if not limit or not row.draft.proposer.catch_up(row.tokens):
            return 0
        return limit

    def _drafts_pay(self) -> bool:
        """Whether the next step should read the queued one first to verify
        proposals: a cheap proposer has a guess for the token it samples, and the
        estimates say verifying pays for the overlap lost."""
        if self._make_proposer is None:
            return False
        rows = [
            r
            for r in self._queued.rows
            if self._rows.get(r.key) is r and r.sampled < r.max_tokens
        ]
        # Their tokens in flight are not read yet.
        available = [
            (
                self._draft_limit(r, unread=1)
                if r.draft is not None
                and (r.draft.guess is not None or not r.draft.proposer.cheap)
                else 0
            )
            for r in rows
        ]
        if not any(available):
            return False
        rates = [r.draft.acceptance if r.draft else 0.0 for r in rows]
        # An estimate that guesses just raised is likelier high than the next
        # proposals are to hold: going over asks a token more, as leaving the
        # batch does. A costly proposer's is the last verifications'.
        cheap = all(r.draft.proposer.cheap for r, n in zip(rows, available) if n)
        least = LEAVE_COST if cheap else 0.0
        return any(plan_drafts(rates, available, self.costs, self.per_proposal, least))

    @staticmethod
    def _work(segments: list[Segment]) -> PassWork:
        """The work of ``segments``: tokens, keys they read and keys held."""
        keys = sum(
            s.tokens * s.context - s.tokens * (s.tokens - 1) / 2 for s in segments
        )
        held = sum(s.context for s in segments)
        return PassWork(
            sum(s.tokens for s in segments), keys / KEYS_UNIT, held / KEYS_UNIT
        )

    def _extend(self, row: _Row, start: int, count: int, context: int) -> Segment:
        """Pages for ``row``'s KV to hold ``context`` tokens; its segment of
        ``count`` tokens from ``start`` on the step's axis."""
        pages = self._kv.extend(row.tables, context, first=context - count)
        return Segment(start, count, context, pages)

    def _forward(self, tokens: mx.array, views: list, ends: mx.array) -> mx.array:
        """The logits at ``ends`` on the step's token axis: through the output
        layer alone where it gives the model's logits."""
        if self._head is not None:
            hidden = self._body(tokens[None], cache=views)
            return self._head(hidden[:, ends])[0]
        return self._model(tokens[None], cache=views)[0, ends]

    def _sample(self, logits, rows, drafts, tokens, starts):
        """Each row's processors and sampler over its logits (a decoding row's:
        at its input and at each proposal; ``starts``: the decoding rows' inputs
        on the step's axis): the sampled tokens, log probabilities, and the
        processors' contexts (to evaluate)."""
        contexts, positions = [], spans(drafts)
        if any(r.processors for r in rows):
            processed = []
            for i, (row, draft, (first, count)) in enumerate(
                zip(rows, drafts, positions)
            ):
                if not row.processors:
                    processed.append(logits[first : first + count])
                    continue
                if i < len(starts):
                    fed = tokens[starts[i] : starts[i] + 1]
                    context = row.context.update_and_fetch(fed)
                    contexts.append(context)
                else:
                    context = row.context.tokens
                for n in range(count):
                    # A proposal's position sees the proposals before it.
                    seen = context
                    if n:
                        tail = mx.array(draft[:n], dtype=context.dtype)
                        seen = mx.concatenate([context[-row.history :], tail])
                    position = logits[first + n : first + n + 1]
                    for processor in row.processors:
                        position = processor(seen, position)
                    processed.append(position)
            logits = mx.concatenate(processed, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = mx.concatenate(
            [row.sampler(logprobs[f : f + n]) for row, (f, n) in zip(rows, positions)]
        )
        return sampled, logprobs, contexts

    def _with_snapshots(self, results: list[StepResult]) -> list[StepResult]:
        """The snapshots this step's pass holds, on their rows' results (a row
        still in prefill gets a result of its own)."""
        taken, self._snapshots = self._snapshots, {}
        results = [
            replace(r, snapshots=tuple(taken.pop(r.key, ()))) if r.key in taken else r
            for r in results
        ]
        return results + [StepResult(k, snapshots=tuple(s)) for k, s in taken.items()]

    def _read(self, queued: _Queued | None) -> list[StepResult]:
        """The previous step's tokens, now that this one is queued."""
        results = [
            StepResult(r.key, done=True)
            for r in self._rows.values()
            if r.prompt and r.cancelled()
        ]
        if queued is None:
            self._last_read = None
            return results
        tokens = queued.tokens.tolist()
        now = time.perf_counter()
        if self._last_read is not None:
            self.pacer.observe(
                now - self._last_read,
                queued.decode_work,
                queued.chunk_work,
                queued.read_first,
            )
        self._last_read = now
        made = {}
        for row, draft, again, start in zip(
            queued.rows, queued.drafts, queued.replays, queued.starts()
        ):
            if self._rows.get(row.key) is not row:
                continue
            out = tokens[start : start + 1 + len(draft)]
            kept = next(
                (i for i, (t, d) in enumerate(zip(out, draft)) if t != d), len(draft)
            )
            made[row.key] = (range(start, start + kept + 1), out[: kept + 1])
            if draft:
                self._verified(row, draft, kept, again)
        wanted = [r for r in queued.rows if r.key in made and r.logprobs is not None]
        scored = {}
        if wanted:
            top = max(r.logprobs for r in wanted)
            positions = [p for r in wanted for p in made[r.key][0]]
            values = iter(
                gather_logprobs(
                    [queued.logprobs[p] for p in positions],
                    [t for r in wanted for t in made[r.key][1]],
                    top,
                )
            )
            for row in wanted:
                scored[row.key] = [
                    (value, best[: row.logprobs])
                    # The row's tokens first: zip stops there, taking no more.
                    for _, (value, best) in zip(made[row.key][1], values)
                ]
        if made:
            self.batch_steps += 1
            self.batch_tokens += sum(len(m[1]) for m in made.values())
        for row, draft in zip(queued.rows, queued.drafts):
            if row.key not in made:
                continue
            new = made[row.key][1]
            row.returned += len(new)
            done = row.returned >= row.max_tokens
            results.append(
                StepResult(
                    row.key,
                    tuple(new),
                    tuple(scored.get(row.key, [None] * len(new))),
                    done=done,
                    proposed=len(draft),
                    accepted=len(new) - 1,
                )
            )
            if done:
                continue
            # The next pass feeds it, and its KV holds it then.
            row.tokens.append(new[-1])
            if row.draft is not None and row.draft.proposer.cheap and not draft:
                row.draft.check_guess(row.tokens, tuple(new))
        return results

    def _verified(
        self, row: _Row, draft: tuple[int, ...], kept: int, again: int
    ) -> None:
        """``row``'s pass kept ``kept`` of its ``draft`` (after feeding ``again``
        tokens again): the rest leave its tokens (their KV is written over), its
        recurrent states go back to before the pass, whose kept tokens the next
        one feeds again, its sampler draws the next position again, and the
        estimate learns."""
        del row.tokens[len(row.tokens) - len(draft) + kept :]
        row.unverified = 0
        if self._recurrent and kept < len(draft):
            row.states = row.states_before
            row.replay = again + 1 + kept
        row.states_before = []
        row.sampled = row.returned + kept + 1
        if row.context is not None and kept:
            row.context.update_and_fetch(mx.array(draft[:kept], dtype=mx.int32))
        if isinstance(row.sampler, SeededSampler):
            row.sampler.position = row.sampled
        proposer = row.draft.proposer
        proposer.rewind(kept, len(draft))
        row.draft.observe(len(draft), kept)
        self.draft_proposed += len(draft)
        self.draft_accepted += kept
        if kept:
            row.draft.backoff = FIRST_BACKOFF_TOKENS
        elif not proposer.cheap and not any(
            plan_drafts(
                [row.draft.acceptance],
                # Its returned count takes this pass's tokens after this.
                [row.draft_room(unread=kept + 1)],
                self.costs,
                self.per_proposal,
            )
        ):
            # Nothing checks a costly proposer's guesses between verifications.
            row.draft.back_off(row.sampled)


# A probe's prompt: a chunk that splits, then a decode token.
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7)


class NotPaged(Exception):
    """The model can't run on the paged pass; the message says why."""


def layer_shape(
    cache, page_dtype: mx.Dtype | None, module: nn.Module | None = None
) -> LayerShape:
    """The pages' shape for a layer of mlx-lm's cache that has run a token
    (``module``: the attention that runs over it)."""
    if module is not None and is_mla(module):
        # Keys the latent and the rotary key side by side, values the latent.
        latent, rotary = cache.keys.shape[3], cache.values.shape[3]
        return LayerShape(
            1, latent + rotary, latent, cache.keys.dtype, page_dtype, latent=latent
        )
    if isinstance(cache, QuantizedKVCache):
        codes, scales, _ = cache.keys
        return LayerShape(
            codes.shape[1],
            codes.shape[3] * 32 // cache.bits,
            cache.values[0].shape[3] * 32 // cache.bits,
            scales.dtype,
            bits=cache.bits,
            group_size=cache.group_size,
        )
    return LayerShape(
        cache.keys.shape[1],
        cache.keys.shape[3],
        cache.values.shape[3],
        cache.keys.dtype,
        page_dtype,
        window=cache.max_size if isinstance(cache, RotatingKVCache) else 0,
    )


def places(shapes) -> list[tuple[bool, int]]:
    """Each model layer's place: (True, its index among the paged layers) or
    (False, its index among the recurrent ones)."""
    out, counts = [], [0, 0]
    for shape in shapes:
        paged = isinstance(shape, LayerShape)
        out.append((paged, counts[paged]))
        counts[paged] += 1
    return out


def layer_views(kv: PagedStore, shapes, layouts, runs: RecurrentLayout, states) -> list:
    """Each layer's cache for a pass: its pages (``layouts``: the pass's, per
    group), or, a recurrent layer, its run of ``runs`` from ``states`` (per
    recurrent layer, each segment's)."""
    return [
        (
            kv.layer(place, layouts)
            if paged
            else RecurrentLayer(runs, states[place], shape.size)
        )
        for (paged, place), shape in zip(places(shapes), shapes)
    ]


def paged_shapes(shapes) -> list[LayerShape]:
    return [s for s in shapes if isinstance(s, LayerShape)]


def paged_layers(
    model: nn.Module, options: LoadOptions
) -> list[LayerShape | RecurrentShape]:
    """Each layer's KV rows (or a recurrent layer's state), once a probe found
    that a pass over pages gives mlx-lm's logits (a prompt chunk, then a decode
    token); raises ``NotPaged`` with the reason otherwise."""
    if options.max_kv_size is not None:
        raise NotPaged("max_kv_size keeps only a sequence's last tokens")
    if options.kv_bits is not None and options.quantized_kv_start:
        raise NotPaged(
            "quantized_kv_start keeps a sequence's first tokens unquantized, and "
            "pages are quantized from the first"
        )
    cache = make_kv_cache(model, options)
    # A model's sliding windows (rotating layers that keep no first tokens) run
    # on pages, the window as attention's mask (make_mask); quantized layers
    # (kv_bits) on quantized pages; recurrent layers (linear attention, Mamba,
    # short convolutions) from each sequence's state.
    others = sorted(
        {
            type(c).__name__
            for c in cache
            if type(c) not in (KVCache, QuantizedKVCache, ArraysCache)
            and not (type(c) is RotatingKVCache and c.keep == 0)
        }
    )
    if others:
        raise NotPaged(f"its KV cache has {', '.join(others)} layers")
    tokens = mx.array(PROBE_TOKENS, dtype=mx.uint32)
    n = len(PROBE_TOKENS)
    modules = cache_modules(model, make_kv_cache(model, options), tokens[None, :1])
    missing = [i for i in range(len(cache)) if i not in modules]
    if missing:
        raise NotPaged(f"no one module runs its cache's layer {missing[0]}")
    want = [
        model(tokens[None, : n - 1], cache=cache)[0, -1],
        model(tokens[None, n - 1 :], cache=cache)[0, -1],
    ]
    mx.eval(want, [c.state for c in cache])
    # kv_dtype, else the float type CacheTypeKey/Value name, else the model's.
    wanted = options.kv_dtype if options.kv_dtype != "auto" else options.cache_float
    page_dtype = getattr(mx, wanted) if wanted else None
    shapes = [
        (
            RecurrentShape(len(c.cache), _state_nbytes(c))
            if isinstance(c, ArraysCache)
            else layer_shape(c, page_dtype, modules[i])
        )
        for i, c in enumerate(cache)
    ]
    install_paged_ops()
    install_recurrent_ops(
        {type(m) for i, m in modules.items() if isinstance(cache[i], ArraysCache)}
    )
    install_mla_ops({type(m) for m in modules.values() if is_mla(m)})
    kv = PagedStore(paged_shapes(shapes), arena_pages=1)
    pages = kv.extend(kv.tables(), n, 0)
    states = [fresh_state(s.size) for s in shapes if isinstance(s, RecurrentShape)]
    try:
        got = []
        for segment, part, runs in (
            (
                Segment(0, n - 1, n - 1, pages),
                tokens[: n - 1],
                RecurrentLayout((), ((0, n - 1),)),
            ),
            (Segment(0, 1, n, pages), tokens[n - 1 :], RecurrentLayout((1,), ())),
        ):
            layout = kv.layout([segment])
            views = layer_views(kv, shapes, layout, runs, [[s] for s in states])
            got.append(model(part[None], cache=views)[0, -1])
            states = [v.new_states[0] for v in views if isinstance(v, RecurrentLayer)]
            mx.eval(got, states)
    except Exception as e:
        raise NotPaged(f"its attention fails over pages ({type(e).__name__})")
    for mine, theirs in zip(got, want):
        mine, theirs = mine.astype(mx.float32), theirs.astype(mx.float32)
        # Narrower pages round the KV: within 1% of the logits' range then (the
        # embedded model's float16 pages: 0.13 at 33).
        atol = 1e-2
        narrower = any(
            page_dtype is not None and page_dtype.size < s.dtype.size
            for s in paged_shapes(shapes)
        )
        if narrower or options.kv_bits is not None:
            atol *= max(mx.max(mx.abs(theirs)).item(), 1.0)
        if not mx.allclose(mine, theirs, rtol=1e-2, atol=atol).item():
            raise NotPaged("a pass over pages does not give the model's logits")
    return shapes


def cache_modules(model: nn.Module, cache: list, tokens: mx.array) -> dict:
    """For each layer of mlx-lm's ``cache``, the module that runs over it: the
    innermost whose call takes that layer, found by running ``tokens``."""
    layers = {id(c): i for i, c in enumerate(cache)}
    # The classes that define a call (a subclass runs its parent's).
    classes = {
        cls
        for _, m in model.named_modules()
        for cls in type(m).__mro__
        if "__call__" in cls.__dict__ and issubclass(cls, nn.Module)
    }
    found = {}

    def recorder(cls, call):
        def record(self, *args, **kwargs):
            for a in (*args, *kwargs.values()):
                if id(a) in layers:
                    # Outer calls record first: the innermost is written last.
                    found[layers[id(a)]] = self
            return call(self, *args, **kwargs)

        return record

    saved = {cls: cls.__dict__["__call__"] for cls in classes}
    for cls, call in saved.items():
        cls.__call__ = recorder(cls, call)
    try:
        mx.eval(model(tokens, cache=cache))
    finally:
        for cls, call in saved.items():
            cls.__call__ = call
    return found


def _state_nbytes(cache: ArraysCache) -> int:
    return sum(a.nbytes for a in cache.cache if a is not None)
