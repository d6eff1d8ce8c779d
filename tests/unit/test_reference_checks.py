"""The checks that compare a reply with mlx-lm's greedy reference
(tests/support.py): exact on the CPU, parting only at a near tie on CUDA."""

import pytest

from tests import support
from tests.support import assert_text_as_reference, assert_tokens_as_reference

END = 0
# (token, margin of its logprob over the next best); 3 was a near tie.
STEPS = [(5, 1.5), (6, 0.9), (3, 0.05), (7, 2.0), (END, 1.0)]
WORDS = {5: "a", 6: " b", 3: " c", 7: " d", 9: " x"}


def decode(tokens):
    return "".join(WORDS[t] for t in tokens)


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(support, "on_cuda", lambda: True)


def test_the_same_tokens_and_text_pass_everywhere():
    assert_tokens_as_reference([5, 6, 3, 7], STEPS, ends=(END,))
    assert_tokens_as_reference([5, 6, 3, 7, END], STEPS)
    assert_text_as_reference("a b c d", STEPS, decode, (END,))


def test_the_cpu_takes_no_parting():
    with pytest.raises(AssertionError, match="parted at token 2"):
        assert_tokens_as_reference([5, 6, 9, 9], STEPS, ends=(END,))
    with pytest.raises(AssertionError, match="parted at token 2"):
        assert_text_as_reference("a b x x", STEPS, decode, (END,))


def test_cuda_parts_at_a_near_tie_only(cuda):
    assert_tokens_as_reference([5, 6, 9, 9], STEPS, ends=(END,))
    assert_text_as_reference("a b x x", STEPS, decode, (END,))
    with pytest.raises(AssertionError, match="parted at token 1"):
        assert_tokens_as_reference([5, 9, 9, 9], STEPS, ends=(END,))
    with pytest.raises(AssertionError, match="parted at token 1"):
        assert_text_as_reference("a x", STEPS, decode, (END,))
    # Going on past the reference's end token parts there (margin 1.0).
    with pytest.raises(AssertionError, match="parted at token 4"):
        assert_text_as_reference("a b c d x", STEPS, decode, (END,))
