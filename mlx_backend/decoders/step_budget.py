"""The step budget: how much prefill a step carries while sequences decode.

While sequences decode, a batched step carries their decode tokens and, within the
budget, a chunk of the waiting prefill work, shared among the prompts being
prefilled, so that a short prompt is prefilled beside a long one instead of
waiting for it to end. The budget is time, measured as steps run (``PrefillPacer``):
a step that carries prefill takes at most ``STEP_MULTIPLE`` decode steps, and over
the steps of a prefill the running streams keep ``1 / MEAN_MULTIPLE`` of their
speed. Deep in a long prompt each token costs more (its attention reads the whole
context): the chunks shrink, down to one token where one costs more than a step
allows. With nothing decoding, prompts are prefilled in chunks of
``prefill_step_size``, as fast as the model goes.
"""

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_utils import make_kv_cache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# A step that carries prefill takes at most this many decode steps (where one
# prompt token's pass fits), and the steps of a prefill this many on average.
STEP_MULTIPLE = 2.5
MEAN_MULTIPLE = 1.6
# A chunk one token longer than the last is tried while the last took less than
# this share of a step's prefill time.
PROBE_BELOW = 0.8
# A prompt with at most this many tokens left prefills every step, on credit, and
# beside a longer one in a pass of its own.
SHORT_PROMPT_TOKENS = 64
# Decode steps alone whose median is a decode step's time.
DECODE_WINDOW = 9
# The load-time measurement's chunks: warm-ups, then timed ones that give a pass's
# fixed cost and a token's; the quickest of each size counts. A GPU warms up each
# size: it compiles kernels for a shape on first use (CUDA: tens of seconds, which
# made a token of a cold start's first chunk of 64 cost 0.5 s).
CPU_WARMUP_CHUNKS = (16,)
GPU_WARMUP_CHUNKS = (16, 64)
MEASURE_CHUNKS = (16, 64, 16, 64)
# Once each size has been timed, the chunks stop after this long (MLX's stock
# BLAS on 2 cores: 6 s for a chunk of 64, 12 s for them all).
MEASURE_SECONDS = 1.0
MEASURE_DECODE_STEPS = 4


@dataclass(frozen=True)
class StepCosts:
    """One sequence's decode step, a forward pass's fixed cost and a prompt
    token's, and a chunk's memory peak per token beyond the KV it adds."""

    decode_s: float
    pass_s: float
    token_s: float
    peak_bytes_per_token: int


