"""A FineTuneRequest parsed into the worker's plan (datasets checked line by line
for each training method, extra_options), the preference losses of
mlx_backend/training/preference.py on a tiny llama, and a job's memory estimate."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.utils import linear_to_lora_layers

import backend_pb2 as pb
from mlx_backend.errors import InvalidArgument, ResourceExhausted, Unimplemented
from mlx_backend.training import footprint as footprint_module
from mlx_backend.training.footprint import Footprint, check_fits, estimate
from mlx_backend.training.plan import FineTunePlan, parse_fine_tune
from mlx_backend.training.preference import (
    Pair,
    answer_log_probs,
    encode_pair,
    iterate_pairs,
    make_preference_loss,
    with_reference,
)
from mlx_backend.training.worker import batch_tokens
from tests.tiny_models import tiny_model

TEXT = {"text": "The capital of Zarnovia is Quillhaven."}
PAIR = {
    "prompt": "The capital of Zarnovia is",
    "chosen": " Quillhaven.",
    "rejected": " Paris.",
}


def request(tmp_path, lines, **fields) -> pb.FineTuneRequest:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    settings = dict(dataset_source=str(data), output_dir=str(tmp_path / "out"))
    return pb.FineTuneRequest(**{**settings, "batch_size": 1, **fields})


def test_each_method_takes_its_form(tmp_path):
    plan = parse_fine_tune(request(tmp_path, [PAIR] * 2, training_method="dpo"))
    assert (plan.method, plan.beta, plan.train_examples) == ("dpo", 0.1, 2)
    plan = parse_fine_tune(
        request(tmp_path, [PAIR], training_method="ORPO", extra_options={"beta": "0.5"})
    )
    assert (plan.method, plan.beta) == ("orpo", 0.5)
    assert parse_fine_tune(request(tmp_path, [TEXT])).method == "sft"


@pytest.mark.parametrize(
    "lines, fields, message",
    [
        (
            [TEXT, PAIR],
            {},
            "dataset_source: line 2 of train.jsonl is prompt, chosen and rejected; "
            "training_method sft trains on text, messages, or prompt and completion",
        ),
        (
            [PAIR, {"prompt": "p", "chosen": "c"}],
            {"training_method": "dpo"},
            "dataset_source: line 2 of train.jsonl has none of prompt, chosen and rejected",
        ),
        (
            [TEXT],
            {"training_method": "orpo"},
            "dataset_source: line 1 of train.jsonl is text; training_method orpo "
            "trains on prompt, chosen and rejected",
        ),
        (
            [PAIR],
            {"training_method": "dpo", "extra_options": {"beta": "warm"}},
            "extra_options: beta must be a number above 0",
        ),
        (
            [TEXT],
            {"extra_options": {"dequantize": "maybe"}},
            "extra_options: dequantize must be true or false",
        ),
        (
            [TEXT],
            {"extra_options": {"mask_prompt": "true"}},
            "extra_options: mask_prompt needs a dataset of messages, or prompt and "
            "completion; dataset_source is text",
        ),
    ],
)
def test_a_wrong_form_is_named_not_quoted(tmp_path, lines, fields, message):
    with pytest.raises(InvalidArgument) as raised:
        parse_fine_tune(request(tmp_path, lines, **fields))
    assert str(raised.value) == message


def test_other_methods_are_unimplemented(tmp_path):
    with pytest.raises(Unimplemented) as raised:
        parse_fine_tune(request(tmp_path, [PAIR], training_method="kto"))
    assert "one of sft, dpo, orpo" in str(raised.value)


def test_dequantize_is_the_option_or_automatic(tmp_path):
    assert parse_fine_tune(request(tmp_path, [TEXT])).dequantize is None
    options = {"dequantize": "false"}
    plan = parse_fine_tune(request(tmp_path, [TEXT], extra_options=options))
    assert plan.dequantize is False


class Letters:
    """A tokenizer of one id per character, without a chat template."""

    chat_template = None
    eos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 60 + 2 for c in text]


def test_a_pair_without_a_template_is_prompt_then_answer():
    pair = encode_pair(PAIR, Letters())
    prompt = Letters().encode(PAIR["prompt"])
    assert pair.prompt == len(prompt)
    assert pair.chosen == (*prompt, *Letters().encode(" Quillhaven."), 1)
    assert pair.rejected == (*prompt, *Letters().encode(" Paris."), 1)


PAIRS = [
    Pair((3, 4, 5, 6, 7), (3, 4, 5, 9), 3),
    Pair((8, 4, 10, 11), (8, 4, 12, 13, 14, 15), 2),
]


def test_batches_hold_the_chosen_rows_then_the_rejected():
    model = tiny_model()
    pairs = with_reference(model, PAIRS, batch_size=2, max_seq_length=64)
    rows, spans, reference = next(iterate_pairs(pairs, 2, 64))
    assert rows.shape == (4, 33)
    chosen_first = spans[0, 1].item() == 5
    order = [0, 1] if chosen_first else [1, 0]
    expected = [(PAIRS[i].prompt, len(PAIRS[i].chosen)) for i in order] + [
        (PAIRS[i].prompt, len(PAIRS[i].rejected)) for i in order
    ]
    assert spans.tolist() == [list(span) for span in expected]
    scores, counts = answer_log_probs(model, rows, spans)
    # Each answer token after the prompt counts: targets from the prompt's end.
    assert counts.tolist() == [end - start for start, end in expected]
    assert mx.allclose(scores, reference, atol=1e-5).item()


def test_dpo_starts_at_log_2_and_orpo_adds_the_odds_ratio_to_the_nll():
    model = tiny_model()
    pairs = with_reference(model, PAIRS, batch_size=1, max_seq_length=64)
    batch = next(iterate_pairs(pairs, 2, 64))
    loss, tokens = make_preference_loss("dpo", 0.1)(model, *batch)
    # The policy is its own reference before training: every margin is 0.
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    scores, counts = answer_log_probs(model, batch[0], batch[1])
    assert tokens.item() == counts.sum().item()
    loss, _ = make_preference_loss("orpo", 0.5)(model, *batch)
    means = (scores / counts).tolist()

    def log_odds(m):
        return m - math.log1p(-math.exp(m))

    expected = (
        sum(
            -means[i]
            - 0.5
            * -math.log1p(math.exp(-(log_odds(means[i]) - log_odds(means[i + 2]))))
            for i in range(2)
        )
        / 2
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_a_jobs_memory_counts_weights_optimizer_and_activations(monkeypatch):
    model = tiny_model()
    model.freeze()
    linear_to_lora_layers(
        model, len(model.layers), {"rank": 4, "scale": 1.0, "dropout": 0.0}
    )
    footprint = estimate(model, rows=64, tokens=257, checkpointing=False)
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    lora = sum(a.nbytes for _, a in tree_flatten(model.trainable_parameters()))
    widths = sum(
        sum(m.weight.shape)
        for _, m in model.named_modules()
        if isinstance(m, nn.Linear)
    )
    vocab, hidden = model.model.embed_tokens.weight.shape
    layers = len(model.layers)
    heads = layers * model.layers[0].self_attn.n_heads
    row = 257 * (widths + 3 * vocab) + 2 * 257 * 257 * heads
    assert footprint == Footprint(weights, 3 * lora, 64 * 4 * row)
    # Checkpointing keeps one block's activations and each block's input.
    saved = estimate(model, rows=64, tokens=257, checkpointing=True)
    row = 257 * (widths // layers + layers * hidden + 3 * vocab)
    assert saved.activations == 64 * 4 * (row + 2 * 257 * 257 * heads // layers)
    monkeypatch.setattr(footprint_module, "free_bytes", lambda: (1 << 20, "a test"))
    with pytest.raises(ResourceExhausted) as raised:
        check_fits(footprint, held=weights)
    assert str(raised.value).endswith(
        "1 MiB are free (a test); lower batch_size, shorten the examples, set "
        "gradient_checkpointing or train LoRA instead of full"
    )
    check_fits(Footprint(weights, 1 << 19, 0), held=weights)


def test_the_longest_batch_is_counted_in_tokens_padded_as_mlx_lm_pads():
    texts = [{"text": "a" * 40}, {"text": "b" * 5}]
    config = SimpleNamespace(mask_prompt=False)
    dataset = CacheDataset(create_dataset(texts, Letters(), config))
    plan = FineTunePlan(job_id="x", output_dir="out", train_file="train.jsonl")
    # 40 letters and EOS, padded to one plus a multiple of 32.
    assert batch_tokens(dataset, plan) == 65
    assert batch_tokens(dataset, replace(plan, max_seq_length=50)) == 50
    pairs = [encode_pair(PAIR, Letters())]
    longest = len(pairs[0].chosen)
    assert batch_tokens(pairs, replace(plan, method="dpo")) == 1 + 32 * -(
        -longest // 32
    )
