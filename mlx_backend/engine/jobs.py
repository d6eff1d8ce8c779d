"""The Score, Rerank and Embedding jobs: work that runs a chunk at a time between decode
steps, and the queue that schedules it."""

import copy
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.errors import Aborted
from mlx_backend.models.loading import hidden_state_model
from mlx_backend.request_parsing import (
    ComputeRequest,
    EmbeddingRequest,
    JudgeRequest,
    ScoreRequest,
)

logger = logging.getLogger(__name__)


def _normalize(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# Copies of a prompt's KV cache that one Score batch may hold.
SCORE_COPY_BYTES = 1 << 30


class ScoreBatch:
    """Candidates' per-token logprobs after a prompt, a chunk per ``advance``.

    First the prompt tokens missing from ``cache`` run, one prefill chunk at a
    time (only the last one through the output layer); then the candidates run in
    groups of at most ``max_rows``, over copies of the prompt's cache.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: list,
        rest: Sequence[int],
        candidates: Sequence[Sequence[int]],
        step_size: int,
        max_rows: int,
    ):
        self._model = model
        self.cache = cache
        self._rest = list(rest)
        self._candidates = list(candidates)
        self._step = step_size
        self._max_rows = max_rows
        self._first: mx.array | None = None
        self.scores: list[list[float]] = []

    def advance(self) -> bool:
        """Run the next chunk; True when every candidate is scored."""
        if self._first is None:
            chunk = self._rest[: min(self._step, len(self._rest) - 1) or 1]
            self._rest = self._rest[len(chunk) :]
            logits = self._model(mx.array(chunk)[None], cache=self.cache)
            if self._rest:
                mx.eval([c.state for c in self.cache])
                return False
            self._first = _normalize(logits[0, -1])
            mx.eval(self._first)
            return False
        group = self._next_group()
        self.scores += score_continuations(self._model, self.cache, self._first, group)
        return len(self.scores) == len(self._candidates)

    def _next_group(self) -> list[Sequence[int]]:
        copy_bytes = max(sum(c.nbytes for c in self.cache), 1)
        rows = max(1, min(self._max_rows, SCORE_COPY_BYTES // copy_bytes))
        group = [self._candidates[len(self.scores)]]
        for candidate in self._candidates[len(self.scores) + 1 :]:
            longest = max(len(candidate), *map(len, group))
            if len(group) == rows or (len(group) + 1) * longest > self._step:
                break
            group.append(candidate)
        return group


def score_continuations(
    model: nn.Module,
    cache: list,
    first: mx.array,
    continuations: Sequence[Sequence[int]],
) -> list[list[float]]:
    """Each continuation's per-token logprobs after the prompt in ``cache``.

    ``first`` holds the logprobs after the prompt. The continuations run as one
    batch over copies of the prompt's cache, right-padded (causal attention keeps
    the padding out of the real positions); ``cache`` itself is not changed.
    """
    count = len(continuations)
    width = max(len(c) for c in continuations) - 1
    heads = mx.array([c[0] for c in continuations])
    values = first[heads][:, None]
    if width > 0:
        pad = [[0] * (width + 1 - len(c)) for c in continuations]
        inputs = mx.array([list(c[:-1]) + p for c, p in zip(continuations, pad)])
        targets = mx.array([list(c[1:]) + p for c, p in zip(continuations, pad)])
        if all(hasattr(c, "merge") for c in cache):
            batch = [type(c).merge([c] * count) for c in cache]
            logits = model(inputs, cache=batch)
        else:
            logits = mx.concatenate(
                [
                    model(inputs[i : i + 1], cache=copy.deepcopy(cache))
                    for i in range(count)
                ]
            )
        rest = mx.take_along_axis(_normalize(logits), targets[..., None], axis=-1)
        values = mx.concatenate([values, rest[..., 0]], axis=1)
    values = values.tolist()
    return [row[: len(c)] for row, c in zip(values, continuations)]


class JudgeBatch:
    """Each document's answer logprobs after a shared prefix, a chunk per
    ``advance``.

    First the prefix tokens missing from ``cache`` run, one prefill chunk at a
    time; then the documents, shortest first, in groups of at most ``max_rows``
    rows over copies of the prefix's cache, right-padded (causal attention keeps
    the padding out of the real positions), about ``step_size`` tokens a chunk.
    A row's answers are read at its last token, through ``head`` (the output
    layer alone) where the model has one, else through the whole model.
    """

    def __init__(
        self,
        model: nn.Module,
        head: Callable[[mx.array], mx.array] | None,
        cache: list,
        rest: Sequence[int],
        request: JudgeRequest,
        step_size: int,
        max_rows: int,
    ):
        self._model = model
        self._head = head
        self._body = hidden_state_model(model) if head is not None else None
        self.cache = cache
        self._rest = list(rest)
        self._prefix = len(request.prefix)
        self._documents = request.documents
        self._answers = mx.array(request.answers)
        self._step = step_size
        self._max_rows = max_rows
        self._waiting = sorted(range(len(self._documents)), key=self._length)
        self._group: _JudgeGroup | None = None
        self.answers: list[tuple[float, float]] = [(0.0, 0.0)] * len(self._documents)

    def advance(self) -> bool:
        """Run the next chunk; True when every document is judged."""
        if self._rest:
            chunk, self._rest = self._rest[: self._step], self._rest[self._step :]
            self._model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            return False
        if self._group is None:
            self._group = self._next_group()
        group = self._group
        width = group.tokens.shape[1]
        start, end = group.done, min(group.done + group.columns, width)
        inputs = group.tokens[:, start:end]
        model = self._model if self._head is None else self._body
        outputs = model(inputs, cache=group.cache)
        ending = [r for r, last in enumerate(group.lasts) if start <= last < end]
        if ending:
            at = mx.array([group.lasts[r] - start for r in ending])
            picked = outputs[mx.array(ending), at]
            if self._head is not None:
                picked = self._head(picked[None])[0]
            values = _normalize(picked)[:, self._answers]
            mx.eval(values, [c.state for c in group.cache])
            for r, pair in zip(ending, values.tolist()):
                self.answers[group.indices[r]] = tuple(pair)
        else:
            mx.eval([c.state for c in group.cache])
        group.done = end
        if end == width:
            self._group = None
        return self._group is None and not self._waiting

    def _length(self, index: int) -> int:
        return len(self._documents[index])

    def _next_group(self) -> "_JudgeGroup":
        # At least 16 columns a chunk, about step_size tokens in all.
        rows = min(self._max_rows, max(1, self._step // 16))
        if not self._prefix or not all(hasattr(c, "merge") for c in self.cache):
            rows = 1
        width = self._length(self._waiting[min(rows, len(self._waiting)) - 1])
        # A row's copy grows from the prefix's KV by its own tokens'.
        prefix_bytes = sum(c.nbytes for c in self.cache)
        row_bytes = max(
            prefix_bytes * (self._prefix + width) // max(self._prefix, 1), 1
        )
        rows = max(1, min(rows, SCORE_COPY_BYTES // row_bytes))
        indices, self._waiting = self._waiting[:rows], self._waiting[rows:]
        width = self._length(indices[-1])
        tokens = [
            list(self._documents[i]) + [0] * (width - self._length(i)) for i in indices
        ]
        if len(indices) == 1:
            cache = copy.deepcopy(self.cache)
        else:
            cache = [type(c).merge([c] * len(indices)) for c in self.cache]
        return _JudgeGroup(
            indices=indices,
            tokens=mx.array(tokens),
            lasts=[self._length(i) - 1 for i in indices],
            cache=cache,
            columns=max(16, self._step // len(indices)),
        )


@dataclass
class _JudgeGroup:
    """Documents judged together: their rows, padded tokens, each row's last
    position and the copies of the prefix's cache they run over."""

    indices: list[int]
    tokens: mx.array
    lasts: list[int]
    cache: list
    columns: int
    done: int = 0


