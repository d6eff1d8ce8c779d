"""Speculative decoding: a sequence that runs alone proposes tokens, and the model
checks them all in one forward pass.

Proposals come from prompt lookup (``NgramProposer``: the tokens that followed the
latest earlier occurrence of the sequence's last n tokens). Verification samples
every proposed position with the request's own processors and sampler, keeps the
proposals up to the first one the model disagrees with, and then the model's own
token there. The output is what plain decoding gives, greedy and seeded alike:
``SeededSampler`` keys each draw by its position.

``SpeculativeDecoder`` wraps the plain decoder. While that holds one decoding
sequence with a proposal, the sequence leaves it and speculates; when another
arrives it goes back with its KV cache, and the batch decodes as before.

Sliding windows and recurrent state can't be trimmed back past rejected
proposals (``rollback``). Their layers are held (the window or the state: a
fixed size, whatever the length) before each verification; when a proposal is
rejected, the growing layers are trimmed past every verified token, the held
layers restored, and the kept tokens run again at the front of the next
verification, which costs less than a pass of their own. A sequence leaves the
batch with the token the batch already sampled, since its KV state can't give
the last one back either.
"""

import copy
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    make_prompt_cache,
    trim_prompt_cache,
)

from mlx_backend.caches.kinds import layer_kind
from mlx_backend.decoders.base import (
    Decoder,
    KVState,
    NewSequence,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.proposers import DraftProposer, NgramProposer
from mlx_backend.sampling import SeededSampler
from mlx_cache import cache_nbytes
from mlx_utils import gather_logprobs

logger = logging.getLogger(__name__)

# A sequence whose proposals stop paying decodes in the batch again, for a number
# of tokens that doubles each time.
FIRST_BACKOFF_TOKENS = 16
MAX_BACKOFF_TOKENS = 1024
# Verifying must promise this many times the tokens per second of one plain step:
# lone steps are not pipelined as the batch's are.
MIN_GAIN = 1.3
# Acceptance estimates decay by this factor per verification.
ACCEPTANCE_DECAY = 0.9
# Plain steps a sequence loses when it leaves the batch to speculate.
LEAVE_COST = 1.0


def measure_verify_costs(
    model: nn.Module,
    max_draft: int,
    draft: nn.Module | None = None,
    replay: int = 0,
    repeats: int = 2,
) -> tuple[tuple[float, ...], float]:
    """What a forward pass over 1 + k tokens costs relative to one token, for k
    up to ``max_draft`` proposals plus ``replay`` tokens run again (measured on
    this machine with the loaded model at a few k, linear between them); and what
    one token's pass of ``draft`` costs."""

    def seconds(net: nn.Module, cache: list, n: int) -> float:
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            mx.eval(net(mx.zeros((1, n), mx.uint32), cache=cache))
            samples.append(time.perf_counter() - start)
            trim_prompt_cache(cache, n)
        return statistics.median(samples[1:])

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 32), mx.uint32), cache=cache))
    longest = max_draft + replay
    points = sorted({0, 1, 2, 4, max_draft, longest})
    measured = {k: seconds(model, cache, k + 1) for k in points}
    costs = []
    for k in range(longest + 1):
        above = next(p for p in points if p >= k)
        below = max(p for p in points if p <= k)
        share = 0 if above == below else (k - below) / (above - below)
        pass_seconds = measured[below] + share * (measured[above] - measured[below])
        costs.append(pass_seconds / measured[0])
    per_proposal = 0.0
    if draft is not None:
        cache = make_prompt_cache(draft)
        mx.eval(draft(mx.zeros((1, 32), mx.uint32), cache=cache))
        per_proposal = seconds(draft, cache, 1) / measured[0]
    return tuple(costs), per_proposal


def hold(cache: list) -> list:
    """What restores the layers that can't be trimmed (None for those that can):
    shallow copies, since a forward pass over several tokens replaces their
    arrays rather than writing into them."""
    held = []
    for layer in cache:
        if layer_kind(layer) == "growing":
            held.append(None)
        elif isinstance(layer, CacheList):
            held.append(CacheList(*hold(layer.caches)))
        else:
            kept = copy.copy(layer)
            if isinstance(layer, ArraysCache):
                kept.cache = list(layer.cache)
            held.append(kept)
    return held


def roll_back(cache: list, held: list, fed: int) -> None:
    """Undo the last ``fed`` tokens: trim the growing layers, restore the rest."""
    for layer, kept in zip(cache, held):
        if kept is None:
            layer.trim(fed)
        elif isinstance(layer, CacheList):
            roll_back(layer.caches, kept.caches, fed)
        else:
            layer.__dict__.update(kept.__dict__)


