"""Constrained decoding: request grammars compiled with llguidance, applied as
per-request logits processors.

``PredictOptions.Grammar`` is GBNF (llama.cpp's format, or Lark), a JSON schema
(the text parses as a JSON object), or ``json`` for any JSON object.
"""

import json
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import llguidance
import llguidance.mlx
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.grammars import ANSWER
from mlx_backend.output.detokenizer import TokenBytes
from mlx_backend.schemas import strict_schema
from python_utils import load_json

logger = logging.getLogger(__name__)

# Compiled grammars kept per loaded model, by their text.
GRAMMAR_CACHE_SIZE = 64
ANY_JSON_OBJECT = '{"type": "object"}'


def to_llguidance(text: str) -> str:
    """llguidance's grammar for a ``Grammar`` field; InvalidArgument when malformed."""
    source = text.strip()
    if source == "json":
        source = ANY_JSON_OBJECT
    try:
        schema = load_json("Grammar", source)
    except ValueError:
        schema = None
    try:
        if schema is None:
            return llguidance.grammar_from("gbnf", source)
        if not isinstance(schema, dict):
            raise InvalidArgument("Grammar: a JSON schema must be a JSON object")
        return llguidance.grammar_from("json_schema", json.dumps(strict_schema(schema)))
    except ValueError as e:
        raise InvalidArgument(f"Grammar: {e}") from None


def after_reasoning(prefix: str, grammar: str) -> str:
    """``grammar`` (llguidance's, from ``to_llguidance``) for the answer only: the
    reply first follows ``prefix``, Lark rules that hand over at ``@answer``."""
    if grammar.lstrip().startswith("{"):
        inner = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    inner[0] = {**inner[0], "name": ANSWER}
    return json.dumps({"grammars": [{"lark_grammar": prefix}, *inner]})


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar; each request advances its own copy of ``matcher``."""

    text: str
    matcher: llguidance.LLMatcher = field(repr=False)


def special_tokens(tokenizer: TokenizerWrapper) -> dict[str, int]:
    """The ids of the tokenizer's special tokens by their text."""
    decoder = tokenizer._tokenizer.added_tokens_decoder
    return {token.content: i for i, token in decoder.items() if token.special}