class EmbeddingBatch:
    """Pooled final hidden states of several token lists, one chunk per ``advance``.

    The lists are right-padded into one batch that runs through a fresh KV cache,
    ``step_size`` positions at a time, so it shares the engine loop with decoding.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Sequence[Sequence[int]],
        pooling: str,
        step_size: int,
    ):
        self._hidden = hidden_state_model(model)
        width = max(len(t) for t in inputs)
        self._tokens = mx.array([list(t) + [0] * (width - len(t)) for t in inputs])
        self._lengths = mx.array([len(t) for t in inputs])
        self._pooling = pooling
        # About one prefill chunk of tokens per advance, whatever the batch size.
        self._step = max(16, step_size // len(inputs))
        self._cache = make_prompt_cache(model)
        self._done = 0
        self._pooled: mx.array | None = None

    def advance(self) -> bool:
        """Run the next chunk; True when every list is done."""
        width = self._tokens.shape[1]
        start, end = self._done, min(self._done + self._step, width)
        hidden = self._hidden(self._tokens[:, start:end], cache=self._cache)
        hidden = hidden.astype(mx.float32)
        positions = mx.arange(start, end)[None]
        if self._pooling == "mean":
            inside = (positions < self._lengths[:, None])[..., None]
            chunk = mx.where(inside, hidden, 0.0).sum(axis=1)
        else:
            last = mx.clip(self._lengths - 1 - start, 0, end - start - 1)
            chunk = mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
            inside = (self._lengths - 1 >= start) & (self._lengths - 1 < end)
            chunk = mx.where(inside[:, None], chunk, 0.0)
        self._pooled = chunk if self._pooled is None else self._pooled + chunk
        mx.eval(self._pooled, [c.state for c in self._cache])
        self._done = end
        return end >= width

    def vectors(self) -> list[list[float]]:
        """The L2-normalized vectors, in input order."""
        pooled = self._pooled
        if self._pooling == "mean":
            pooled = pooled / self._lengths[:, None].astype(mx.float32)
        norms = mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return (pooled / norms).tolist()


# ``JobQueue.withdraw``'s place of the running job.
RUNNING_JOB = -1


@dataclass
class _Job:
    """``start()`` makes the work, ``work.advance()`` runs a chunk (True when
    done), ``finish(work)`` answers the futures."""

    futures: list[Future]
    start: Callable
    finish: Callable
    work: object = None


class JobQueue:
    """Embedding, Score and Rerank requests waiting, and the job that runs one chunk of
    them per engine step, on the served model (a ``ServedModel``)."""

    def __init__(self):
        self._waiting: list[tuple[ComputeRequest, Future]] = []
        self._job: _Job | None = None

    def __bool__(self) -> bool:
        return bool(self._waiting or self._job)

    def add(self, request: ComputeRequest, future: Future) -> None:
        self._waiting.append((request, future))

    def step(self, served, before_answer: Callable) -> None:
        """One chunk of the running job, else of the next one; ``before_answer``
        runs when a job is done, before its callers get their results."""
        if self._job is None:
            self._job = self._next_job(served)
        job = self._job
        try:
            if job.work is None:
                job.work = job.start()
            if job.work.advance():
                self._job = None
                before_answer()
                job.finish(job.work)
        except Exception as e:
            logger.exception("embedding or scoring failed")
            self._job = None
            error = e.with_traceback(None)
            for future in job.futures:
                if not future.done():
                    future.set_exception(copy.copy(error))

    def withdraw(self, future: Future) -> int | None:
        """Drop the request whose caller went away: a waiting one at once, the
        running job once none of its callers waits. Its place, for a group's
        other ranks to ``drop`` alike; None when nothing was dropped."""
        if self._job is not None and future in self._job.futures:
            future.set_exception(Aborted("the request was cancelled"))
            if not all(f.done() for f in self._job.futures):
                return None
            place = RUNNING_JOB
        else:
            waiting = [f for _, f in self._waiting]
            if future not in waiting:
                return None
            place = waiting.index(future)
            future.set_exception(Aborted("the request was cancelled"))
        logger.info("a cancelled %s is dropped", "job" if place < 0 else "request")
        self.drop(place)
        return place

    def drop(self, place: int) -> None:
        """Forget the running job (``RUNNING_JOB``) or the waiting request at
        ``place``, answering nobody."""
        if place == RUNNING_JOB:
            self._job = None
        else:
            del self._waiting[place]

    def abort(self, error: Exception) -> None:
        """Fail the running job and every waiting request with ``error``."""
        running = self._job.futures if self._job else []
        for future in running + [future for _, future in self._waiting]:
            if not future.done():  # else withdrawn
                future.set_exception(copy.copy(error))
        self._job, self._waiting = None, []

    def _next_job(self, served) -> _Job:
        """The first waiting Score or Rerank, or every waiting embedding up to a
        batch."""
        model, options, store = served.model, served.info.options, served.store
        request, future = self._waiting[0]
        if isinstance(request, ScoreRequest):
            del self._waiting[0]

            def start() -> ScoreBatch:
                kv_cache, rest = store.fetch(request.prompt)
                return ScoreBatch(
                    model,
                    kv_cache,
                    rest,
                    request.candidates,
                    options.prefill_step_size,
                    options.max_batch_size,
                )

            def finish(work: ScoreBatch) -> None:
                store.keep(work.cache, request.prompt)
                future.set_result(work.scores)

            return _Job([future], start, finish)
        if isinstance(request, JudgeRequest):
            del self._waiting[0]

            def start() -> JudgeBatch:
                kv_cache, rest = store.fetch_shared(request.prefix, request.documents)
                logger.info(
                    "judging %d documents after a shared prefix of %d tokens, "
                    "%d of them cached",
                    len(request.documents),
                    len(request.prefix),
                    len(request.prefix) - len(rest),
                )
                return JudgeBatch(
                    model,
                    served.head,
                    kv_cache,
                    rest,
                    request,
                    options.prefill_step_size,
                    options.max_batch_size,
                )

            def finish(work: JudgeBatch) -> None:
                store.keep(work.cache, request.prefix)
                future.set_result(work.answers)

            return _Job([future], start, finish)
        embeddings = [
            item for item in self._waiting if isinstance(item[0], EmbeddingRequest)
        ][: options.max_batch_size]
        self._waiting = [item for item in self._waiting if item not in embeddings]
        futures = [future for _, future in embeddings]

        def start() -> EmbeddingBatch:
            return EmbeddingBatch(
                model,
                [request.tokens for request, _ in embeddings],
                options.embedding_pooling,
                options.prefill_step_size,
            )

        def finish(work: EmbeddingBatch) -> None:
            for future, vector in zip(futures, work.vectors()):
                if not future.done():  # else withdrawn
                    future.set_result(vector)

        return _Job(futures, start, finish)