def replay_cost(rate: float, k: int, costs: tuple[float, ...]) -> float:
    """The expected cost, in single-token passes, of running the kept tokens again
    after a rejection among ``k`` proposals: ``a`` accepted means ``1 + a`` more
    tokens at the front of the next pass (taken as one over 1 + k), or a pass of
    their own where the measured passes are not that long."""
    total = 0.0
    for a in range(k):
        n = a + 1
        extra = costs[k + n] - costs[k] if k + n < len(costs) else costs[n - 1]
        total += rate**a * (1 - rate) * extra
    return total


def replay_room(max_draft: int) -> int:
    """The kept tokens a rollback verification may run again in front of its
    proposals: those of two rejections in a row."""
    return 2 * max_draft


def expected_tokens(rate: float, k: int) -> float:
    """The tokens one verification of ``k`` proposals yields when each holds
    with probability ``rate``: the accepted ones and the model's own."""
    return sum(rate**i for i in range(k + 1))


def best_draft_length(
    rate: float,
    costs: tuple[float, ...],
    available: int,
    per_proposal: float = 0.0,
    rollback: bool = False,
    replay: int = 0,
) -> int:
    """How many of ``available`` proposals to verify for the most tokens per
    second (0: none), when each holds with probability ``rate``, a pass over
    1 + k tokens costs ``costs[k]`` single-token passes, making a proposal costs
    ``per_proposal`` of one, and with ``rollback`` a rejection runs the kept
    tokens again. ``replay`` tokens run again go first, whatever is verified:
    a proposal is weighed by what it adds to that pass."""
    best, best_gain = 0, MIN_GAIN
    for k in range(1, min(available, len(costs) - 1 - replay) + 1):
        cost = 1 + costs[replay + k] - costs[replay] + k * per_proposal
        if rollback:
            cost += replay_cost(rate, k, costs)
        gain = expected_tokens(rate, k) / cost
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def pass_cost(costs: tuple[float, ...], tokens: int) -> float:
    """A pass over ``tokens`` tokens in single-token passes: measured up to the
    table's length, straight on from its last two entries beyond."""
    if tokens <= len(costs):
        return costs[tokens - 1]
    return costs[-1] + (costs[-1] - costs[-2]) * (tokens - len(costs))


def plan_drafts(
    rates: list[float],
    available: list[int],
    costs: tuple[float, ...],
    per_proposal: float = 0.0,
    least_gain: float = 0.0,
) -> list[int]:
    """How many proposals each row of a one-pass step verifies (0: none), for
    the most expected tokens per second: each row is one token, plus the
    proposals it verifies, of which each holds with probability ``rates[i]``, up
    to ``available[i]`` and the measured passes; the pass costs ``pass_cost``
    and each proposal
    ``per_proposal``. Rows are taken best estimate first. None verify unless the
    plan promises ``MIN_GAIN`` times the tokens per second of a plain step, since
    a step that verifies is not pipelined, and ``least_gain`` tokens more than
    plain steps make in its time."""
    rows = len(rates)
    plan = [0] * rows
    tokens, made, proposed = rows, float(rows), 0

    def pace(tokens: int, made: float, proposed: int) -> float:
        return made / (pass_cost(costs, tokens) + proposed * per_proposal)

    for i in sorted(range(rows), key=lambda i: -rates[i]):
        best, best_pace = 0, pace(tokens, made, proposed)
        # As many as the measured passes verify, as for a lone sequence.
        for k in range(1, min(available[i], len(costs) - 1) + 1):
            more = expected_tokens(rates[i], k) - 1
            if pace(tokens + k, made + more, proposed + k) > best_pace:
                best, best_pace = k, pace(tokens + k, made + more, proposed + k)
        if best:
            plan[i] = best
            tokens, proposed = tokens + best, proposed + best
            made += expected_tokens(rates[i], best) - 1
    seconds = pass_cost(costs, tokens) + proposed * per_proposal
    plain = pace(rows, rows, 0)
    if made < MIN_GAIN * plain * seconds or made - plain * seconds < least_gain:
        return [0] * rows
    return plan


