"""What the SIMD kernels multiply the weights with, chosen once per load: float32
x, or x rounded to int8 (integer dot products), for a decode's few rows (the row
kernels) and for a prompt's many (the int8 GEMM against sgemm tiles) apart.

``kernel_activations`` pins both; ``auto`` takes the host's
``MLX_BACKEND_KERNEL_ACTIVATIONS`` if set, else measures the model's own products
both ways at load and takes int8 wherever it is faster by ``INT8_MARGIN``. Rounding
x moves the next-token distributions a little (mean KL about 0.0004 on the row
kernels and 0.0008 on a prompt's GEMM on the default model, docs/cpu-kernels.md).
"""

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_backend.cpu.kernels import runs_on_kernels
from mlx_backend.switches import host_setting
from python_utils import KERNEL_ACTIVATIONS

logger = logging.getLogger(__name__)

ACTIVATIONS_ENV = "MLX_BACKEND_KERNEL_ACTIVATIONS"
# int8 is taken where its time is at most this share of float32's: a tie keeps
# float32's exact logprobs.
INT8_MARGIN = 0.97
# The decode side's rows of x (one stream; a batch's, on the int8 GEMM from the
# kernels' gemm_rows), and the prefill side's (a server's prompt chunk).
DECODE_ROWS = (1, 16)
PREFILL_ROWS = (256,)
# How much of the model each side multiplies per measurement: a decode step's
# products up to this many weight bytes (skipping any that would pass it), and a
# layer's for the prefill side.
DECODE_BYTES = 64 << 20
# Multiply-adds a prefill measurement may take a round: the first block's
# products in order up to this (at least one), so that a large model's load
# spends about a second, not a block's worth of prompt, on it.
PREFILL_WORK = 2e9
ROUNDS = 5


@dataclass(frozen=True)
class Activations:
    """What x meets the weights as, and what decided it."""

    decode: str
    prefill: str
    reason: str
    # int8's time over float32's (decode, prefill), where measured.
    measured: tuple[float, float] | None = None

    def describe(self) -> str:
        sides = (
            f"{self.decode} activations"
            if self.decode == self.prefill
            else f"{self.decode} activations decoding, {self.prefill} prefilling"
        )
        text = f"{sides} ({self.reason}"
        if self.measured:
            text += ": int8/float32 time, decode {:.2f}, prefill {:.2f}".format(
                *self.measured
            )
        return text + ")"


def activations_setting(option: str, environ) -> tuple[str, str]:
    """The mode and what set it: the option unless ``auto``, else the host's
    ``MLX_BACKEND_KERNEL_ACTIVATIONS``, else ``auto``."""
    return host_setting(
        option, "kernel_activations", environ, ACTIVATIONS_ENV, KERNEL_ACTIVATIONS
    )


def kernel_products(model: nn.Module) -> list[tuple[str, tuple]]:
    """The model's quantized products the kernels take, in path order: their
    paths, and (weight, scales, biases, group_size, bits). An embedding counts
    only as the output layer (tied: no other product has its shape); otherwise
    it only looks rows up."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and (
            runs_on_kernels(module)
        ):
            parts = ("weight", "scales", "biases")
            product = (*(module[k] for k in parts), module.group_size, module.bits)
            found.append((path, product, isinstance(module, nn.QuantizedEmbedding)))
    shapes = [p[0].shape for _, p, lookup in found if not lookup]
    return sorted(
        (path, p) for path, p, lookup in found if not lookup or p[0].shape not in shapes
    )


def first_layer(products: list[tuple[str, tuple]]) -> list[tuple]:
    """The products of the model's first block (``...layers.0.``), or its first
    four where it has no such path."""
    for path, _ in products:
        head, found, _ = path.partition(".layers.0.")
        if found:
            prefix = head + found
            return [p for path, p in products if path.startswith(prefix)]
    return [p for _, p in products[:4]]


def time_products(qmm, products: list[tuple], rows: int, activations: str) -> float:
    """Seconds for ``products`` on ``rows`` rows of x under ``activations``, all
    in one evaluation."""
    qmm.set_activations(activations)
    xs = [
        mx.random.normal((rows, w.shape[1] * 32 // bits), key=mx.random.key(i))
        for i, (w, _, _, _, bits) in enumerate(products)
    ]
    mx.eval(xs)
    start = time.perf_counter()
    mx.eval([qmm.quantized_matmul(x, *p) for x, p in zip(xs, products)])
    return time.perf_counter() - start


def speed_ratio(qmm, products: list[tuple], rows: int) -> float:
    """int8's time over float32's on ``products`` at ``rows`` rows: the best of
    ROUNDS each, the two interleaved."""
    best = {"float32": float("inf"), "int8": float("inf")}
    for _ in range(ROUNDS):
        for activations in best:
            seconds = time_products(qmm, products, rows, activations)
            best[activations] = min(best[activations], seconds)
    return best["int8"] / best["float32"]


def up_to(products: list[tuple], cost, budget: float) -> list[tuple]:
    """``products`` in order, skipping any that would take the total ``cost``
    past ``budget``; the first always."""
    chosen, spent = [], 0.0
    for p in products:
        if spent + cost(p) <= budget or not chosen:
            chosen.append(p)
            spent += cost(p)
    return chosen


def measure(qmm, model: nn.Module) -> tuple[float, float]:
    """int8's time over float32's on the model's decode products (the mean of
    its ratios at DECODE_ROWS, so one stream counts as much as a batch) and on
    its first block at PREFILL_ROWS."""
    products = kernel_products(model)
    decode = up_to(
        [p for _, p in products], lambda p: sum(a.nbytes for a in p[:3]), DECODE_BYTES
    )
    prefill = up_to(
        first_layer(products),
        lambda p: float(p[0].size) * 32 / p[4] * max(PREFILL_ROWS),
        PREFILL_WORK,
    )
    settings = qmm.settings()
    try:
        ratios = [
            sum(speed_ratio(qmm, chosen, rows) for rows in counts) / len(counts)
            for chosen, counts in ((decode, DECODE_ROWS), (prefill, PREFILL_ROWS))
        ]
    finally:
        qmm.set_activations(settings["activations"], settings["prefill_activations"])
    return ratios[0], ratios[1]


def choose_activations(qmm, model: nn.Module, option: str, environ) -> Activations:
    """What the kernels multiply with for ``model``: the option, the host's
    setting, or (``auto``) int8 on each side where measured faster. Sets it."""
    mode, source = activations_setting(option, environ)
    if mode != "auto":
        chosen = Activations(mode, mode, source)
    else:
        measured = measure(qmm, model)
        decode, prefill = (
            "int8" if ratio <= INT8_MARGIN else "float32" for ratio in measured
        )
        chosen = Activations(decode, prefill, "auto, measured", measured)
    qmm.set_activations(chosen.decode, chosen.prefill)
    settings = qmm.settings()
    # What runs: a side without its int8 kernel stays on float32.
    effective = Activations(
        settings["activations"],
        settings["prefill_activations"],
        chosen.reason,
        chosen.measured,
    )
    logger.info("CPU kernels: %s", effective.describe())
    return effective
