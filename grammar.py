"""Constrained decoding: request grammars compiled with llguidance, applied as
per-request logits processors.

``PredictOptions.Grammar`` is GBNF (llama.cpp's format, or Lark), a JSON schema
(the text parses as a JSON object), or ``json`` for any JSON object.
"""

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import llguidance.mlx
import llguidance.numpy
import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from python_utils import InvalidArgument

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
        schema = json.loads(source)
    except ValueError:
        schema = None
    try:
        if schema is None:
            return llguidance.grammar_from("gbnf", source)
        if not isinstance(schema, dict):
            raise InvalidArgument("Grammar: a JSON schema must be a JSON object")
        return llguidance.grammar_from("json_schema", source)
    except ValueError as e:
        raise InvalidArgument(f"Grammar: {e}") from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar; each request advances its own copy of ``matcher``."""

    text: str
    matcher: llguidance.LLMatcher = field(repr=False)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the latest by their text.

    Thread-safe: handlers compile while they parse a request, off the event loop.
    """

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, text: str) -> CompiledGrammar:
        with self._lock:
            if text in self._compiled:
                self._compiled.move_to_end(text)
                return self._compiled[text]
            if self._ll_tokenizer is None:
                # About half a second for a 50k vocabulary: built on first use.
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer._tokenizer,
                    n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids),
                )
            grammar = to_llguidance(text)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self._ll_tokenizer
            )
            if failed:
                raise InvalidArgument(f"Grammar: {messages[0]}")
            matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise InvalidArgument(f"Grammar: {matcher.get_error()}")
            compiled = CompiledGrammar(text, matcher)
            self._compiled[text] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled


class GrammarState:
    """One request's matcher; ``error`` says why the output can't go on."""

    def __init__(self, grammar: CompiledGrammar):
        self.matcher = grammar.matcher.deep_copy()
        self.error: str | None = None


def make_grammar_processor(grammar: CompiledGrammar, eos: int, vocab_size: int):
    """A logits processor that allows only what ``grammar`` allows next.

    The matcher takes each sampled token at the next call. The model's forward
    pass is started before the mask is computed, so the two overlap. A finished
    grammar, or a dead end, leaves only ``eos``: the sequence always ends.

    Returns:
        ``(state, processor)``: the engine reads ``state.error`` for each token.
    """
    state = GrammarState(grammar)
    matcher = state.matcher
    # llguidance's Metal kernel where there is Metal; MLX ops elsewhere.
    metal = mx.metal.is_available()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    bits = mx.arange(32, dtype=mx.int32)
    only_eos = None
    started = False

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal started, only_eos
        mx.async_eval(logits)
        if started and state.error is None:
            token = tokens[-1].item()
            if not matcher.consume_token(token):
                state.error = f"token {token} breaks the grammar: {matcher.get_error()}"
        started = True
        if state.error is None and not matcher.is_stopped():
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            if bitmask.any():
                if metal:
                    return llguidance.mlx.apply_token_bitmask(logits, bitmask)
                words = mx.array(bitmask[0])
                allowed = ((words[:, None] >> bits) & 1).reshape(-1)
                allowed = allowed[: logits.shape[-1]].astype(mx.bool_)
                return mx.where(allowed, logits, -mx.inf)
            state.error = "no token can continue the output (a dead end)"
        if only_eos is None:
            only_eos = mx.arange(logits.shape[-1]) == eos
        return mx.where(only_eos, mx.zeros_like(logits), -mx.inf)

    return state, process
