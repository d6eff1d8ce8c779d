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
# While a short prompt prefills, beside a long one in a padded batch whose pass
# costs about two decode steps even at a token a row, a step may take this many.
SHORT_STEP_MULTIPLE = 3.5
# A chunk one token longer than the last is tried while the last took less than
# this share of a step's prefill time.
PROBE_BELOW = 0.8
# A prompt with at most this many tokens left prefills every step, on credit.
SHORT_PROMPT_TOKENS = 64
# Decode steps alone whose median is a decode step's time.
DECODE_WINDOW = 9
# The load-time measurement's chunks: the first warms up, the later ones give a
# pass's fixed cost and a token's; the quickest of each size counts.
MEASURE_CHUNKS = (16, 16, 64, 16, 64)
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
    prompt = mx.array([[(7 * i) % 97 + 1 for i in range(sum(MEASURE_CHUNKS))]])
    start = 0

    def prefill(size: int) -> float:
        nonlocal start
        tic = time.perf_counter()
        model(prompt[:, start : start + size], cache=cache)
        mx.eval([layer.state for layer in cache])
        start += size
        return time.perf_counter() - tic

    prefill(MEASURE_CHUNKS[0])
    small, large = min(MEASURE_CHUNKS), max(MEASURE_CHUNKS)
    timed, seconds = [], []
    for size in MEASURE_CHUNKS[1:]:
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
    sequence starting to decode). A prompt token's is learnt from each step with
    prefill (its time less a decode step, over its prompt tokens, the pass's fixed
    cost included), from the load's one-token pass at the start of each prefill:
    up at once when a step ran over, down by half the way; since a chunk's tokens
    share a pass's fixed cost, a chunk a token a row longer is tried while the
    last left room. Every step credits prefill time, so that steps take
    ``MEAN_MULTIPLE`` decode steps on average; once the credit holds a whole
    step's worth (``STEP_MULTIPLE`` less one decode step) a step spends it, on the
    tokens it buys, or on one token where one costs more. Few larger chunks pay a
    forward pass's fixed cost less often than a small chunk every step.
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
        self.token_s = self._first_token_s
        # Prefill seconds the steps have earned; None: no prefill under way.
        self._credit: float | None = None
        # The prompt tokens of the last step planned with a budget.
        self.tokens = budget.tokens
        # The last step with prefill: its prompt tokens and their seconds.
        self._last = (0, 0.0)

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
    ) -> int:
        """Prompt tokens per prefilling row this step (0: none this step), with
        ``decoding`` sequences decoding and ``prefilling`` prompts prefilling;
        ``short``: one of them is a short prompt, prefilled every step on credit
        and in steps of up to ``SHORT_STEP_MULTIPLE`` (a one-line request must
        not wait for a long prompt's turns); ``joining``: a sequence starts
        decoding this step, with a pass of its own, and no prefill runs beside
        it."""
        budget = self.budget
        if not (decoding and prefilling and (budget.tokens or budget.timed)):
            self._credit = None
            return self._step_size
        if budget.tokens:
            total = budget.tokens - decoding
        else:
            whole = (STEP_MULTIPLE - 1) * self.decode_s
            # A prefill starts with a whole step's worth, and never banks more.
            earned = (MEAN_MULTIPLE - 1) * self.decode_s
            if self._credit is None:
                self._credit, self.token_s = whole, self._first_token_s
                self._last = (0, 0.0)
            self._credit = min(self._credit + earned, whole)
            if self._credit < whole * (1 - 1e-9) and not short:
                return 0
            if short:
                whole = (SHORT_STEP_MULTIPLE - 1) * self.decode_s
            total = max(1, int(whole / self.token_s))
            last, spent = self._last
            if total <= last and spent < PROBE_BELOW * whole:
                # Tokens share a pass's fixed cost: one more a row may fit.
                total = last + prefilling
        self.tokens = max(total, prefilling)
        if joining:
            return 0
        return min(self._step_size, max(1, total // prefilling))

    def observe(
        self, seconds: float, decoding: int, prompt_tokens: int, joined: bool = False
    ) -> None:
        """A step took ``seconds``, with ``decoding`` sequences decoding and
        ``prompt_tokens`` prefilled; ``joined``: sequences started decoding in it
        (each with a pass of its own)."""
        if not decoding:
            return
        if not prompt_tokens:
            if not joined:
                self._decodes.append(seconds)
            return
        if not self.budget.timed:
            return
        spent = max(seconds - self.decode_s, 1e-6)
        if self._credit is not None:
            self._credit -= spent
        self._last = (prompt_tokens, spent)
        seen = spent / prompt_tokens
        self.token_s = seen if seen > self.token_s else (self.token_s + seen) / 2