@dataclass(eq=False)
class DraftRow:
    """A sequence's proposer and what its proposals earned: the acceptance
    estimate, the last cheap guess, and the back-off."""

    proposer: NgramProposer | DraftProposer | None
    # Decayed counts of accepted and verified proposals: the acceptance estimate.
    hits: float = field(init=False)
    trials: float = field(init=False)
    # A cheap proposal's first token, checked against the next decoded one.
    guess: int | None = None
    backoff_until: int = 0
    backoff: int = FIRST_BACKOFF_TOKENS

    def __post_init__(self):
        self.reset_estimate()

    def reset_estimate(self) -> None:
        """The prior: a cheap proposer's guesses are checked for free while the
        sequence decodes plainly, so it earns its estimate there from 0; nothing
        checks a costly one's, which starts at one half."""
        cheap = self.proposer is not None and self.proposer.cheap
        self.hits, self.trials = 0.0 if cheap else 1.0, 2.0

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    def observe(self, proposed: int, accepted: int) -> None:
        self.hits = ACCEPTANCE_DECAY * self.hits + accepted
        self.trials = ACCEPTANCE_DECAY * self.trials + accepted + (accepted < proposed)

    def check_guess(self, tokens: list[int], made: tuple[int, ...]) -> None:
        """Score the last cheap guess against the tokens plain decoding ``made``
        (now the end of ``tokens``), so the estimate follows the text; and guess
        the next."""
        if self.guess is not None and made:
            self.observe(1, int(made[0] == self.guess))
        guess = self.proposer.propose(tokens, 1)
        self.guess = guess[0] if guess else None

    def back_off(self, generated: int) -> None:
        """No proposals for a while: a number of tokens that doubles each time."""
        self.backoff_until = generated + self.backoff
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_TOKENS)
        if not self.proposer.cheap:
            # Nothing checks its proposals meanwhile: it gets a fresh estimate.
            self.reset_estimate()


@dataclass(eq=False, kw_only=True)
class _SpeculativeRow(DraftRow):
    """A sequence the speculative decoder holds, in the inner decoder or alone."""

    sequence: NewSequence
    # Prompt and generated tokens; while alone, the last is not in the KV cache yet.
    tokens: list[int]
    inner: int | None = None
    generated: int = 0
    kv_cache: list | None = None
    # Rollback: the token the batch sampled as the sequence left it, and its
    # logprobs, reported with the first lone step.
    unreported: tuple[int, mx.array] | None = None
    # Rollback: kept tokens before the last that the KV cache lacks after a
    # rejection; the next pass runs them first.
    replay: list[int] = field(default_factory=list)

    def cached_tokens(self) -> list[int]:
        """The tokens the KV cache of the lone sequence holds."""
        return self.tokens[: len(self.tokens) - 1 - len(self.replay)]


