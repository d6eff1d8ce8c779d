"""Speculative decoding's parts without an engine: prompt lookup's n-gram
proposals, the draft length that pays, and the sampled distribution, which a
chi-square test checks on a tiny llama."""

import math
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from mlx_backend.decoders.proposers import DraftProposer, NgramProposer
from mlx_backend.decoders.speculative import (
    SpeculativeDecoder,
    best_draft_length,
    plan_drafts,
)
from mlx_backend.sampling import make_seeded_sampler
from python_utils import LoadOptions
from tests.support import EagerLookup
from tests.tiny_models import FLAT, TINY_LLAMA


def test_ngram_proposer_prefers_the_longest_latest_match():
    proposer = NgramProposer(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # The 3-gram (1, 2, 3) was followed by 4; the 2-gram (2, 3) last by 7.
    assert proposer.propose(tokens, 3) == [4, 5, 9]
    tokens += [6, 2, 3]
    assert proposer.propose(tokens, 2) == [6, 2]
    assert proposer.propose(tokens + [42], 4) == []
    # Near the end the continuation is what there is.
    assert NgramProposer(1, 1).propose([5, 6, 5], 4) == [6, 5]


DRAFT_LENGTHS = [
    (0.9, (1.0, 1.1, 1.2, 1.3), 3, 3),
    (0.9, (1.0, 1.1, 1.2, 1.3), 1, 1),
    (0.05, (1.0, 1.1, 1.2, 1.3), 3, 0),
    # Passes over several tokens cost as much as that many single ones.
    (0.9, (1.0, 2.0, 3.0, 4.0), 3, 0),
    (0.5, (1.0, 1.1, 1.2, 3.0), 3, 2),
    (0.9, (1.0, 1.1), 5, 1),
    # A small gain does not pay for leaving the pipelined batch.
    (0.3, (1.0, 1.05), 1, 0),
]


@pytest.mark.parametrize("rate, costs, available, expected", DRAFT_LENGTHS)
def test_best_draft_length(rate, costs, available, expected):
    assert best_draft_length(rate, costs, available) == expected


@pytest.mark.parametrize("rate, costs, available, expected", DRAFT_LENGTHS)
def test_a_lone_row_plans_as_a_lone_sequence(rate, costs, available, expected):
    assert plan_drafts([rate], [available], costs) == [expected]


# A pass costs little more per token up to 4 tokens, then a pass each.
FILLING = (1.0, 1.1, 1.2, 1.3, 2.3, 3.3)


def test_rows_of_a_batch_verify_where_the_pass_has_room():
    # Where passes cost the same whatever they carry, every row verifies all it can.
    assert plan_drafts([0.9, 0.0, 0.5], [4, 0, 2], FLAT) == [4, 0, 2]
    # Alone, a likely proposal pays; beside three rows that fill the pass, not.
    assert plan_drafts([0.9], [3], FILLING) == [3]
    assert plan_drafts([0.9, 0.0, 0.0, 0.0], [3, 0, 0, 0], FILLING) == [0] * 4
    # Room for a few tokens goes to the likeliest proposals first.
    assert plan_drafts([0.3, 0.95], [2, 2], FILLING) == [0, 2]
    # Asked for a token more than plain steps make in its time (entering from
    # guesses): a proposal that holds half the time does not go, one of 0.6 does.
    assert plan_drafts([0.5], [8], FLAT) == [8]
    assert plan_drafts([0.5], [8], FLAT, least_gain=1.0) == [0]
    assert plan_drafts([0.6], [8], FLAT, least_gain=1.0) == [8]
    # Beyond the measured passes, each token costs what the last one did.
    assert plan_drafts([0.0, 0.99], [0, 8], FILLING) == [0, 2]


# -- the sampled distribution, on a tiny llama ------------------------------

VOCAB = 24
SEED = 0


@pytest.fixture(scope="module")
def tiny():
    args = llama.ModelArgs.from_dict(
        {**TINY_LLAMA, "num_hidden_layers": 1, "vocab_size": VOCAB}
    )
    # A fixed model, whose proposals are sometimes accepted.
    mx.random.seed(SEED)
    model = llama.Model(args)
    # Sharper than a fresh model's distributions, so that proposals often hold.
    model.lm_head.weight = model.lm_head.weight * 8
    mx.eval(model.parameters())
    return model


def test_a_draft_catches_up_a_chunk_at_a_time(tiny):
    """A batch asks a draft model to catch up once a step: a long prompt costs a
    step one chunk of the draft, and its proposals then follow the whole prompt."""
    tokens = [t % VOCAB for t in range(20)]
    proposer = DraftProposer(tiny, prefill_step_size=8)
    assert [proposer.catch_up(tokens) for _ in range(3)] == [False, False, True]
    caught = proposer.propose(tokens, 3)
    assert caught == DraftProposer(tiny, prefill_step_size=64).propose(tokens, 3)
    # Accepted proposals count as seen; a new token is then all there is to feed.
    proposer.rewind(2, 3)
    assert proposer.catch_up(tokens + caught[:2] + [7])


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value with upper tail probability 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def speculating(model, paged: bool):
    """The batch decoder with speculation for a lone sequence, or the paged one
    speculating for its rows, both with eager lookup at flat costs."""
    options = LoadOptions(prefill_step_size=64)
    if paged:
        decoder = PagedDecoder(model, options, paged_layers(model, options))
        decoder.speculate(lambda: EagerLookup(1, 3), FLAT)
        return decoder
    return SpeculativeDecoder(
        BatchDecoder(model, options, True),
        model,
        lambda: EagerLookup(1, 3),
        costs=FLAT,
    )


@pytest.mark.parametrize("paged", [False, True], ids=["batch", "paged"])
def test_speculative_sampling_keeps_the_model_distribution(tiny, paged):
    """The second token (the first one a verification pass samples, after the
    n-gram proposal from the repeated prompt) follows the model's own
    distribution: a chi-square test over seeded draws against exact probabilities."""
    # Every token occurs in the prompt: whatever comes first, a proposal follows.
    prompt = tuple(range(VOCAB)) + (3, 4, 5)
    decoder = speculating(tiny, paged)
    draws = 800
    counts: Counter = Counter()
    for seed in range(draws):
        key = decoder.add(
            NewSequence(
                prompt,
                prompt,
                make_prompt_cache(tiny),
                make_seeded_sampler(1.0, 0.0, 0.0, 0, seed),
                [],
                6,
                draft_tokens=4,
            )
        )
        tokens = []
        while len(tokens) < 2:
            tokens += [t for r in decoder.step() for t in r.tokens]
        # Not a reset: a paged store's first pass fills a new arena.
        decoder.remove(key, keep_state=False)
        counts[tokens[1]] += 1
    assert decoder.draft_proposed > 0 and 0 < decoder.draft_accepted
    # Exact: p(second) = sum over first of p(first) p(second | first).
    first = mx.softmax(tiny(mx.array([prompt]))[0, -1])
    extended = mx.array([prompt + (t,) for t in range(VOCAB)])
    second = first @ mx.softmax(tiny(extended)[:, -1], axis=-1)
    expected = [p * draws for p in second.tolist()]
    # Tokens expected fewer than 5 times are pooled into one bin.
    small = [t for t in range(VOCAB) if expected[t] < 5]
    bins = [(counts[t], expected[t]) for t in range(VOCAB) if expected[t] >= 5]
    bins.append((sum(counts[t] for t in small), sum(expected[t] for t in small)))
    statistic = sum((o - e) ** 2 / e for o, e in bins if e > 0)
    assert statistic < chi_square_critical(len(bins) - 1), (statistic, bins)
