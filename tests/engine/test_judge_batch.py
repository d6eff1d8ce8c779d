"""Rerank's JudgeBatch on every family's tiny model (full, sliding-window,
recurrent and MLA caches): each document's answer logprobs after the shared prefix
equal mlx-lm's own forward pass over the prefix and the document, whatever the
rows per group, the chunk size, how much of the prefix was cached and whether the
answers come through the output layer alone or the whole model."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as load_mlx_lm

from mlx_backend.engine.jobs import JudgeBatch, ScoreBatch
from mlx_backend.models.loading import output_head
from mlx_backend.request_parsing import JudgeRequest
from mlx_utils import make_kv_cache
from python_utils import parse_options
from tests.engine_helpers import log_softmax
from tests.family_models import FAMILIES, WINDOW
from tests.support import device_tolerance

TOLERANCE = device_tolerance(1e-4, 10)
# Past the families' sliding window, so that the prefix alone has rotated it.
PREFIX = tuple(range(1000, 1000 + 2 * WINDOW))
DOCUMENTS = (
    (7, 8, 9, 10, 11),
    (12,),
    tuple(range(2000, 2000 + 3 * WINDOW)),
    (31, 32),
    tuple(range(3000, 3000 + WINDOW + 3)),
)
ANSWERS = (4000, 4001)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_folder):
    model, _ = load_mlx_lm(str(family_folder(request.param)))
    expected = []
    for document in DOCUMENTS:
        logits = model(mx.array([PREFIX + document]))[0, -1].astype(mx.float32)
        logprobs = log_softmax(np.array(logits))
        expected.append([float(logprobs[a]) for a in ANSWERS])
    return request.param, model, expected


def judged(model, head, cache, rest, step_size: int, max_rows: int) -> list:
    request = JudgeRequest(PREFIX, DOCUMENTS, ANSWERS)
    batch = JudgeBatch(model, head, cache, rest, request, step_size, max_rows)
    for _ in range(1000):
        if batch.advance():
            assert batch.cache is cache
            return batch.answers
    raise AssertionError("the batch did not end")


@pytest.mark.parametrize(
    "step_size, max_rows, cached, through",
    [
        (4, 1, 0, "head"),  # a document a group, 16 columns a chunk
        # Groups of 3, 16 columns a chunk, the prefix partly cached.
        (48, 3, 5, "head"),
        (48, 3, 5, "model"),
        (1024, 8, 0, "head"),  # one group of all 5, every document whole
    ],
)
def test_answers_equal_a_forward_pass_over_prefix_and_document(
    family, step_size, max_rows, cached, through
):
    name, model, expected = family
    head = output_head(model) if through == "head" else None
    if through == "head" and head is None:
        pytest.skip(f"{name}'s logits are not its output layer's alone")
    cache = make_prompt_cache(model)
    if cached:
        model(mx.array([PREFIX[:cached]]), cache=cache)
    answers = judged(model, head, cache, PREFIX[cached:], step_size, max_rows)
    np.testing.assert_allclose(answers, expected, atol=TOLERANCE)


def test_the_output_layer_alone_is_used_only_where_it_gives_the_logits(
    family_folder,
):
    llama, _ = load_mlx_lm(str(family_folder("llama")))
    assert output_head(llama) is not None
    # Gemma 4 caps its logits after the output layer.
    gemma4, _ = load_mlx_lm(str(family_folder("gemma4_text")))
    assert output_head(gemma4) is None


def test_a_quantized_kv_cache_judges_a_row_at_a_time_as_score_does(family_folder):
    model, _ = load_mlx_lm(str(family_folder("llama")))
    options = parse_options(["kv_bits:8", "kv_group_size:32"])
    answers = judged(model, None, make_kv_cache(model, options), PREFIX, 8, 4)
    for document, pair in zip(DOCUMENTS, answers):
        cache = make_kv_cache(model, options)
        score = ScoreBatch(model, cache, PREFIX + document, ((4000,), (4001,)), 8, 4)
        while not score.advance():
            pass
        np.testing.assert_allclose(pair, [s[0] for s in score.scores], atol=TOLERANCE)