def measure_step_costs(model: nn.Module, options: LoadOptions) -> StepCosts:
    """Timed on a fresh cache: prefill chunks of two sizes, then decode steps."""
    cache = make_kv_cache(model, options)
    cpu = mx.default_device() == mx.cpu
    warmup = CPU_WARMUP_CHUNKS if cpu else GPU_WARMUP_CHUNKS
    length = sum(warmup) + sum(MEASURE_CHUNKS)
    prompt = mx.array([[(7 * i) % 97 + 1 for i in range(length)]])
    start = 0

    def prefill(size: int) -> float:
        nonlocal start
        tic = time.perf_counter()
        model(prompt[:, start : start + size], cache=cache)
        mx.eval([layer.state for layer in cache])
        start += size
        return time.perf_counter() - tic

    for size in warmup:
        prefill(size)
    small, large = min(MEASURE_CHUNKS), max(MEASURE_CHUNKS)
    timed, seconds = [], []
    for size in MEASURE_CHUNKS:
        # Only after a large chunk: the memory peak is the last chunk's.
        done = set(timed) == {small, large} and timed[-1] == large
        if done and sum(seconds) > MEASURE_SECONDS:
            break
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        seconds.append(prefill(size))
        timed.append(size)
    added = mx.get_active_memory() - before
    peak = max(mx.get_peak_memory() - before - added, 0)
    quickest = {
        size: min(s for n, s in zip(timed, seconds) if n == size)
        for size in (small, large)
    }
    token_s = max((quickest[large] - quickest[small]) / (large - small), 1e-9)
    pass_s = max(quickest[small] - small * token_s, 0.0)
    steps = []
    for _ in range(MEASURE_DECODE_STEPS):
        tic = time.perf_counter()
        mx.eval(model(prompt[:, -1:], cache=cache), [layer.state for layer in cache])
        steps.append(time.perf_counter() - tic)
    decode_s = sorted(steps[1:])[len(steps[1:]) // 2]
    return StepCosts(decode_s, pass_s, token_s, peak // large)


@dataclass(frozen=True)
class StepBudget:
    """What bounds the prefill a step carries while sequences decode: the prompt
    and decode tokens of the option ``step_token_budget`` (``tokens``), or time as
    measured (``costs``: the load's measurement, the pacer's first estimate);
    neither: whole chunks of ``prefill_step_size``."""

    reason: str
    tokens: int = 0
    costs: StepCosts | None = None

    @property
    def timed(self) -> bool:
        return not self.tokens and self.costs is not None

    def describe(self) -> str:
        if self.tokens:
            return f"step token budget {self.tokens} ({self.reason})"
        if self.costs is None:
            return f"no step budget ({self.reason})"
        return (
            f"step budget {STEP_MULTIPLE:g} decode steps at most, "
            f"{MEAN_MULTIPLE:g} on average ({self.reason}: a decode step "
            f"{self.costs.decode_s * 1e3:.1f} ms, a prefill pass "
            f"{self.costs.pass_s * 1e3:.1f} ms plus "
            f"{self.costs.token_s * 1e3:.2f} ms a token)"
        )


# Chunks of ``prefill_step_size`` whatever runs (a group, or a decoder built alone).
NO_STEP_BUDGET = StepBudget("none")


def choose_step_budget(option: int | None, costs: StepCosts | None) -> StepBudget:
    """The budget ``step_token_budget`` sets (0: none), or time as measured."""
    if option is not None:
        return StepBudget(f"step_token_budget:{option}", tokens=option)
    if costs is None:
        return StepBudget("not measured")
    return StepBudget("measured", costs=costs)


class PrefillPacer:
    """Each step's prefill while sequences decode, from the steps it has seen.

    A decode step's time is the median of the latest steps without prefill (nor a
    sequence starting to decode) while no prefill was under way. A prompt token's
    is learnt from each step with prefill (its time less a decode step, over its
    prompt tokens: ``TokenCost``), apart for the prompt batch's rows and for a
    short prompt prefilled in a pass of its own, from the load's one-token pass
    (at least a decode step) at the start of each prefill. Every step credits
    prefill time, so that steps take ``MEAN_MULTIPLE`` decode steps on average;
    once the credit holds a whole step's worth (``STEP_MULTIPLE`` less one decode
    step) a step spends it, on the tokens it buys, or on one token where one costs
    more. Few larger chunks pay a forward pass's fixed cost less often than a
    small chunk every step.
    """

    def __init__(self, budget: StepBudget, step_size: int):
        self.budget = budget
        self._step_size = step_size
        costs = budget.costs
        self._decodes: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._first_decode_s = costs.decode_s if costs else 0.0
        # As the load measured a pass of one token: a prefill's first chunk is
        # small, whatever the last one's depth cost.
        self._first_token_s = (costs.pass_s + costs.token_s) if costs else 0.0
        # The prompt batch's rows, and a short prompt in a pass of its own: their
        # tokens cost apart (a long prompt's deep in its context).
        self._batched = TokenCost()
        self._alone = TokenCost()
        # Prefill seconds the steps have earned; None: no prefill under way.
        self._credit: float | None = None
        # The prompt tokens of the last step planned with a budget.
        self.tokens = budget.tokens

    @property
    def decode_s(self) -> float:
        if not self._decodes:
            return self._first_decode_s
        return statistics.median(self._decodes)

    def chunk(
        self,
        decoding: int,
        prefilling: int,
        short: bool = False,
        joining: bool = False,
        alone: bool = False,
    ) -> int:
        """Prompt tokens per prefilling row this step (0: none this step), with
        ``decoding`` sequences decoding and ``prefilling`` prompts prefilling;
        ``short``: one of them is a short prompt, prefilled every step on credit
        (a one-line request must not wait for a long prompt's turns); ``alone``:
        that short prompt prefills in a pass of its own; ``joining``: a sequence
        starts decoding this step (its KV joins the batch's), and no prefill runs
        beside it."""
        budget = self.budget
        if not (decoding and prefilling and (budget.tokens or budget.timed)):
            self._credit = None
            return self._step_size
        short = short or alone
        if budget.tokens:
            total = budget.tokens - decoding
        else:
            whole = (STEP_MULTIPLE - 1) * self.decode_s
            # A prefill starts with a whole step's worth, and never banks more.
            earned = (MEAN_MULTIPLE - 1) * self.decode_s
            if self._credit is None:
                self._credit = whole
                # A one-token pass reads every weight, as a decode step does: the
                # load's measurement of its fixed cost can come out near zero.
                first_s = max(self._first_token_s, self.decode_s)
                self._batched.restart(first_s)
                self._alone.restart(first_s)
            self._credit = min(self._credit + earned, whole)
            if self._credit < whole * (1 - 1e-9) and not short:
                return 0
            cost = self._alone if alone else self._batched
            total = cost.tokens_within(whole, prefilling)
        self.tokens = max(total, prefilling)
        if joining:
            return 0
        return min(self._step_size, max(1, total // prefilling))

    def observe(
        self,
        seconds: float,
        decoding: int,
        prompt_tokens: int,
        joined: bool = False,
        alone: bool = False,
    ) -> None:
        """A step took ``seconds``, with ``decoding`` sequences decoding and
        ``prompt_tokens`` prefilled (``alone``: by a short prompt in a pass of its
        own); ``joined``: sequences started decoding in it (their KV joined the
        batch's)."""
        if not decoding:
            return
        if not prompt_tokens:
            # Beside a prefill, decode steps alone took 1.2-1.5x theirs before it
            # (the streams' time the budget is a multiple of).
            if not joined and self._credit is None:
                self._decodes.append(seconds)
            return
        if not self.budget.timed:
            return
        spent = max(seconds - self.decode_s, 1e-6)
        if self._credit is not None:
            self._credit -= spent
        (self._alone if alone else self._batched).learn(prompt_tokens, spent)


class TokenCost:
    """A prompt token's seconds in a step, fixed cost included, as learnt from
    the steps: from a first estimate at each prefill's start, up at once when a
    step ran over, down by half the way; since a chunk's tokens share a pass's
    fixed cost, a chunk a token a row longer is tried while the last left room."""

    def __init__(self):
        self.restart(0.0)

    def restart(self, first_s: float) -> None:
        self.token_s = first_s
        # The last step's prompt tokens and their seconds.
        self.last = (0, 0.0)

    def tokens_within(self, seconds: float, rows: int) -> int:
        """The prompt tokens of ``rows`` rows that fit in ``seconds``."""
        total = max(1, int(seconds / self.token_s))
        last, spent = self.last
        if total <= last and spent < PROBE_BELOW * seconds:
            total = last + rows
        return total

    def learn(self, tokens: int, seconds: float) -> None:
        self.last = (tokens, seconds)
        seen = seconds / tokens
        self.token_s = seen if seen > self.token_s else (self.token_s + seen) / 2


# A one-pass step that carries prompt tokens beside decode rows takes about this
# many times what its decode rows alone would: the pass reads the weights once for
# both, so prompt tokens cost only their own compute, and a prompt gets two thirds
# of the machine while sequences decode.
PASS_MULTIPLE = 3.0
# Steps the one-pass cost model's attention term is fitted over.
COST_WINDOW = 64
# Key reads per unit of the cost model's attention term.
KEYS_UNIT = 1000.0


@dataclass(frozen=True)
class PassWork:
    """What a one-pass step computes: its tokens on the axis, and its attention's
    key reads (each token's context, summed, in ``KEYS_UNIT``s)."""

    tokens: int
    keys: float


class PassPacer:
    """The prompt tokens each one-pass step carries beside its decode rows.

    The option ``step_token_budget`` sets a step's tokens, decode rows included.
    Otherwise, while sequences decode, a step takes about ``PASS_MULTIPLE`` times
    what its decode rows alone would. A step's seconds are modelled as a pass's
    fixed cost and a cost per token (projections and MLPs), as the load measured
    them, and a cost per key read (attention, which grows with each sequence's
    depth), fitted to the latest steps by least squares; so deep in a long prompt,
    or beside deep streams, the chunks shrink to what fits. With nothing
    decoding, ``step_size`` tokens a step.
    """

    def __init__(self, budget: StepBudget, step_size: int):
        self.budget = budget
        self._step_size = step_size
        costs = budget.costs
        # The load's measurement: a pass's fixed cost and a token's. A one-token
        # pass reads every weight, as a decode step does: the fixed cost is at
        # least that step's less its token (measured apart, it came out near 0).
        self._token_s = costs.token_s if costs else 0.0
        self._pass_s = (
            max(costs.pass_s, costs.decode_s - costs.token_s) if costs else 0.0
        )
        # Recent steps' key reads and the seconds they took beyond the rest.
        self._keys: deque[tuple[float, float]] = deque(maxlen=COST_WINDOW)
        self._key_s = 0.0
        # The prompt tokens of the last step planned with a budget.
        self.tokens = budget.tokens

    def prompt_tokens(self, rows: PassWork, depth: int) -> int:
        """Prompt tokens a step may carry beside decode ``rows`` (none: 0 rows),
        for prompts ``depth`` tokens deep."""
        budget = self.budget
        if not rows.tokens or not (budget.tokens or budget.timed):
            return self._step_size
        if budget.tokens:
            return max(1, budget.tokens - rows.tokens)
        fixed, per_token, per_key = self._pass_s, self._token_s, self._key_s
        alone = fixed + per_token * rows.tokens + per_key * rows.keys
        room = (PASS_MULTIPLE - 1) * alone
        # A chunk of n tokens reads about n * (depth + n / 2) keys.
        n = self._step_size
        for _ in range(3):
            cost = per_token + per_key * (depth + n / 2) / KEYS_UNIT
            n = min(self._step_size, max(1, int(room / max(cost, 1e-9))))
        self.tokens = n
        return n

    def observe(self, seconds: float, work: PassWork, prompt_tokens: int) -> None:
        """A step took ``seconds`` for ``work``, ``prompt_tokens`` of its tokens
        from prompts."""
        if not self.budget.timed or work.tokens == prompt_tokens:
            return
        beyond = seconds - self._pass_s - self._token_s * work.tokens
        self._keys.append((work.keys, beyond))
        # Least squares through the origin: the seconds per unit of key reads.
        reads = sum(k * k for k, _ in self._keys)
        if reads > 0:
            self._key_s = max(0.0, sum(k * b for k, b in self._keys) / reads)
