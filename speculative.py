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
"""

import logging
import statistics
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from decoders import Decoder, KVState, NewSequence, StepResult, make_plain_decoder
from mlx_utils import gather_logprobs, make_kv_cache
from python_utils import LoadOptions
from sampling import SeededSampler

logger = logging.getLogger(__name__)

# A speculating sequence that goes this many steps without a proposal worth
# verifying decodes in the batch again, for a number of tokens that doubles each time.
MISSES_BEFORE_REST = 8
FIRST_REST_TOKENS = 16
MAX_REST_TOKENS = 1024
# Acceptance estimates decay by this factor per verification.
ACCEPTANCE_DECAY = 0.9


class NgramProposer:
    """Prompt lookup over a sequence's tokens (prompt and output).

    Each n-gram maps to where the tokens that followed its latest occurrence start,
    so a proposal costs a few dictionary lookups whatever the sequence's length.
    """

    def __init__(self, n_min: int, n_max: int):
        self._sizes = range(n_max, n_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens`` (which only ever grows)."""
        for end in range(self._indexed, len(tokens)):
            # The n-grams that end just before ``end`` are followed by it.
            for n in self._sizes:
                if end >= n:
                    self._index[tuple(tokens[end - n : end])] = end
        self._indexed = len(tokens)
        for n in self._sizes:
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None and len(tokens) >= n:
                return tokens[start : start + limit]
        return []


