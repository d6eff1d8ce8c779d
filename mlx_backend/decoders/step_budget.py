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
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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
    token's, a chunk's memory peak per token beyond the KV it adds, and a token's
    cost in a small chunk beyond a decode step's (0: not measured): small chunks
    run on other kernels than large ones."""

    decode_s: float
    pass_s: float
    token_s: float
    peak_bytes_per_token: int
    chunk_token_s: float = 0.0


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
    # Noise can put a small chunk near a decode step; a chunk's size divides by this.
    chunk_token_s = max((quickest[small] - decode_s) / (small - 1), token_s / 2)
    return StepCosts(decode_s, pass_s, token_s, peak // large, chunk_token_s)


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
            f"{self.costs.token_s * 1e3:.2f} ms a token, "
            f"{self.costs.chunk_token_s * 1e3:.2f} in a small chunk)"
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
# many times what its decode rows alone take: the pass reads the weights once for
# both, so prompt tokens cost only their own compute, and a prompt gets two thirds
# of the machine while sequences decode.
PASS_MULTIPLE = 3.0
# A step takes at most this many: steps that carry a deep prompt's chunk spend what
# steps without one banked.
PASS_MOST = 3.5
# Steps the step cost is fitted over.
COST_WINDOW = 64
# Key reads per unit of the cost model's attention term.
KEYS_UNIT = 1000.0
# The load's measurement counts as this many steps in the fit.
PRIOR_STEPS = 2
# A prompt deeper than this, and than twice what the fit has seen, first runs a
# chunk of at most PROBE_TOKENS.
PROBE_DEPTH = 512
PROBE_TOKENS = 2
# A token's cost in the fit is never below this share of the load's measurement.
LEAST_TOKEN_SHARE = 0.25
# Up to this many tokens on a pass's axis, the CPU's quantized matmuls run their
# row kernels; past it they dequantize the weights for sgemm, and each token more
# costs less (``rows_limit`` in cpu/kernels). The fit takes a token's cost apart on
# each side.
ROW_KERNEL_TOKENS = 32


@dataclass(frozen=True)
class PassWork:
    """What a one-pass step computes, or a part of it (its decode rows, its
    prompt chunks): tokens on the axis, attention's key reads (each token's
    context, summed: its compute), and the keys its sequences hold (each
    sequence's context, summed: the KV it reads from memory, once for all its
    tokens), both in ``KEYS_UNIT``s."""

    tokens: int
    keys: float
    held: float = 0.0

    def __add__(self, other: "PassWork") -> "PassWork":
        return PassWork(
            self.tokens + other.tokens, self.keys + other.keys, self.held + other.held
        )


NO_WORK = PassWork(0, 0.0)


def chunk_work(tokens: int, depth: int) -> PassWork:
    """A prompt chunk's work: ``tokens`` after the ``depth`` its sequence holds."""
    keys = tokens * depth + tokens * (tokens + 1) / 2
    return PassWork(tokens, keys / KEYS_UNIT, (depth + tokens) / KEYS_UNIT)


