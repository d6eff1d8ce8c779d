"""Reranker forms (mlx_backend/formats/rerank.py) and their options: Qwen3-Reranker's
prompt as it is, the judging prompt through a chat template or as plain text, the
answer tokens, and relevance as P(yes) against P(no)."""

import math
from types import SimpleNamespace

import pytest

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.rerank import (
    DEFAULT_INSTRUCTION,
    JUDGE,
    RerankForm,
    make_rerank_form,
    relevance,
)
from mlx_backend.request_parsing import JudgeRequest, RerankJob, parse_rerank
from python_utils import parse_options


class Tokenizer:
    """Words as tokens: "yes" 7 and "no" 8 (or "yes" in two pieces)."""

    def __init__(self, template: bool = True, split_yes: bool = False):
        self.chat_template = "a template" if template else None
        self.split_yes = split_yes

    def encode(self, text, add_special_tokens=False):
        if text == "yes":
            return [7, 9] if self.split_yes else [7]
        return [8] if text == "no" else [1, 2, 3]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return turns + "<assistant>"


def test_qwen3_writes_qwen3_rerankers_prompt():
    form = make_rerank_form("qwen3", "", Tokenizer())
    assert (form.yes, form.no) == (7, 8)
    assert form.text("q?", "d.") == (
        f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: q?\n<Document>: d."
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_yes_no_goes_through_the_chat_template_or_plain_text():
    form = make_rerank_form("yes_no", "Find rivers", Tokenizer())
    assert form.text("q", "d") == (
        f"<system>{JUDGE}</system><user><Instruct>: Find rivers\n<Query>: q\n"
        "<Document>: d</user><assistant>"
    )
    plain = make_rerank_form("yes_no", "", Tokenizer(template=False))
    assert plain.text("q", "d").startswith(JUDGE + "\n\n<Instruct>: ")
    assert plain.text("q", "d").endswith("<Document>: d\nAnswer: ")
    assert make_rerank_form("", "", Tokenizer()) is None


def test_the_answers_must_be_single_tokens():
    with pytest.raises(InvalidArgument, match="reranker:qwen3: 'yes' is not one"):
        make_rerank_form("qwen3", "", Tokenizer(split_yes=True))


def test_relevance_is_yes_against_no():
    assert relevance(-1.0, -1.0) == 0.5
    assert relevance(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert relevance(-0.1, -9.0) > 0.99 > 0.01 > relevance(-9.0, -0.1)


def test_the_options():
    options = parse_options(["reranker:QWEN3", "rerank_instruction:Find: Rivers"])
    assert options.reranker == "qwen3"
    assert options.rerank_instruction == "Find: Rivers"
    with pytest.raises(InvalidArgument, match="reranker must be one of qwen3, yes_no"):
        parse_options(["reranker:bge"])


@pytest.mark.parametrize("top_n, kept", [(0, 4), (2, 2), (4, 4), (9, 4)])
def test_documents_rank_as_their_answers_say(top_n, kept):
    # Each document's answer fixed: the logprobs of "yes" and "no" after its prompt.
    answers = [(-2.0, -0.2), (-0.1, -3.0), (-1.0, -1.0), (-0.1, -3.0)]
    judge = JudgeRequest((5,), ((1,), (2,), (3,), (2,)), (7, 8))
    job = RerankJob(("a", "b", "c", "d"), judge, top_n)
    ranks = job.ranked(answers)
    assert [i for i, _ in ranks] == [1, 3, 2, 0][:kept]  # twins 1 and 3: by index
    assert ranks[0][1] == pytest.approx(relevance(-0.1, -3.0))


class Letters:
    """Each character its own token, no BOS."""

    bos_token = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, tokens):
        return "".join(map(chr, tokens))


def letters_info(context_size: int = 4096):
    form = RerankForm("yes_no", "P|", "|S", "I", yes=7, no=8)
    return SimpleNamespace(
        reranker=form, tokenizer=Letters(), context_size=context_size, load_id=3
    )


@pytest.mark.parametrize(
    "documents",
    [("alpha", "beta", "alpha"), ("same", "same"), ("one",), ("ab", "abc")],
)
def test_documents_split_into_the_prefix_they_share_and_their_own_tokens(documents):
    info = letters_info()
    request = SimpleNamespace(query="q", documents=list(documents), top_n=0)
    job = parse_rerank(request, info)
    judge = job.judge
    prompts = [Letters().encode(info.reranker.text("q", d)) for d in documents]
    assert [list(judge.prefix + d) for d in judge.documents] == prompts
    # The prefix runs up to where the documents part, each keeping a token.
    assert min(map(len, judge.documents)) >= 1
    if len(set(documents)) > 1:
        assert len({d[0] for d in judge.documents}) > 1
    else:
        assert min(map(len, judge.documents)) == 1
    assert judge.answers == (7, 8) and judge.load_id == 3
    assert job.texts == documents
    assert job.prompt_tokens == sum(map(len, prompts))
