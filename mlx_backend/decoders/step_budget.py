"""The per-step token budget, measured on the loaded model.

While sequences decode, each batched step carries their decode tokens and, within
the budget, a chunk of the waiting prefill work, shared among the prompts being
prefilled. A long prompt then holds the running streams back by about the same
short time each step, and a short prompt is prefilled beside it instead of
waiting for it to end. With nothing decoding, prompts are prefilled in chunks of
``prefill_step_size``, as fast as the model goes.
"""

import logging
import math
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_utils import make_kv_cache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# A budgeted step spends this share of its time on prefill: a long prompt
# prefills at about this share of its speed alone while streams decode, and a
# step takes a few plain decode steps' time.
PREFILL_SHARE = 2 / 3
# Prompt tokens per prefilling row and step at least, however many rows or how
# deep the context.
MIN_CHUNK = 16
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
    """Tokens a step carries while sequences decode (0: no budget), and why."""

    tokens: int
    reason: str
    # What the measurement found, when there was one.
    costs: StepCosts | None = None

    def describe(self) -> str:
        if not self.tokens:
            return f"no step token budget ({self.reason})"
        text = f"step token budget {self.tokens} ({self.reason}"
        if self.costs is not None:
            text += (
                f": a decode step {self.costs.decode_s * 1e3:.1f} ms, a prefill "
                f"pass {self.costs.pass_s * 1e3:.1f} ms plus "
                f"{self.costs.token_s * 1e3:.2f} ms a token"
            )
        return text + ")"

    def applies(self, decoding: int, prefilling: int) -> bool:
        return bool(self.tokens and decoding and prefilling)

    def chunk(
        self, decoding: int, prefilling: int, step_size: int, scale: float = 1.0
    ) -> int:
        """Prompt tokens per prefilling row this step, with ``decoding``
        sequences decoding and ``prefilling`` prompts being prefilled, and the
        budget's prefill ``scale``d (``DepthScale``)."""
        if not self.applies(decoding, prefilling):
            return step_size
        share = int((self.tokens - decoding) * scale) // prefilling
        return min(step_size, max(MIN_CHUNK, share))


# Chunks of ``prefill_step_size`` whatever runs (a group, or a decoder built alone).
NO_STEP_BUDGET = StepBudget(0, "none")


class DepthScale:
    """Deep in a long context each prompt token costs more (attention reads the
    whole context): the budget's chunks shrink until a budgeted step takes the
    time it took at the start, measured step by step."""

    def __init__(self, budget: StepBudget):
        self.value = 1.0
        costs = budget.costs
        # A step's fixed time (a decode pass, a prefill pass), and its prefill's.
        self._fixed = costs.decode_s + costs.pass_s if costs else 0.0
        self._prefill = budget.tokens * costs.token_s if costs else 0.0

    def observe(self, seconds: float) -> None:
        """A budgeted step took ``seconds``: half a step towards the scale that
        would have taken the budget's time (never above the budget)."""
        if not self._prefill:
            return
        spent = max(seconds - self._fixed, self._prefill / 100)
        self.value = min(1.0, max(0.01, self.value * math.sqrt(self._prefill / spent)))

    def reset(self) -> None:
        self.value = 1.0


def choose_step_budget(option: int | None, step_size: int, costs: StepCosts | None):
    """The budget ``step_token_budget`` sets (0: none), or as measured: the
    tokens whose prefill takes ``PREFILL_SHARE`` of a step that also runs a
    decode pass and a prefill pass's fixed cost."""
    if option is not None:
        return StepBudget(option, f"step_token_budget:{option}")
    if costs is None:
        return StepBudget(step_size, "not measured: prefill_step_size")
    fixed = costs.decode_s + costs.pass_s
    tokens = round(PREFILL_SHARE / (1 - PREFILL_SHARE) * fixed / costs.token_s)
    tokens = min(step_size, max(MIN_CHUNK, tokens // 8 * 8))
    return StepBudget(tokens, "measured", costs)