class PassPacer:
    """The prompt tokens each one-pass step carries beside its decode rows.

    The option ``step_token_budget`` sets a step's tokens, decode rows included.
    Otherwise, while sequences decode, a step takes about ``PASS_MULTIPLE`` times
    what its decode rows alone take: the median of the latest steps without a
    chunk for as many rows (the streams' pace, which the budget keeps), or else
    the fitted cost of a step (``StepCost``), from every step, decode rows',
    verifying rows' and chunks' alike. A chunk costs what it adds to its step's
    fitted cost, so deep in a long prompt the chunks shrink to what fits; where
    not one token fits, steps bank their room and the next spends it, at most
    ``PASS_MOST`` times the rows'. With nothing decoding, ``step_size`` tokens a
    step.
    """

    def __init__(self, budget: StepBudget, step_size: int):
        self.budget = budget
        self._step_size = step_size
        # Decode steps alone: (rows, seconds).
        self._decodes: deque[tuple[int, float]] = deque(maxlen=DECODE_WINDOW)
        self._fit = StepCost(budget.costs) if budget.costs else None
        # Prompt seconds the steps have earned while prompts wait.
        self._credit = 0.0
        # The prompt tokens of the last step planned with a budget.
        self.tokens = budget.tokens

    def alone_s(self, rows: PassWork, read: bool = False) -> float:
        """A step's seconds for decode ``rows`` alone (``read``: planned after
        the last step was read)."""
        seen = [s for n, s in self._decodes if n == rows.tokens]
        if len(seen) * 2 > len(self._decodes):
            return statistics.median(seen)
        return self._fit.seconds(rows, read)

    def chunks(
        self, rows: PassWork, prompts: Sequence[tuple[int, int]], read: bool = False
    ) -> list[int]:
        """The tokens of each waiting prompt, given as (tokens held, tokens left)
        in the order they take a step, that the step carries beside decode
        ``rows`` (0 rows: none decode); ``read``: the step is planned after the
        last one was read (its rows verify proposals)."""
        budget = self.budget
        if not prompts:
            self._credit = 0.0
            return []
        if not rows.tokens or not (budget.tokens or budget.timed):
            return shared(self._step_size, prompts)
        if budget.tokens:
            return shared(max(1, budget.tokens - rows.tokens), prompts)
        alone = self.alone_s(rows, read)
        earned, most = (PASS_MULTIPLE - 1) * alone, (PASS_MOST - 1) * alone
        credit = min(self._credit + earned, most)
        out, work = [], rows
        for held, left in prompts:
            fits = self._fits(credit, work, held, left)
            if fits < 1:
                if out or credit < most * (1 - 1e-9):
                    # A deep prompt's KV is read whatever the chunk: rather than
                    # a token over the room every step, fewer steps carry more.
                    break
                # Even the most a step may take can't pay for reading its KV:
                # the step overruns by that read, so the rest of its room goes
                # to tokens beside it, not to one token.
                read_s = self._fit.added(work, chunk_work(0, held))
                fits = self._fits(credit + read_s, work, held, left)
            n = max(1, fits)
            if held > max(2 * self._fit.deepest, PROBE_DEPTH):
                # Far deeper than the fit has seen (a prompt-cache hit): a small
                # chunk tells what its KV costs to read (two tokens: for one,
                # the keys it reads and holds are the same number).
                n = min(n, PROBE_TOKENS)
            part = chunk_work(n, held)
            credit -= self._fit.added(work, part)
            work += part
            out.append(n)
        self._credit = credit
        self.tokens = sum(out)
        return out + [0] * (len(prompts) - len(out))

    def _fits(self, seconds: float, work: PassWork, depth: int, left: int) -> int:
        """The most tokens, up to ``left`` and a step's size, of a chunk ``depth``
        deep that add at most ``seconds`` to a step of ``work``."""
        low, high = 0, min(self._step_size, left)
        while low < high:
            n = (low + high + 1) // 2
            if self._fit.added(work, chunk_work(n, depth)) <= seconds:
                low = n
            else:
                high = n - 1
        return low

    def observe(
        self, seconds: float, rows: PassWork, chunk: PassWork, read: bool = False
    ) -> None:
        """A step took ``seconds`` for decode ``rows`` and prompt ``chunk``s
        (``read``: planned after the last step was read)."""
        if not self.budget.timed or not rows.tokens:
            return
        if not chunk.tokens:
            self._decodes.append((rows.tokens, seconds))
        self._fit.add(rows + chunk, read, seconds, chunk.held * KEYS_UNIT)


def shared(tokens: int, prompts: Sequence[tuple[int, int]]) -> list[int]:
    """``tokens`` shared among ``prompts`` (tokens held, tokens left) in order."""
    out = []
    for _, left in prompts:
        out.append(min(tokens, left))
        tokens -= out[-1]
    return out