def measure_verify_costs(model: nn.Module, max_draft: int, repeats: int = 2):
    """What a forward pass over 1 + k tokens costs relative to one token, for k
    up to ``max_draft``: measured on this machine with the loaded model at a few
    k, linear between them."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 32), mx.uint32), cache=cache))
    measured = {}
    for k in sorted({0, 1, 2, 4, max_draft}):
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            mx.eval(model(mx.zeros((1, k + 1), mx.uint32), cache=cache))
            samples.append(time.perf_counter() - start)
            trim_prompt_cache(cache, k + 1)
        measured[k] = statistics.median(samples[1:])
    points = sorted(measured)
    costs = []
    for k in range(max_draft + 1):
        above = next(p for p in points if p >= k)
        below = max(p for p in points if p <= k)
        share = 0 if above == below else (k - below) / (above - below)
        seconds = measured[below] + share * (measured[above] - measured[below])
        costs.append(seconds / measured[0])
    return tuple(costs)


def best_draft_length(rate: float, costs: tuple[float, ...], available: int) -> int:
    """How many of ``available`` proposals to verify for the most tokens per
    second (0: none), when each holds with probability ``rate`` and a pass over
    1 + k tokens costs ``costs[k]`` single-token passes."""
    best, best_gain = 0, 1.0
    for k in range(1, min(available, len(costs) - 1) + 1):
        expected = sum(rate**i for i in range(k + 1))
        if expected / costs[k] > best_gain:
            best, best_gain = k, expected / costs[k]
    return best


@dataclass(eq=False)
class _Row:
    """A sequence the speculative decoder holds, in the inner decoder or alone."""

    sequence: NewSequence
    # Prompt and generated tokens; while alone, the last is not in the KV cache yet.
    tokens: list[int]
    proposer: NgramProposer | None
    inner: int | None = None
    generated: int = 0
    kv_cache: list | None = None
    # Decayed counts of accepted and verified proposals: the acceptance estimate.
    hits: float = 1.0
    trials: float = 2.0
    misses: int = 0
    rest_until: int = 0
    rest: int = FIRST_REST_TOKENS
    proposed: int = 0
    accepted: int = 0


class SpeculativeDecoder(Decoder):
    """Speculation for a lone sequence around a plain decoder."""

    def __init__(
        self,
        inner: Decoder,
        model: nn.Module,
        num_draft_tokens: int,
        ngram_min: int,
        ngram_max: int,
        costs: tuple[float, ...] | None = None,
    ):
        """``costs``: what a pass over 1 + k tokens costs relative to one token;
        measured on the model when not given."""
        self._inner = inner
        self._model = model
        self._ngram = (ngram_min, ngram_max)
        self.capabilities = inner.capabilities
        self._rows: dict[int, _Row] = {}
        self._by_inner: dict[int, int] = {}
        self._lone: int | None = None
        self._next_key = 0
        self._lone_steps = 0
        self._lone_tokens = 0
        self.costs = costs or measure_verify_costs(model, max(num_draft_tokens, 8))
        logger.info(
            "speculative decoding: n-gram prompt lookup (n %d-%d), up to %d tokens; "
            "one pass over 1+k tokens costs %s times one token (k = 1..%d)",
            ngram_min,
            ngram_max,
            num_draft_tokens,
            ", ".join(f"{c:.2f}" for c in self.costs[1:]),
            len(self.costs) - 1,
        )

    # Decode steps and their tokens: the inner decoder's and the lone sequence's.
    @property
    def batch_steps(self) -> int:
        return self._inner.batch_steps + self._lone_steps

    @property
    def batch_tokens(self) -> int:
        return self._inner.batch_tokens + self._lone_tokens

    def add(self, sequence: NewSequence) -> int:
        if self._lone is not None:
            self._join(self._rows[self._lone])
        key = self._next_key
        self._next_key += 1
        proposer = None
        if sequence.draft_tokens > 0:
            proposer = NgramProposer(*self._ngram)
        row = _Row(sequence, list(sequence.prompt), proposer)
        row.inner = self._inner.add(sequence)
        self._rows[key] = row
        self._by_inner[row.inner] = key
        return key

    def step(self) -> list[StepResult]:
        if self._lone is None and len(self._rows) == 1:
            key, row = next(iter(self._rows.items()))
            if self._worth_speculating(row):
                self._leave(key, row)
        if self._lone is not None:
            return [self._speculate(self._lone, self._rows[self._lone])]
        results = []
        for result in self._inner.step():
            key = self._by_inner.get(result.key)
            if key is None:
                continue
            row = self._rows[key]
            row.generated += len(result.tokens)
            if row.proposer is not None:
                row.tokens.extend(result.tokens)
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
        return KVState(row.kv_cache, row.tokens[:-1]) if keep_state else None

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

    def _worth_speculating(self, row: _Row) -> bool:
        """Whether the sequence alone in the batch should leave it: it is decoding,
        is not resting, and has a proposal worth verifying."""
        if row.proposer is None or row.generated < 1 or row.generated < row.rest_until:
            return False
        remaining = row.sequence.max_tokens - row.generated
        draft = row.proposer.propose(row.tokens, self._limit(row, remaining))
        return best_draft_length(row.hits / row.trials, self.costs, len(draft)) > 0

    def _leave(self, key: int, row: _Row) -> None:
        """Take the sequence out of the inner decoder to speculate alone."""
        state = self._inner.remove(row.inner)
        del self._by_inner[row.inner]
        if state is None:
            return
        # The inner decoder has already run the last token: it is verified again.
        trim_prompt_cache(state.cache, 1)
        row.kv_cache, row.inner = state.cache, None
        row.misses = 0
        row.hits, row.trials = 1.0, 2.0
        self._lone = key

    def _join(self, row: _Row) -> None:
        """Put the lone sequence back into the inner decoder, with its KV cache."""
        sequence = row.sequence
        row.inner = self._inner.add(
            replace(
                sequence,
                prompt=tuple(row.tokens),
                rest=(row.tokens[-1],),
                kv_cache=row.kv_cache,
                max_tokens=sequence.max_tokens - row.generated,
                snapshots=(),
            )
        )
        self._by_inner[row.inner] = self._lone
        row.kv_cache = None
        self._lone = None

    # -- speculation --------------------------------------------------------

    def _limit(self, row: _Row, remaining: int) -> int:
        return max(
            0, min(row.sequence.draft_tokens, len(self.costs) - 1, remaining - 1)
        )

    def _speculate(self, key: int, row: _Row) -> StepResult:
        sequence = row.sequence
        remaining = sequence.max_tokens - row.generated
        draft = row.proposer.propose(row.tokens, self._limit(row, remaining))
        draft = draft[
            : best_draft_length(row.hits / row.trials, self.costs, len(draft))
        ]
        try:
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
        # The cache holds the last token and every proposal; keep the accepted ones.
        trim_prompt_cache(row.kv_cache, len(draft) - accepted)
        row.tokens.extend(emitted)
        row.generated += len(emitted)
        self._lone_steps += 1
        self._lone_tokens += len(emitted)
        if draft:
            row.misses = 0
            row.hits = ACCEPTANCE_DECAY * row.hits + accepted
            row.trials = ACCEPTANCE_DECAY * row.trials + accepted
            row.trials += accepted < len(draft)
            row.proposed += len(draft)
            row.accepted += accepted
            self.draft_proposed += len(draft)
            self.draft_accepted += accepted
        else:
            row.misses += 1
        scored = [None] * len(emitted)
        if sequence.logprobs is not None:
            scored = gather_logprobs(
                list(logprobs[: len(emitted)]), emitted, sequence.logprobs
            )
        done = row.generated >= sequence.max_tokens
        state = None
        if done:
            state = KVState(row.kv_cache, row.tokens[:-1])
            del self._rows[key]
            self._lone = None
        elif row.misses >= MISSES_BEFORE_REST:
            # Proposals stopped paying: decode in the batch for a while.
            row.rest_until = row.generated + row.rest
            row.rest = min(2 * row.rest, MAX_REST_TOKENS)
            self._join(row)
        return StepResult(
            key,
            tuple(emitted),
            tuple(scored),
            done=done,
            state=state,
            proposed=len(draft),
            accepted=accepted,
        )

    def _verify(self, row: _Row, draft: list[int]) -> tuple[list[int], mx.array]:
        """The model's token at the last token and after each proposal, sampled with
        the request's processors and sampler; and their log probabilities."""
        sequence = row.sequence
        inputs = [row.tokens[-1], *draft]
        logits = self._model(mx.array(inputs)[None], cache=row.kv_cache)[0]
        if sequence.processors:
            # Each position sees the tokens before it (penalties look back
            # ``history`` tokens), as plain decoding would have shown it.
            context = mx.array(row.tokens[-sequence.history :] + draft)
            head = min(len(row.tokens), sequence.history)
            rows = []
            for i in range(len(inputs)):
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


def make_decoder(model: nn.Module, options: LoadOptions) -> Decoder:
    """The decoder for a loaded model: the plain one (batched when its KV caches
    can be merged), speculating for a lone sequence unless that is turned off or
    the KV caches cannot be trimmed back past rejected proposals."""
    inner = make_plain_decoder(model, options)
    # Rotating (sliding-window) caches cannot always be trimmed back.
    growing = all(type(c) is KVCache for c in make_kv_cache(model, options.max_kv_size))
    if options.speculative == "off" or options.num_draft_tokens == 0 or not growing:
        logger.info("speculative decoding is off")
        return inner
    return SpeculativeDecoder(
        inner, model, options.num_draft_tokens, options.ngram_min, options.ngram_max
    )