class SpeculativeDecoder(Decoder):
    """Speculation for a lone sequence around a plain decoder."""

    speculates = True

    def __init__(
        self,
        inner: Decoder,
        model: nn.Module,
        make_proposer: Callable[[], NgramProposer | DraftProposer],
        costs: tuple[float, ...],
        per_proposal: float = 0.0,
        rollback: bool = False,
    ):
        """``make_proposer`` makes each sequence's proposer. ``costs``: what a pass
        over 1 + k tokens costs relative to one token (``measure_verify_costs``),
        and ``per_proposal`` what making one proposal does. ``rollback``: the KV
        cache has layers that can't be trimmed."""
        self._inner = inner
        self._rollback = rollback
        self._model = model
        self._make_proposer = make_proposer
        self._rows: dict[int, _SpeculativeRow] = {}
        self._by_inner: dict[int, int] = {}
        self._lone: int | None = None
        self._next_key = 0
        self._lone_steps = 0
        self._lone_tokens = 0
        self.capabilities = inner.capabilities
        self.costs, self.per_proposal = costs, per_proposal

    # Decode steps and their tokens: the inner decoder's and the lone sequence's.
    @property
    def batch_steps(self) -> int:
        return self._inner.batch_steps + self._lone_steps

    @property
    def batch_tokens(self) -> int:
        return self._inner.batch_tokens + self._lone_tokens

    @property
    def step_token_budget(self) -> int:
        return self._inner.step_token_budget

    def kv_nbytes(self) -> int:
        lone = self._rows[self._lone].kv_cache if self._lone is not None else None
        return self._inner.kv_nbytes() + cache_nbytes(lone or [])

    def add(self, sequence: NewSequence) -> int:
        if self._lone is not None:
            self._back_to_batch(self._rows[self._lone])
        key = self._next_key
        self._next_key += 1
        proposer = None
        if sequence.draft_tokens > 0:
            proposer = self._make_proposer()
        row = _SpeculativeRow(proposer, sequence=sequence, tokens=list(sequence.prompt))
        row.inner = self._inner.add(sequence)
        self._rows[key] = row
        self._by_inner[row.inner] = key
        return key

    def step(self) -> list[StepResult]:
        if self._lone is None and len(self._rows) == 1:
            key, row = next(iter(self._rows.items()))
            if self._worth_speculating(row):
                self._leave_batch(key, row)
        if self._lone is not None:
            # On the batch's stream: on a CPU each stream's worker thread has its
            # own BLAS threads, which would spin against the batch's after a step.
            with mx.stream(thread_stream()):
                result = self._speculate(self._lone, self._rows[self._lone])
            if result is not None:
                return [result]
        alone = len(self._rows) == 1
        results = []
        for result in self._inner.step():
            key = self._by_inner.get(result.key)
            if key is None:
                continue
            row = self._rows[key]
            row.generated += len(result.tokens)
            if row.proposer is not None:
                row.tokens.extend(result.tokens)
                if alone and row.proposer.cheap:
                    row.check_guess(row.tokens, result.tokens)
            if result.done:
                del self._rows[key], self._by_inner[result.key]
            results.append(replace(result, key=key))
        return results

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        row = self._rows.pop(key, None)
        if row is None:
            return None
        if row.inner is not None:
            del self._by_inner[row.inner]
            return self._inner.remove(row.inner, keep_state)
        self._lone = None
        return KVState(row.kv_cache, row.cached_tokens()) if keep_state else None

    def reset(self) -> None:
        self._forget()
        self._inner.reset()

    def close(self) -> None:
        self._forget()
        self._inner.close()

    def _forget(self) -> None:
        self._rows.clear()
        self._by_inner.clear()
        self._lone = None

    # -- moving between the inner decoder and speculation --------------------

    def _worth_speculating(self, row: _SpeculativeRow) -> bool:
        """Whether the sequence alone in the batch should leave it: it is decoding,
        is not backing off, and has a proposal worth verifying."""
        if (
            row.proposer is None
            or row.generated < 1
            or row.generated < row.backoff_until
        ):
            return False
        length = self._best_length(row)
        if not row.proposer.cheap:
            return length > 0
        k = len(row.proposer.propose(row.tokens, length))
        # Leaving throws away the batch's step in flight: the first verification
        # must gain more than that step.
        return k > 0 and expected_tokens(row.acceptance, k) - self.costs[k] > LEAVE_COST

    def _leave_batch(self, key: int, row: _SpeculativeRow) -> None:
        """Take the sequence out of the inner decoder to speculate alone."""
        if self._rollback:
            pending = self._inner.take_pending(row.inner)
            state = pending and pending.state
        else:
            state = self._inner.remove(row.inner)
        del self._by_inner[row.inner]
        if state is None:
            # The engine loop aborts every stream rather than let this one hang.
            raise RuntimeError("a decoding sequence had no KV state to speculate from")
        if self._rollback:
            # The cache holds the last token: the next comes from the batch's step.
            row.tokens.append(pending.token)
            row.generated += 1
            row.unreported = (pending.token, pending.logprobs)
        else:
            # The inner decoder has already run the last token: it is verified again.
            trim_prompt_cache(state.cache, 1)
        row.kv_cache, row.inner = state.cache, None
        row.guess = None
        self._lone = key

    def _back_to_batch(self, row: _SpeculativeRow) -> None:
        """Put the lone sequence back into the inner decoder, with its KV cache."""
        sequence = row.sequence
        row.inner = self._inner.add(
            replace(
                sequence,
                prompt=tuple(row.tokens),
                rest=(*row.replay, row.tokens[-1]),
                kv_cache=row.kv_cache,
                max_tokens=sequence.max_tokens - row.generated,
                snapshots=(),
                resumes=True,
            )
        )
        self._by_inner[row.inner] = self._lone
        row.kv_cache, row.replay = None, []
        self._lone = None

    # -- speculation --------------------------------------------------------

    def _best_length(self, row: _SpeculativeRow) -> int:
        """The number of proposals this step should verify, at most."""
        remaining = row.sequence.max_tokens - row.generated
        limit = min(row.sequence.draft_tokens, remaining - 1)
        return best_draft_length(
            row.acceptance,
            self.costs,
            limit,
            self.per_proposal,
            self._rollback,
            len(row.replay),
        )

    def _speculate(self, key: int, row: _SpeculativeRow) -> StepResult | None:
        """One verification step of the lone sequence; None when it had nothing
        worth verifying and went back to the inner decoder."""
        sequence = row.sequence
        unreported, row.unreported = row.unreported, None
        try:
            draft = row.proposer.propose(row.tokens, self._best_length(row))
            if not draft:
                # The batch's pipelined step beats a lone one; back when there is more.
                self._back_to_batch(row)
                if unreported is None:
                    return None
                return self._report(key, row, [unreported[0]], [unreported[1]])
            held = hold(row.kv_cache) if self._rollback else None
            tokens, logprobs = self._verify(row, draft)
        except Exception as e:
            logger.exception("speculative generation failed")
            del self._rows[key]
            self._lone = None
            return StepResult(key, done=True, error=e.with_traceback(None))
        accepted = next(
            (i for i, (t, d) in enumerate(zip(tokens, draft)) if t != d), len(draft)
        )
        emitted = tokens[: accepted + 1]
        row.proposer.rewind(accepted, len(draft))
        # The cache holds the replay, the last token and every proposal; keep the
        # accepted ones.
        if held is not None and accepted < len(draft):
            roll_back(row.kv_cache, held, len(row.replay) + len(draft) + 1)
            row.replay += [row.tokens[-1], *draft[:accepted]]
            if len(row.replay) > len(self.costs) - 2:
                # No room left for a proposal in front of it: it runs now.
                self._run_replay(row)
        else:
            trim_prompt_cache(row.kv_cache, len(draft) - accepted)
            row.replay = []
        row.tokens.extend(emitted)
        row.generated += len(emitted)
        if isinstance(sequence.sampler, SeededSampler):
            # Rejected positions are drawn again, by whichever decoder runs next.
            sequence.sampler.position = row.generated
        row.observe(len(draft), accepted)
        if accepted:
            row.backoff = FIRST_BACKOFF_TOKENS
        self.draft_proposed += len(draft)
        self.draft_accepted += accepted
        rows = list(logprobs[: len(emitted)])
        if unreported is not None:
            emitted, rows = [unreported[0], *emitted], [unreported[1], *rows]
        return self._report(key, row, emitted, rows, len(draft), accepted)

    def _report(
        self,
        key: int,
        row: _SpeculativeRow,
        emitted: list[int],
        rows: list[mx.array],
        proposed: int = 0,
        accepted: int = 0,
    ) -> StepResult:
        """The lone sequence's step: its tokens, scored from their logprob
        ``rows``; it ends here at its token limit, or goes back to the batch when
        proposals stopped paying."""
        sequence = row.sequence
        self._lone_steps += 1
        self._lone_tokens += len(emitted)
        scored = [None] * len(emitted)
        if sequence.logprobs is not None:
            scored = gather_logprobs(rows, emitted, sequence.logprobs)
        done = row.generated >= sequence.max_tokens
        state = None
        if done:
            state = KVState(row.kv_cache, row.cached_tokens())
            del self._rows[key]
            self._lone = None
        elif row.inner is None and self._best_length(row) == 0:
            row.back_off(row.generated)
            self._back_to_batch(row)
        return StepResult(
            key,
            tuple(emitted),
            tuple(scored),
            done=done,
            state=state,
            proposed=proposed,
            accepted=accepted,
        )

    def _verify(
        self, row: _SpeculativeRow, draft: list[int]
    ) -> tuple[list[int], mx.array]:
        """The model's token at the last token and after each proposal, sampled with
        the request's processors and sampler; and their log probabilities."""
        sequence = row.sequence
        inputs = [*row.replay, row.tokens[-1], *draft]
        logits = self._model(mx.array(inputs)[None], cache=row.kv_cache)[0]
        logits = logits[len(row.replay) :]
        if sequence.processors:
            # Each position sees the tokens before it (penalties look back
            # ``history`` tokens), as plain decoding would have shown it.
            context = mx.array(row.tokens[-sequence.history :] + draft)
            head = min(len(row.tokens), sequence.history)
            rows = []
            for i in range(1 + len(draft)):
                position = logits[i : i + 1]
                for processor in sequence.processors:
                    position = processor(context[: head + i], position)
                rows.append(position)
            logits = mx.concatenate(rows)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = sequence.sampler
        if isinstance(sampler, SeededSampler):
            sampler.position = row.generated
        tokens = sampler(logprobs)
        mx.eval(tokens, logprobs)
        return tokens.tolist(), logprobs

    def _run_replay(self, row: _SpeculativeRow) -> None:
        self._model(mx.array(row.replay)[None], cache=row.kv_cache)
        mx.eval([layer.state for layer in row.kv_cache])
        row.replay = []
