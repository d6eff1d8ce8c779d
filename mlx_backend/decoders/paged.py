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
"""

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, TokenBuffer

from mlx_backend.caches.paged import (
    LayerShape,
    PagedKV,
    PagedLayer,
    Segment,
    pages_for,
)
from mlx_backend.caches.paged_attention import install_paged_ops
from mlx_backend.decoders.base import (
    Capabilities,
    Decoder,
    KVState,
    NewSequence,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.step_budget import (
    KEYS_UNIT,
    NO_STEP_BUDGET,
    PassPacer,
    PassWork,
    StepBudget,
)
from mlx_backend.models.loading import hidden_state_model, output_head
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
    # Prompt tokens not yet in a pass; the KV pages and the tokens they hold
    # (or a queued pass writes), prompt first.
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # Tokens sampled for it, those returned, and the processors' view of its
    # tokens.
    sampled: int = 0
    returned: int = 0
    context: TokenBuffer | None = None
    # Prompt lengths whose KV state is handed back once a pass holds them.
    snapshots: list[int] = field(default_factory=list)

    @property
    def held(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class _Queued:
    """A step queued on the device: the rows that sampled, their tokens and
    log probabilities (lazy), and its work: decode rows, and prompt chunks."""

    rows: tuple[_Row, ...]
    tokens: mx.array
    logprobs: mx.array
    decode_work: PassWork
    chunk_work: PassWork


class PagedDecoder(Decoder):
    """Sequences over paged KV, one forward pass per step for all of them."""

    def __init__(
        self,
        model: nn.Module,
        options: LoadOptions,
        shapes: list[LayerShape],
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
        self._kv = PagedKV(shapes)
        self._rows: dict[int, _Row] = {}
        self._next_key = 0
        self._queued: _Queued | None = None
        self._last_read: float | None = None
        # Snapshots taken while planning a step, to report with its results.
        self._snapshots: dict[int, list[KVState]] = {}

    # -- the contract --------------------------------------------------------

    def add(self, sequence: NewSequence) -> int:
        key = self._next_key
        self._next_key += 1
        reused = len(sequence.prompt) - len(sequence.rest)
        row = _Row(
            key,
            sequence.sampler,
            list(sequence.processors),
            sequence.logprobs,
            sequence.max_tokens,
            sequence.cancelled,
            prompt=list(sequence.rest),
            snapshots=sorted(n for n in set(sequence.snapshots) if n > reused),
        )
        if row.processors:
            # Penalties look back over the prompt, cached part included.
            row.context = TokenBuffer(list(sequence.prompt))
        if reused:
            # On the steps' stream: the writes and copies keep the steps' order.
            with mx.stream(thread_stream()):
                row.pages = self._kv.take(sequence.kv_cache, reused)
            row.tokens = list(sequence.prompt[:reused])
        self._rows[key] = row
        return key

    def step(self) -> list[StepResult]:
        try:
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
        if keep_state and row.held:
            state = KVState(self._kv.prefix(row.pages, row.held), list(row.tokens))
        self._kv.release(row.pages)
        return state

    def kv_nbytes(self) -> int:
        # The sequences' own pages: those only kept states hold are the prompt
        # cache's bytes.
        pages = {page for row in self._rows.values() for page in row.pages}
        return len(pages) * self._kv.page_nbytes

    def pages_nbytes(self) -> int:
        """Bytes of every page held: its sequences' and their kept states'."""
        return self._kv.nbytes()

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
        self._kv = PagedKV(self._shapes)

    # -- a step ----------------------------------------------------------------

    def _queue_step(self) -> _Queued | None:
        """Plan, build and queue this step's pass; None when no row samples."""
        queued = self._queued
        last = {} if queued is None else {r.key: i for i, r in enumerate(queued.rows)}
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
        keys = sum(r.held + 1 for r in decoding) / KEYS_UNIT
        rows = PassWork(len(decoding), keys, keys)
        sizes = self.pacer.chunks(rows, [(r.held, len(r.prompt)) for r in prompts])
        segments, inputs, chunk = [], [], []
        # The rows that sample this step, and their last token on the axis.
        sampling, ends = list(decoding), list(range(len(decoding)))
        for i, row in enumerate(decoding):
            # Its input is the token the last step sampled, not yet read.
            segments.append(self._extend(row, i, 1, row.held + 1))
        if decoding:
            picks = mx.array([last[r.key] for r in decoding], dtype=mx.int32)
            inputs.append(queued.tokens[picks].astype(mx.uint32))
        for row, size in zip(prompts, sizes):
            if not size:
                break
            part = row.prompt[:size]
            start = len(decoding) + len(chunk)
            segments.append(self._extend(row, start, len(part), row.held + len(part)))
            chunk += part
            row.tokens += part
            del row.prompt[: len(part)]
            while row.snapshots and row.snapshots[0] <= row.held:
                n = row.snapshots.pop(0)
                state = KVState(self._kv.prefix(row.pages, n), row.tokens[:n])
                self._snapshots.setdefault(row.key, []).append(state)
            if not row.prompt:
                sampling.append(row)
                ends.append(start + len(part) - 1)
        if chunk:
            inputs.append(mx.array(chunk, dtype=mx.uint32))
        tokens = inputs[0] if len(inputs) == 1 else mx.concatenate(inputs)
        layout = self._kv.layout(segments)
        with mx.stream(thread_stream()):
            views = [PagedLayer(self._kv, i, layout) for i in range(len(self._shapes))]
            if not sampling:
                # Prompt chunks alone: their KV is the step's whole result.
                (self._body or self._model)(tokens[None], cache=views)
                mx.async_eval(self._kv.keys, self._kv.values)
                return None
            logits = self._forward(tokens, views, mx.array(ends, dtype=mx.int32))
            sampled, logprobs, contexts = self._sample(
                logits, sampling, tokens, len(decoding)
            )
            mx.async_eval(sampled, logprobs, contexts)
        for row in sampling:
            row.sampled += 1
        chunks = segments[len(decoding) :]
        keys = sum(s.tokens * s.context - s.tokens * (s.tokens - 1) / 2 for s in chunks)
        held = sum(s.context for s in chunks)
        return _Queued(
            tuple(sampling),
            sampled,
            logprobs,
            rows,
            PassWork(len(chunk), keys / KEYS_UNIT, held / KEYS_UNIT),
        )

    def _extend(self, row: _Row, start: int, count: int, context: int) -> Segment:
        """Pages for ``row``'s KV to hold ``context`` tokens; its segment of
        ``count`` tokens from ``start`` on the step's axis."""
        more = pages_for(context) - len(row.pages)
        if more > 0:
            row.pages += self._kv.allocate(more)
        return Segment(start, count, context, tuple(row.pages))

    def _forward(self, tokens: mx.array, views: list, ends: mx.array) -> mx.array:
        """The logits at ``ends`` on the step's token axis: through the output
        layer alone where it gives the model's logits."""
        if self._head is not None:
            hidden = self._body(tokens[None], cache=views)
            return self._head(hidden[:, ends])[0]
        return self._model(tokens[None], cache=views)[0, ends]

    def _sample(self, logits, rows, tokens, decoding):
        """Each row's processors and sampler over its logits: the sampled tokens,
        log probabilities, and the processors' contexts (to evaluate)."""
        contexts = []
        if any(r.processors for r in rows):
            processed = []
            for i, row in enumerate(rows):
                row_logits = logits[i : i + 1]
                if row.processors:
                    if i < decoding:
                        context = row.context.update_and_fetch(tokens[i : i + 1])
                        contexts.append(context)
                    else:
                        context = row.context.tokens
                    for processor in row.processors:
                        row_logits = processor(context, row_logits)
                processed.append(row_logits)
            logits = mx.concatenate(processed, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = mx.concatenate(
            [row.sampler(logprobs[i : i + 1]) for i, row in enumerate(rows)]
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
                now - self._last_read, queued.decode_work, queued.chunk_work
            )
        self._last_read = now
        live = [(i, r) for i, r in enumerate(queued.rows) if self._rows.get(r.key) is r]
        wanted = [(i, r) for i, r in live if r.logprobs is not None]
        scored = {}
        if wanted:
            top = max(r.logprobs for _, r in wanted)
            values = gather_logprobs(
                [queued.logprobs[i] for i, _ in wanted],
                [tokens[i] for i, _ in wanted],
                top,
            )
            scored = {
                r.key: (value, best[: r.logprobs])
                for (_, r), (value, best) in zip(wanted, values)
            }
        if live:
            self.batch_steps += 1
            self.batch_tokens += len(live)
        for i, row in live:
            row.returned += 1
            done = row.returned >= row.max_tokens
            results.append(
                StepResult(row.key, (tokens[i],), (scored.get(row.key),), done=done)
            )
            if not done:
                # The next pass feeds it, and its KV holds it then.
                row.tokens.append(tokens[i])
        return results


# A probe's prompt: a chunk that splits, then a decode token.
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7)


