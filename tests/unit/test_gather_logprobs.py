"""gather_logprobs: a token's logprob and the top alternatives of each row,
against numpy."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_utils import gather_logprobs
from tests.engine_helpers import log_softmax


@pytest.fixture(scope="module")
def logprob_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    return log_softmax(rng.normal(size=(4, 50))).astype(np.float32)


@pytest.mark.parametrize("top", [1, 5, 50])
def test_gather_logprobs_matches_numpy(logprob_rows, top):
    tokens = [3, 0, 49, 17]
    result = gather_logprobs([mx.array(r) for r in logprob_rows], tokens, top)
    assert len(result) == len(tokens)
    for row, token, (value, best) in zip(logprob_rows, tokens, result):
        assert value == pytest.approx(float(row[token]), abs=1e-6)
        order = np.argsort(-row, kind="stable")[:top].tolist()
        assert [i for i, _ in best] == order
        assert [v for _, v in best] == pytest.approx(row[order].tolist(), abs=1e-6)


def test_gather_logprobs_top_zero_lists_no_alternatives(logprob_rows):
    result = gather_logprobs([mx.array(r) for r in logprob_rows[:2]], [7, 8], 0)
    assert [best for _, best in result] == [[], []]
    assert [v for v, _ in result] == pytest.approx(
        [float(logprob_rows[0, 7]), float(logprob_rows[1, 8])], abs=1e-6
    )


def test_gather_logprobs_of_one_row_in_model_precision(logprob_rows):
    row = mx.array(logprob_rows[2]).astype(mx.float16)
    exact = np.array(row.astype(mx.float32))
    ((value, best),) = gather_logprobs([row], [9], 3)
    assert value == float(exact[9])
    assert [i for i, _ in best] == np.argsort(-exact, kind="stable")[:3].tolist()
