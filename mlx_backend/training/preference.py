"""Preference training on mlx-lm's tuner: DPO and ORPO as a loss and a batch
iterator that ``mlx_lm.tuner.trainer.train`` takes, so they run wherever MLX
does, with the SFT path's checkpoints, progress and stops.

Each example is a prompt (with an optional system message) and a chosen and a
rejected answer, rendered with the model's chat template. DPO's reference is the
model before training: its log-probabilities of every pair are computed once,
before the first step (LoRA starts as the identity, full fine-tuning from the
base weights), so no second copy of the model is held.
"""

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PREFERENCE_METHODS = ("dpo", "orpo")
# DPO's beta and ORPO's lambda, where extra_options sets no ``beta`` (trl's default).
DEFAULT_BETA = 0.1
# Rows are padded to a multiple of this, as mlx-lm's batches are.
PAD_TO = 32


@dataclass(frozen=True)
class Pair:
    """One example's two token sequences; the answers start at ``prompt``."""

    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    prompt: int
    # The reference model's log-probabilities of the two answers (DPO).
    reference: tuple[float, float] = (0.0, 0.0)


def encode_pair(example: dict, tokenizer) -> Pair:
    messages = []
    if isinstance(example.get("system"), str):
        messages.append({"role": "system", "content": example["system"]})
    messages.append({"role": "user", "content": example["prompt"]})
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        chosen, rejected = (
            tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": example[key]}],
                return_dict=False,
            )
            for key in ("chosen", "rejected")
        )
    else:
        prompt = tokenizer.encode(example["prompt"])
        chosen, rejected = (
            prompt
            + tokenizer.encode(example[key], add_special_tokens=False)
            + [tokenizer.eos_token_id]
            for key in ("chosen", "rejected")
        )
    # Where the answers part from the prompt, should a template re-render its end.
    start = min(len(os.path.commonprefix([prompt, chosen, rejected])), len(prompt))
    return Pair(tuple(chosen), tuple(rejected), start)


def answer_log_probs(model, batch: mx.array, spans: mx.array) -> mx.array:
    """Each row's summed log-probability of its answer tokens, and their count."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs).astype(mx.float32)
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= spans[:, 0:1], steps < spans[:, 1:])
    scores = -nn.losses.cross_entropy(logits, targets) * mask
    return scores.sum(axis=1), mask.sum(axis=1)


def with_reference(
    model, pairs: list[Pair], batch_size: int, max_seq_length: int
) -> list[Pair]:
    """``pairs`` with the model's log-probabilities of their answers, as it is now."""
    model.eval()
    done = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        rows, spans = _rows(chunk, max_seq_length)
        scores = answer_log_probs(model, rows, spans)[0].tolist()
        done += [
            Pair(p.chosen, p.rejected, p.prompt, (chosen, rejected))
            for p, chosen, rejected in zip(
                chunk, scores[: len(chunk)], scores[len(chunk) :]
            )
        ]
    return done


def batch_width(longest: int, max_seq_length: int) -> int:
    """A batch's padded width: one plus a multiple of ``PAD_TO``, as mlx-lm pads."""
    return min(1 + PAD_TO * -(-longest // PAD_TO), max_seq_length)


def _rows(pairs: list[Pair], max_seq_length: int) -> tuple[mx.array, mx.array]:
    """The chosen sequences, then the rejected ones, padded as one batch; and each
    row's span (answer start, end)."""
    sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    starts = [p.prompt for p in pairs] * 2
    longest = max(len(s) for s in sequences)
    width = batch_width(longest, max_seq_length)
    batch = np.zeros((len(sequences), width), np.int32)
    spans = []
    for row, (sequence, start) in enumerate(zip(sequences, starts)):
        kept = sequence[:width]
        batch[row, : len(kept)] = kept
        spans.append((start, len(kept)))
    return mx.array(batch), mx.array(spans)


def iterate_pairs(
    dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None
):
    """mlx-lm's ``iterate_batches`` for pairs: shuffled batches of ``batch_size``
    pairs, each yielding (rows, spans, the reference's scores)."""
    if len(dataset) < batch_size:
        raise ValueError(f"the dataset has fewer than batch_size={batch_size} pairs")
    order = sorted(range(len(dataset)), key=lambda i: len(dataset[i].chosen))
    batches = [
        order[i : i + batch_size]
        for i in range(0, len(order) - batch_size + 1, batch_size)
    ]
    if seed is not None:
        np.random.seed(seed)
    while True:
        for i in np.random.permutation(len(batches)):
            pairs = [dataset[j] for j in batches[i]]
            rows, spans = _rows(pairs, max_seq_length)
            reference = [p.reference[0] for p in pairs] + [
                p.reference[1] for p in pairs
            ]
            yield rows, spans, mx.array(reference)
        if not loop:
            break


def make_preference_loss(method: str, beta: float):
    """The loss mlx-lm's trainer minimizes for ``method``: (loss, answer tokens)."""

    def dpo(model, rows, spans, reference):
        scores, counts = answer_log_probs(model, rows, spans)
        margins = scores - reference
        half = margins.shape[0] // 2
        logits = beta * (margins[:half] - margins[half:])
        return nn.log_sigmoid(logits).mean() * -1, counts.sum()

    def orpo(model, rows, spans, reference):
        scores, counts = answer_log_probs(model, rows, spans)
        means = scores / mx.maximum(counts, 1)
        half = means.shape[0] // 2
        # log(p / (1 - p)) of each answer's mean token probability.
        odds = means - mx.log1p(-mx.exp(mx.minimum(means, -1e-6)))
        ratio = nn.log_sigmoid(odds[:half] - odds[half:])
        return (-means[:half] - beta * ratio).mean(), counts.sum()

    return {"dpo": dpo, "orpo": orpo}[method]