class NotPaged(Exception):
    """The model can't run on the paged pass; the message says why."""


def paged_layers(model: nn.Module, options: LoadOptions) -> list[LayerShape]:
    """Each attention layer's KV rows, once a probe found that a pass over pages
    gives mlx-lm's logits (a prompt chunk, then a decode token); raises
    ``NotPaged`` with the reason otherwise."""
    cache = make_kv_cache(model, options)
    others = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if others:
        raise NotPaged(f"its KV cache has {', '.join(others)} layers")
    tokens = mx.array(PROBE_TOKENS, dtype=mx.uint32)
    n = len(PROBE_TOKENS)
    want = [
        model(tokens[None, : n - 1], cache=cache)[0, -1],
        model(tokens[None, n - 1 :], cache=cache)[0, -1],
    ]
    mx.eval(want, [c.state for c in cache])
    page_dtype = None if options.kv_dtype == "auto" else getattr(mx, options.kv_dtype)
    shapes = [
        LayerShape(
            c.keys.shape[1],
            c.keys.shape[3],
            c.values.shape[3],
            c.keys.dtype,
            page_dtype,
        )
        for c in cache
    ]
    install_paged_ops()
    kv = PagedKV(shapes, arena_pages=1)
    pages = tuple(kv.allocate(1))
    try:
        got = []
        for segment, part in (
            (Segment(0, n - 1, n - 1, pages), tokens[: n - 1]),
            (Segment(0, 1, n, pages), tokens[n - 1 :]),
        ):
            layout = kv.layout([segment])
            views = [PagedLayer(kv, i, layout) for i in range(len(shapes))]
            got.append(model(part[None], cache=views)[0, -1])
            mx.eval(got)
    except Exception as e:
        raise NotPaged(f"its attention fails over pages ({type(e).__name__})")
    for mine, theirs in zip(got, want):
        mine, theirs = mine.astype(mx.float32), theirs.astype(mx.float32)
        # Narrower pages round the KV: within 1% of the logits' range then (the
        # embedded model's float16 pages: 0.13 at 33).
        atol = 1e-2
        if page_dtype is not None and page_dtype.size < shapes[0].dtype.size:
            atol *= max(mx.max(mx.abs(theirs)).item(), 1.0)
        if not mx.allclose(mine, theirs, rtol=1e-2, atol=atol).item():
            raise NotPaged("a pass over pages does not give the model's logits")
    return shapes
