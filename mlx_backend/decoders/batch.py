"""Continuous batching: every sequence decodes in one forward pass per step."""

import copy
import logging
import time
from collections import deque

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    _merge_caches,
)
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from mlx_backend.caches.kinds import copy_prefix
from mlx_backend.cpu.pacing import pace_step
from mlx_backend.decoders.base import (
    Capabilities,
    Decoder,
    KVState,
    NewSequence,
    Pending,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.step_budget import (
    NO_STEP_BUDGET,
    SHORT_PROMPT_TOKENS,
    PrefillPacer,
    StepBudget,
)
from mlx_utils import Scored, gather_logprobs
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


class BatchDecoder(Decoder):
    """Continuous batching on mlx-lm's ``BatchGenerator``: every sequence decodes in
    one forward pass per step, and prompts are prefilled a chunk per step."""

    def __init__(
        self,
        model: nn.Module,
        options: LoadOptions,
        trimmable: bool,
        pace: bool = False,
        budget: StepBudget = NO_STEP_BUDGET,
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
        self.pacer = PrefillPacer(budget, options.prefill_step_size)
        # Sequences back from decoding elsewhere (speculation), until they decode
        # here: their one-token prefill is a decode step's work.
        self._resuming: set[int] = set()
        self._batch = self._make_batch()

    def _make_batch(self) -> BatchGenerator:
        options = self._options
        batch = BatchGenerator(
            self._model,
            completion_batch_size=options.max_batch_size,
            # BatchGenerator raises its decode limit to the prefill batch size.
            prefill_batch_size=min(options.prefill_batch_size, options.max_batch_size),
            prefill_step_size=options.prefill_step_size,
            stream=thread_stream(),
        )
        batch._prompt_batch = SharingPromptBatch.empty(
            self._model, batch.sampler, options.prefill_step_size
        )
        return batch

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
        if sequence.resumes:
            self._resuming.add(uid)
        ends = [reused + cut for cut in cuts]
        if len(rest) > 1 and len(prompt) - 1 in sequence.snapshots:
            ends.append(len(prompt) - 1)
        if ends:
            self._snapshots[uid] = [prompt[:end] for end in sorted(set(ends))]
        return uid

    def step(self) -> list[StepResult]:
        batch = self._batch
        counters = batch._counters
        prefilled = counters.prompt_tokens
        start = time.perf_counter()
        try:
            joined = self._join_waiting()
            decoding, alone, chunk = self._plan_prefill(len(joined))
            prompt_responses, responses = batch.next()
            snapshots = self._take_snapshots(prompt_responses)
            if alone is not None:
                snapshots.update(self._prefill_alone(alone, chunk))
        except Exception as e:
            logger.exception("batched generation failed")
            error = e.with_traceback(None)
            # Each handler raises its own copy, with its own traceback.
            failed = [
                StepResult(key, done=True, error=copy.copy(error)) for key in self._rows
            ]
            self.reset()
            return failed
        # The prefill's evaluation waits for the decode pass: the whole step.
        self.pacer.observe(
            time.perf_counter() - start,
            decoding,
            counters.prompt_tokens - prefilled,
            joined=bool(joined) or any(r.end_of_prompt for r in prompt_responses),
            alone=alone is not None,
        )
        responses = [r for r in responses if r.uid in self._rows]
        # A joining row's first token is its last prompt token: its own come next.
        responses = [r for r in responses if r.uid not in joined]
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

    def _join_waiting(self) -> set[int]:
        """Waiting sequences with one prompt token left start decoding: their KV
        joins the decode batch's at once, never padded beside the prompts still
        prefilling (mlx-lm merges them into its prompt batch first, copying every
        row), and their last prompt token is their input to this step's decode
        pass (mlx-lm runs it in a pass of its own). The rows that joined: the
        token this step returns for each is that prompt token, not theirs."""
        batch = self._batch
        room = batch.completion_batch_size - len(batch._generation_batch)
        ready = [s for s in batch._unprocessed_sequences if _prompt_left(s) == 1]
        ready = ready[: max(room, 0)]
        if not ready:
            return set()
        joining = {s[0] for s in ready}
        batch._unprocessed_sequences = deque(
            s for s in batch._unprocessed_sequences if s[0] not in joining
        )
        uids, segments, max_tokens, caches, tokens, samplers, processors, stops = (
            list(field) for field in zip(*ready)
        )
        with mx.stream(batch.stream):
            rows = GenerationBatch.empty(self._model, batch.sampler)
            rows.uids, rows.prompt_cache, rows.tokens = (
                uids,
                _merge_caches(caches),
                tokens,
            )
            rows.samplers, rows.logits_processors = samplers, processors
            rows.stop_sequences = stops
            # The prompt token a row returns first counts against its limit.
            rows.max_tokens = [n + 1 for n in max_tokens]
            rows._next_tokens = mx.array([s[0][0] for s in segments], mx.uint32)
            rows._next_logprobs = [mx.zeros((1,)) for _ in uids]
            rows._token_context = [TokenBuffer(t) for t in tokens]
            rows._num_tokens = [0] * len(uids)
            rows._matchers = [stop.matcher() for stop in stops]
            batch._generation_batch.extend(rows)
        return joining

    def _plan_prefill(self, joined: int) -> tuple[int, tuple | None, int]:
        """This step's prefill: the shortest waiting prompts join it first; while
        sequences decode its chunks keep within the step budget. Beside a long
        prompt a short one prefills in a pass of its own, and the prompt batch
        waits for it: in the batch, padded to the long one's depth, its tokens
        cost as deep as the long one's, and with nothing decoding it would wait
        for the long one's whole chunks. The sequences decoding, the short prompt
        that prefills alone this step (out of the queue until it has), and its
        chunk."""
        batch = self._batch
        waiting = batch._unprocessed_sequences
        if len(waiting) > 1:
            # A one-line request must not wait for a slot behind long prompts.
            batch._unprocessed_sequences = waiting = deque(
                sorted(waiting, key=_prompt_left)
            )
        self._resuming -= set(batch._generation_batch.uids)
        decoding = len(batch._generation_batch) + len(self._resuming)
        # The prompts this step may prefill, and the tokens each has left.
        rows = [
            (uid, sum(map(len, segments)))
            for uid, (segments, *_) in zip(
                batch._prompt_batch.uids, batch._currently_processing
            )
        ]
        # A row with one token left starts decoding this step.
        joining = joined > 0 or any(left == 1 for _, left in rows)
        rows += [(s[0], _prompt_left(s)) for s in waiting]
        lefts = [left for uid, left in rows if uid not in self._resuming]
        alone = None
        if not joining and any(left > SHORT_PROMPT_TOKENS for left in lefts):
            alone = next(
                (
                    s
                    for s in waiting
                    if s[0] not in self._resuming
                    and _prompt_left(s) <= SHORT_PROMPT_TOKENS
                ),
                None,
            )
        if alone is not None:
            rows = [row for row in rows if row[0] != alone[0]]
        rows = rows[: batch.prefill_batch_size]
        prompts = [left for uid, left in rows if uid not in self._resuming]
        if alone is not None:
            waiting.remove(alone)
            chunk = self.pacer.chunk(decoding, 1, alone=True)
        else:
            short = any(left <= SHORT_PROMPT_TOKENS for left in prompts)
            chunk = self.pacer.chunk(decoding, len(prompts), short, joining)
        # Resuming sequences run their kept tokens again (rollback) at once; the
        # batch splits their last token off itself.
        resuming = [left - 1 for uid, left in rows if uid in self._resuming]
        batch.prefill_step_size = max([0 if alone else chunk, *resuming])
        return decoding, alone, chunk

    def _prefill_alone(self, sequence: tuple, chunk: int) -> dict:
        """Up to ``chunk`` tokens of a waiting sequence's prompt, on its own KV
        cache, before it goes back to the front of the queue; its last token is
        left to start decoding. The snapshots its prefill passed."""
        batch = self._batch
        uid, segments, _, cache, tokens = sequence[:5]
        part = segments[0][:chunk]
        with mx.stream(batch.stream):
            self._model(mx.array([part]), cache=cache)
            mx.eval([layer.state for layer in cache])
        tokens += part
        segments[0] = segments[0][len(part) :]
        batch._counters.prompt_tokens += len(part)
        batch._unprocessed_sequences.appendleft(sequence)
        if segments[0]:
            return {}
        segments.pop(0)
        if self._next_snapshot(uid) is None:
            return {}
        kept = copy_prefix(cache, len(tokens)) or copy.deepcopy(cache)
        return {uid: (KVState(kept, list(tokens)),)}

    @property
    def step_token_budget(self) -> int:
        return self.pacer.tokens

    def kv_nbytes(self) -> int:
        return self._batch.prompt_cache_nbytes

    def _take_snapshots(self, prompt_responses) -> dict[int, tuple[KVState, ...]]:
        """Copies of the KV state of each prompt prefix whose prefill just ended."""
        taken: dict[int, list[KVState]] = {}
        for response in prompt_responses:
            if not response.end_of_segment:
                continue
            tokens = self._next_snapshot(response.uid)
            if tokens is None:
                continue
            cache, _ = self._batch.extract_cache([response.uid])[response.uid]
            taken.setdefault(response.uid, []).append(KVState(cache, list(tokens)))
        return {uid: tuple(states) for uid, states in taken.items()}

    def _next_snapshot(self, uid: int) -> tuple[int, ...] | None:
        """The prompt prefix a row's ended segment snapshots, taken off its list;
        None: no snapshot there."""
        pending = self._snapshots.get(uid)
        if not pending:
            return None
        tokens = pending.pop(0)
        if not pending:
            del self._snapshots[uid]
        return tokens

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
        self._resuming.discard(key)
        if key not in self._rows:
            return None
        del self._rows[key]
        removed = self._batch.remove([key], return_prompt_caches=keep_state)
        state = removed.get(key) if keep_state else None
        return None if state is None else KVState(*state)

    def take_pending(self, key: int) -> Pending | None:
        # The step that returned a row's last token also sampled its next one:
        # mlx-lm 0.32's GenerationBatch holds it until its next step.
        generation = self._batch._generation_batch
        if key not in self._rows or key not in generation.uids:
            return None
        i = generation.uids.index(key)
        token = generation._next_tokens[i].item()
        logprobs = generation._next_logprobs[i]
        state = self.remove(key)
        return None if state is None else Pending(state, token, logprobs)

    def reset(self) -> None:
        self._close_batch()
        self._batch = self._make_batch()

    def close(self) -> None:
        self._close_batch()

    def _close_batch(self) -> None:
        self._rows.clear()
        self._snapshots.clear()
        self._resuming.clear()
        try:
            self._batch.close()
        except Exception:
            logger.exception("closing the batch generator failed")


class SharingPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, whose split shares the KV arrays it filters.

    mlx-lm 0.32 deep-copies the whole batch's KV cache before splitting off the
    prompts that end (4,000 tokens of the embedded model: 184 MB, in the step
    where a long prompt joins the running streams); filtering already copies
    the rows each side keeps."""

    def _copy(self):
        if not all(type(c) is BatchKVCache for c in self.prompt_cache):
            return super()._copy()
        caches, self.prompt_cache = self.prompt_cache, []
        try:
            new_batch = super()._copy()
        finally:
            self.prompt_cache = caches
        new_batch.prompt_cache = [copy.copy(c) for c in caches]
        return new_batch


def _prompt_left(sequence) -> int:
    # A BatchGenerator sequence waiting for prefill: (uid, segments, ...).
    return sum(len(segment) for segment in sequence[1])
