"""Reranker forms: how a causal-LM reranker judges a document (LocalAI's
``/v1/rerank``).

A causal-LM reranker (Qwen3-Reranker, and rerankers built the same way on other
families) reads an instruction, the query and one document after a fixed judging
prompt and answers "yes" or "no": a document's relevance is the probability of
"yes" against "no" at the answer position. request_parsing.py's ``parse_rerank``
splits the documents' prompts into the prefix they share and their own tokens, and
the engine judges them in batches after that prefix (engine/jobs.py's
``JudgeBatch``).
"""

import math
from dataclasses import dataclass
from pathlib import Path

from mlx_backend.errors import InvalidArgument

# The forms a load option names: Qwen3-Reranker's own prompt, or the judging
# prompt through the model's chat template.
RERANKER_FORMS = ("qwen3", "yes_no")
JUDGE = (
    "Judge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
QWEN3_PREFIX = f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
_PAIR = "\x00pair\x00"


@dataclass(frozen=True)
class RerankForm:
    """How a model judges a document: the text around the instruction, query and
    document, and the token ids of the two answers."""

    name: str
    prefix: str
    suffix: str
    instruction: str
    yes: int
    no: int

    def text(self, query: str, document: str) -> str:
        pair = (
            f"<Instruct>: {self.instruction}\n<Query>: {query}\n"
            f"<Document>: {document}"
        )
        return f"{self.prefix}{pair}{self.suffix}"

    def describe(self) -> str:
        return f"reranker {self.name} (answers 'yes' {self.yes} / 'no' {self.no})"


def _answer_token(tokenizer, word: str, form: str) -> int:
    tokens = tokenizer.encode(word, add_special_tokens=False)
    if len(tokens) != 1:
        raise InvalidArgument(
            f"Options: reranker:{form}: {word!r} is not one token in this vocabulary"
        )
    return tokens[0]


def recognised_reranker(names: tuple[str, ...], config: dict) -> str:
    """The form for a model whose name (its folder or LocalAI's name) says it is a
    reranker: Qwen3-Reranker's for a Qwen3, else the yes/no one; "" for the rest.
    Qwen3-Reranker ships Qwen3's own config and chat template: only its name tells."""
    if not any("reranker" in Path(name).name.lower() for name in names if name):
        return ""
    return "qwen3" if config.get("model_type") == "qwen3" else "yes_no"


def make_rerank_form(name: str, instruction: str, tokenizer) -> RerankForm | None:
    """The form the ``reranker`` option names ("" : none), with ``instruction`` or
    the default one."""
    if not name:
        return None
    if name == "qwen3":
        prefix, suffix = QWEN3_PREFIX, QWEN3_SUFFIX
    elif getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": JUDGE},
            {"role": "user", "content": _PAIR},
        ]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        prefix, _, suffix = rendered.partition(_PAIR)
    else:
        prefix, suffix = f"{JUDGE}\n\n", "\nAnswer: "
    return RerankForm(
        name,
        prefix,
        suffix,
        instruction or DEFAULT_INSTRUCTION,
        _answer_token(tokenizer, "yes", name),
        _answer_token(tokenizer, "no", name),
    )


def relevance(yes_logprob: float, no_logprob: float) -> float:
    """The probability of "yes" against "no"."""
    return 1.0 / (1.0 + math.exp(no_logprob - yes_logprob))
