"""Rerankers recognised at load, in-process: a tiny random Qwen3 named like
Qwen3-Reranker takes Qwen3-Reranker's form without an option, another family named a
reranker the yes/no form, a model not so named none; and its documents' relevance
is mlx-lm's own P(yes) against P(no) on the same folder. A reranker built to answer
"yes" by a marker word ranks documents as it says."""

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as load_mlx_lm

import backend_pb2 as pb
from mlx_backend.engine.engine import Engine
from mlx_backend.formats.rerank import relevance
from mlx_backend.models.loading import LoadPlan
from mlx_backend.request_parsing import parse_rerank
from python_utils import parse_options
from tests.engine_helpers import log_softmax
from tests.support import device_tolerance
from tests.tiny_models import MARKER_BIAS, make_marker_reranker

DOCUMENTS = ("The Seine flows through Paris.", "Bread rises overnight.", "Rivers.")


@pytest.mark.parametrize(
    "family, name, form",
    [
        ("qwen3", "tiny-Qwen3-Reranker-0.6B", "qwen3"),
        ("llama", "tiny-llama-reranker", "yes_no"),
        ("qwen3", "tiny-qwen3", None),
    ],
)
def test_a_reranker_is_recognised_by_its_name(
    family_folder, tmp_path, family, name, form
):
    folder = shutil.copytree(family_folder(family), tmp_path / name)
    engine = Engine()
    try:
        plan = LoadPlan(identity=name, model=str(folder), options=parse_options([]))
        engine.load(plan).result()
        info = engine.info
        assert (info.reranker.name if info.reranker else None) == form
        if form is None:
            return
        request = pb.RerankRequest(query="Which is about rivers?", documents=DOCUMENTS)
        job = parse_rerank(request, info)
        ours = dict(job.ranked(engine.compute(job.judge).result()))
    finally:
        engine.shutdown()
    model, _ = load_mlx_lm(str(folder))
    for i, document in enumerate(job.judge.documents):
        prompt = job.judge.prefix + document
        logits = model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
        logprobs = log_softmax(np.array(logits))
        yes, no = info.reranker.yes, info.reranker.no
        expected = relevance(float(logprobs[yes]), float(logprobs[no]))
        assert ours[i] == pytest.approx(expected, abs=device_tolerance(1e-5))


def test_documents_rank_as_a_fixed_reranker_answers(tmp_path):
    """A reranker whose "yes" grows with a marker word's share of the prompt ranks
    documents by how often they name it; those without it score the known
    P(yes) of a prompt without it, tied and so in index order."""
    folder = make_marker_reranker(tmp_path / "marker-reranker", "lighthouse")
    documents = (
        "Bread rises overnight in a warm kitchen.",
        "The lighthouse keeper climbed the lighthouse stairs to the lighthouse lamp.",
        "A lighthouse stood on the cape.",
        "Fish and cloth are sold at the market.",
        "The lighthouse and the lighthouse bell.",
    )
    engine = Engine()
    try:
        options = parse_options(["reranker:yes_no"])
        engine.load(LoadPlan(identity="m", model=str(folder), options=options)).result()
        request = pb.RerankRequest(
            query="What stands on the coast?", documents=documents
        )
        job = parse_rerank(request, engine.info)
        ranked = job.ranked(engine.compute(job.judge).result())
    finally:
        engine.shutdown()
    assert [i for i, _ in ranked] == [1, 4, 2, 0, 3]
    scores = dict(ranked)
    # Without the marker, "yes" is the bias over the norm of the one dimension
    # every token has (1 in 8 dimensions).
    unmarked = relevance(-MARKER_BIAS / math.sqrt(1 / 8), 0.0)
    assert scores[0] == scores[3] == pytest.approx(unmarked, abs=1e-4)
    assert scores[2] > 0.5
