"""Recurrent layers (linear attention, Mamba, short convolutions) in a paged step.

A paged step flattens its sequences' tokens into one axis, and a recurrent
layer's mixer must run over each sequence's tokens in order, from that
sequence's state. The mixer's class is routed (``install_recurrent_ops``):
given a ``RecurrentLayer`` for its cache, it runs once over the step's decode
rows as a batch of one-token sequences (their states stacked), and once over
each prompt chunk from its own state, each time on mlx-lm's own
``ArraysCache``; the outputs go back on the axis in order. Projections and
MLPs outside the mixer still run once over every token.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from mlx_backend.caches.paged import route_calls

# A layer's state: its arrays, None before a sequence's first token.
State = tuple[mx.array | None, ...]


@dataclass(frozen=True)
class RecurrentShape:
    """A recurrent layer of the paged pass: the arrays of its state
    (``ArraysCache(size)``) and a sequence's bytes in them."""

    size: int
    nbytes: int


@dataclass(frozen=True)
class RecurrentLayout:
    """How a step's segments run through a recurrent mixer: the decode rows
    (``rows``: each one's tokens, first on the axis in turn) as one batch, then
    each prompt chunk (start on the axis, tokens) alone."""

    rows: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]


class RecurrentLayer:
    """A recurrent layer's cache in a paged step: each segment's state in
    (``states``: the decode rows', then the chunks'), each one's new state out
    (``new_states``, lazy) once the pass has run."""

    def __init__(self, layout: RecurrentLayout, states: Sequence[State], size: int):
        self.layout, self.states, self.size = layout, list(states), size
        self.new_states: list[State | None] = [None] * len(self.states)

    def make_mask(self, N: int, **kwargs) -> None:
        # The model's mask for the whole axis: each run makes its own.
        return None

    def run(self, mixer: Callable, x: mx.array) -> mx.array:
        """``mixer(x, mask, cache)`` over each segment's tokens of ``x``
        (1, tokens, width), from its state."""
        lengths, outs = self.layout.rows, []
        rows = len(lengths)
        if rows:
            cache = ArraysCache(self.size)
            cache.cache = stacked(self.states[:rows])
            outs.append(run_rows(mixer, x, lengths, cache))
            for i in range(rows):
                self.new_states[i] = tuple(
                    c if rows == 1 else c[i : i + 1] for c in cache.cache
                )
        for i, (start, tokens) in enumerate(self.layout.chunks, rows):
            cache = ArraysCache(self.size)
            cache.cache = list(self.states[i])
            outs.append(mixer(x[:, start : start + tokens], None, cache))
            self.new_states[i] = tuple(cache.cache)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def run_rows(mixer: Callable, x: mx.array, lengths, cache: ArraysCache) -> mx.array:
    """The mixer over decode rows of ``lengths`` tokens, first on the axis of
    ``x``, as a batch: of one token each as they are, else right-padded to the
    longest, which mlx-lm's caches mask and end at each row's length."""
    rows, longest = len(lengths), max(lengths)
    if longest == 1:
        return mixer(x[0, :rows, None], None, cache).reshape(1, rows, -1)
    starts = np.cumsum([0, *lengths[:-1]])
    # A padded position repeats its row's last token (masked out).
    at = starts[:, None] + np.minimum(
        np.arange(longest), np.array(lengths)[:, None] - 1
    )
    cache.lengths = mx.array(lengths)
    out = mixer(x[0][mx.array(at)], cache.make_mask(longest), cache)
    kept = [i * longest + j for i, n in enumerate(lengths) for j in range(n)]
    return out.reshape(rows * longest, -1)[mx.array(kept)][None]


def stacked(states: Sequence[State]) -> list[mx.array]:
    """Decode rows' states as one batch's (a decoding row's prompt has run, so
    every array of its state is there)."""
    if len(states) == 1:
        return list(states[0])
    return [mx.concatenate(arrays) for arrays in zip(*states)]


def fresh_state(size: int) -> State:
    return (None,) * size


def install_recurrent_ops(mixers: Iterable[type]) -> None:
    """Route the calls of ``mixers`` (classes) over a ``RecurrentLayer``;
    calls over any other cache go on as they were."""
    route_calls(
        mixers,
        RecurrentLayer,
        lambda module, call, x, mask, cache: cache.run(
            lambda *args: call(module, *args), x
        ),
    )