class _TokenizerView:
    """What llguidance reads of a tokenizer: each token's bytes and the special ids.

    Only tokens the tokenizer marks special are special to the grammar, so markers
    such as Qwen's non-special ``<tool_call>`` match the grammar's text.
    """

    def __init__(self, tokenizer: TokenizerWrapper, token_bytes: TokenBytes):
        hf = tokenizer._tokenizer
        self.tokens = list(token_bytes.table)
        self.special_token_ids = sorted(special_tokens(tokenizer).values())
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = hf.bos_token_id
        self._hf = hf

    def __call__(self, text: bytes) -> list[int]:
        return self._hf.encode(
            text.decode("utf-8", errors="replace"), add_special_tokens=False
        )


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the latest by their text.

    Thread-safe: handlers compile while they parse a request, off the event loop.
    """

    def __init__(
        self, tokenizer: TokenizerWrapper, token_bytes: TokenBytes, vocab_size: int
    ):
        self._tokenizer = tokenizer
        self._token_bytes = token_bytes
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # The special tokens' ids by their text, which format grammars name.
        self.specials = special_tokens(tokenizer)
        # Grammars compiled so far (cache misses).
        self.compilations = 0

    def compile(
        self, text: str, reasoning: str = "", lark: bool = False
    ) -> CompiledGrammar:
        """``text``, a request's Grammar (or with ``lark``, a Lark grammar of ours),
        for the answer after ``reasoning`` (``formats.grammars.reasoning_prefix``)."""
        key = (text, reasoning, lark)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            if self._ll_tokenizer is None:
                # Built on first use: most models never see a grammar.
                view = _TokenizerView(self._tokenizer, self._token_bytes)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(view),
                    n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids),
                )
            grammar = (
                llguidance.grammar_from("lark", text) if lark else to_llguidance(text)
            )
            if reasoning:
                grammar = after_reasoning(reasoning, grammar)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self._ll_tokenizer
            )
            if failed:
                raise InvalidArgument(f"Grammar: {messages[0]}")
            matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise InvalidArgument(f"Grammar: {matcher.get_error()}")
            compiled = CompiledGrammar(text, matcher)
            self.compilations += 1
            logger.debug("compiled a grammar of %d characters", len(text))
            self._compiled[key] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled


class GrammarState:
    """One request's matcher, advanced by the generated tokens in order.

    Each token is seen once: by the processor's next call, or by the reply
    pipeline before it emits the token, whichever comes first.
    """

    def __init__(self, grammar: CompiledGrammar):
        self.matcher = grammar.matcher.deep_copy()
        # Generated tokens seen, and of them those the matcher has taken.
        self.seen = 0
        self.consumed = 0
        # Whether they complete the grammar, and why the output can't go on.
        self.complete = False
        self.error: str | None = None
        # Per step whose token is not seen yet: whether no logit was left finite.
        self._blocked: deque[mx.array] = deque()

    def see(self, token: int) -> None:
        """Advance past the next generated token; ``error`` says if it can't be."""
        self.seen += 1
        blocked = self._blocked.popleft() if self._blocked else None
        if self.error is not None or self.complete:
            return
        if blocked is not None and blocked.item():
            # Sampling a row of -inf picks token 0, whatever it is.
            self.error = (
                "no token was left to sample: the other logits processors "
                "masked every token the grammar allows"
            )
            return
        if not self.matcher.consume_token(token):
            # llguidance's message goes on with its whole parser state.
            reason = (self.matcher.get_error() or "").strip().splitlines()[:1]
            self.error = ": ".join([f"token {token} breaks the grammar", *reason])
        self.consumed += 1
        self.complete = self.matcher.is_stopped()

    def watch(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """The chain's last logits processor: notes whether the step leaves any
        token to sample, read when its token is seen."""
        self._blocked.append(mx.all(mx.isneginf(logits)))
        return logits

    def ends_before(self, generated: int) -> bool:
        """Whether the token after ``generated`` ones lies past a complete grammar."""
        return self.complete and generated >= self.consumed


def make_grammar_processor(
    grammar: CompiledGrammar, eos_tokens: Iterable[int], vocab_size: int
) -> tuple[GrammarState, Callable[[mx.array, mx.array], mx.array]]:
    """A logits processor that allows only what ``grammar`` allows next.

    The matcher takes each sampled token at the next call (unless the reply
    pipeline saw it first). The previous token is read as soon as it exists,
    while the model's forward pass runs, so the mask is computed during the
    forward pass. A finished grammar, or a dead end, leaves only
    end-of-sequence: the sequence always ends. ``state.watch`` goes last in the
    processor chain.

    Returns:
        ``(state, processor)``: the engine reads ``state.error`` for each token.
    """
    state = GrammarState(grammar)
    matcher = state.matcher
    # llguidance's Metal kernel where there is Metal; MLX ops elsewhere.
    metal = mx.metal.is_available()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    # The bitmask words without the end-of-sequence bits, to tell "only EOS" apart.
    not_eos = np.full(bitmask.shape[1], 0xFFFFFFFF, dtype=np.uint32)
    for token in eos_tokens:
        not_eos[token // 32] &= ~np.uint32(1 << token % 32)
    eos = min(eos_tokens)
    only_eos = None
    calls = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls, only_eos
        # Queued before the forward pass, the previous token need not wait for it.
        last = tokens[-1]
        mx.async_eval(last)
        mx.async_eval(logits)
        if state.seen < calls:
            state.see(last.item())
        calls += 1
        if state.error is None and not state.complete:
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            words = bitmask[0].view(np.uint32)
            if (words & not_eos).any():
                if metal:
                    return llguidance.mlx.apply_token_bitmask(logits, bitmask)
                return mx.where(
                    _unpack(mx.array(bitmask[0]), logits.shape[-1]), logits, -mx.inf
                )
            # Nothing but end-of-sequence may follow: the output is complete.
            if words.any():
                state.complete = True
            else:
                state.error = "no token can continue the output (a dead end)"
        if only_eos is None:
            only_eos = mx.arange(logits.shape[-1]) == eos
        return mx.where(only_eos, mx.zeros_like(logits), -mx.inf)

    return state, process


def _unpack(words: mx.array, width: int) -> mx.array:
    """A bitmask's words as ``width`` booleans; tokens past the mask are forbidden."""
    allowed = ((words[:, None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(-1)
    if allowed.size < width:
        allowed = mx.concatenate([allowed, mx.zeros(width - allowed.size, mx.int32)])
    return allowed[:width].astype(mx.bool_)