class StepCost:
    """A one-pass step's seconds as ``c . x``, where x counts a pass, the host's
    planning (where the step was planned after the last one was read: it is not
    hidden behind the device then), its tokens up to ``ROW_KERNEL_TOKENS`` and
    past them (projections and MLPs), the keys its sequences hold (attention
    reads each one's KV from memory once a step) and the keys its tokens read
    (attention's compute). Fitted by least squares to the latest ``COST_WINDOW``
    steps and to the load's measurement (a decode step and chunks of two sizes,
    ``PRIOR_STEPS`` steps' worth each), no coefficient below zero."""

    def __init__(self, costs: StepCosts):
        self._steps: deque[tuple[np.ndarray, float, float]] = deque(maxlen=COST_WINDOW)
        self._xx = np.zeros((6, 6))
        self._xy = np.zeros(6)
        small, large = min(MEASURE_CHUNKS), max(MEASURE_CHUNKS)
        # Small chunks run on other kernels than large ones.
        small_s = costs.chunk_token_s or costs.token_s
        seen = (
            (1, costs.decode_s),
            (small, costs.decode_s + (small - 1) * small_s),
            (
                large,
                costs.decode_s
                + (small - 1) * small_s
                + (large - small) * costs.token_s,
            ),
        )
        for tokens, seconds in seen:
            x = features(PassWork(tokens, 0.0), False)
            self._xx += PRIOR_STEPS * np.outer(x, x)
            self._xy += PRIOR_STEPS * x * seconds
        # Planning, and keys, cost nothing until the steps show otherwise (a weak
        # pull, which keeps the fit solvable while they barely change).
        for i in (1, 4, 5):
            self._xx[i, i] += 1.0
        # A token never costs less than a share of the load's measurement: a
        # chunk's size divides by it.
        self._least = LEAST_TOKEN_SHARE * np.array([small_s, costs.token_s])
        self._solve()

    @property
    def deepest(self) -> float:
        """The most keys a chunk's sequence held in a fitted step (in tokens)."""
        return max((depth for _, _, depth in self._steps), default=0.0)

    def seconds(self, work: PassWork, read: bool = False) -> float:
        return float(self.coefficients @ features(work, read))

    def added(self, work: PassWork, more: PassWork) -> float:
        """What ``more`` adds to a step of ``work``."""
        return self.seconds(work + more) - self.seconds(work)

    def add(self, work: PassWork, read: bool, seconds: float, depth: float) -> None:
        """A step of ``work`` took ``seconds``; ``depth``: its deepest chunk's
        keys held."""
        if len(self._steps) == self._steps.maxlen:
            x, y, _ = self._steps[0]
            self._xx -= np.outer(x, x)
            self._xy -= x * y
        x = features(work, read)
        self._steps.append((x, seconds, depth))
        self._xx += np.outer(x, x)
        self._xy += x * seconds
        self._solve()

    def _solve(self) -> None:
        c = np.array(nonnegative_solve(self._xx, self._xy))
        c[2:4] = np.maximum(c[2:4], self._least)
        self.coefficients = c


def features(work: PassWork, read: bool) -> np.ndarray:
    """A step's terms in the cost fit (``StepCost``)."""
    return np.array(
        [
            1.0,
            float(read),
            min(work.tokens, ROW_KERNEL_TOKENS),
            max(work.tokens - ROW_KERNEL_TOKENS, 0),
            work.held,
            work.keys,
        ]
    )


def nonnegative_solve(xx: np.ndarray, xy: np.ndarray) -> tuple[float, ...]:
    """The least-squares coefficients of normal equations ``xx c = xy`` with
    none below zero: the most negative one is dropped and the rest solved again."""
    kept = list(range(len(xy)))
    while True:
        c = np.linalg.solve(xx[np.ix_(kept, kept)], xy[kept])
        if c.min() >= 0 or len(kept) == 1:
            out = [0.0] * len(xy)
            for i, value in zip(kept, c):
                out[i] = max(float(value), 0.0)
            return tuple(out)
        del kept[int(np.argmin(c))]
