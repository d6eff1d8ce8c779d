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


# The last tokens of a reply in which a grammar that has not ended looks for its
# way to the end; once that way takes all that is left, the reply takes it.
CLOSING_WINDOW = 48
# Nodes one look may visit, and the short tokens it tries in a free region.
CLOSING_NODES = 96
CLOSING_BRANCH = 4
# Below this many allowed tokens the grammar is in a literal: try them all.
CLOSING_LITERAL = 64
# Texts that end most free regions: strings, objects, lists, lines.
CLOSING_TEXTS = ('"', "}", "]", ")", "\n")


@dataclass(frozen=True)
class Closing:
    """What the search for a grammar's way to its end tries in a free region: the
    texts that end regions, each as its tokens, then short tokens."""

    closers: tuple[tuple[int, ...], ...]
    short: np.ndarray = field(repr=False)
    # Bytes per token, to try the longest first inside a literal, and whether
    # it is only whitespace.
    lengths: np.ndarray = field(repr=False)
    blank: np.ndarray = field(repr=False)
    eos: frozenset[int] = frozenset()


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar; each request advances its own copy of ``matcher``."""

    text: str
    matcher: llguidance.LLMatcher = field(repr=False)
    closing: Closing | None = field(default=None, repr=False)


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
        # The short tokens a closing search tries; each token's length, blankness.
        self._short: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # Grammars compiled so far (cache misses).
        self.compilations = 0

    def compile(
        self,
        text: str,
        reasoning: str = "",
        lark: bool = False,
        closers: tuple[str, ...] = (),
    ) -> CompiledGrammar:
        """``text``, a request's Grammar (or with ``lark``, a Lark grammar of ours),
        for the answer after ``reasoning`` (``formats.grammars.reasoning_prefix``);
        ``closers`` end its free regions besides JSON's (``closing_texts``)."""
        key = (text, reasoning, lark, closers)
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
            compiled = CompiledGrammar(text, matcher, self._closing(closers))
            self.compilations += 1
            logger.debug("compiled a grammar of %d characters", len(text))
            self._compiled[key] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def _closing(self, closers: tuple[str, ...]) -> Closing:
        if self._short is None:
            table = self._token_bytes.table
            lengths = np.array([len(piece) for piece in table], dtype=np.int32)
            blank = np.array([p.isspace() for p in table], dtype=bool)
            special = set(self.specials.values())
            short = [t for t, p in enumerate(table) if 0 < len(p) <= 2]
            short = [t for t in short if t not in special]
            # Closing punctuation first, then the rest.
            short.sort(key=lambda t: (not set(table[t]) <= set(b'"}])>'), t))
            self._short = np.array(short, dtype=np.int64), lengths, blank
        runs = [
            tuple(self._tokenizer.encode(text, add_special_tokens=False))
            for text in (*closers, *CLOSING_TEXTS)
        ]
        short, lengths, blank = self._short
        return Closing(
            tuple(dict.fromkeys(run for run in runs if run)),
            short,
            lengths,
            blank,
            frozenset(self._tokenizer.eos_token_ids),
        )


def find_close(
    matcher: llguidance.LLMatcher,
    closing: Closing,
    bitmask: np.ndarray,
    budget: int,
    nodes: int = CLOSING_NODES,
) -> list[int] | None:
    """Tokens that take ``matcher`` to where its grammar may end, at most
    ``budget`` of them, found depth first: in a literal (few tokens allowed) the
    longest allowed token first; in a free region the closing texts that leave
    it, then short tokens. The matcher is left as it was; None when the search
    finds no way."""
    path: list[int] = []
    visited = 0
    vocab = len(closing.lengths)

    def allowed() -> np.ndarray:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
        return bits[:vocab].astype(bool)

    def take(run) -> bool:
        taken = matcher.try_consume_tokens(list(run))
        if taken < len(run):
            matcher.rollback(taken)
        return taken == len(run)

    def moves(mask: np.ndarray) -> list[tuple[int, ...]]:
        free = int(mask.sum())
        if free <= CLOSING_LITERAL:
            ids = [t for t in np.flatnonzero(mask).tolist() if t not in closing.eos]
            # Whitespace last: it is optional wherever a grammar has it.
            order = sorted(ids, key=lambda t: (closing.blank[t], -closing.lengths[t]))
            return [(t,) for t in order]
        leaving = []
        for run in closing.closers:
            if mask[run[0]] and take(run):
                # A closing text that leaves the free region (what may follow
                # changes), not one the region's text merely goes on with.
                if int(allowed().sum()) != free:
                    leaving.append(run)
                matcher.rollback(len(run))
        short = closing.short[mask[closing.short]][:CLOSING_BRANCH]
        return leaving + [(t,) for t in short.tolist()]

    def search(depth: int) -> bool:
        nonlocal visited
        if matcher.is_accepting():
            return True
        if depth >= budget or visited >= nodes:
            return False
        visited += 1
        for run in moves(allowed()):
            if depth + len(run) > budget or not take(run):
                continue
            path.extend(run)
            if search(depth + len(run)):
                return True
            del path[-len(run) :]
            matcher.rollback(len(run))
        return False

    found = search(0)
    matcher.rollback(len(path))
    return path if found else None


class GrammarState:
    """One request's matcher, advanced by the generated tokens in order.

    Each token is seen once: by the processor's next call, or by the reply
    pipeline before it emits the token, whichever comes first.
    """

    def __init__(self, grammar: CompiledGrammar, limit: int | None = None):
        self.matcher = grammar.matcher.deep_copy()
        self._closing = grammar.closing if limit is not None else None
        # Tokens the reply may have (max_tokens), and a scratch mask for closing.
        self.limit = limit
        self._scratch: np.ndarray | None = None
        # The rest of the way to the grammar's end once the reply takes it, and
        # the token it was last given.
        self._way: deque[int] = deque()
        self._forced: int | None = None
        # The position of the next look for the way, and the looks that found none.
        self._next_look = 0
        self._misses = 0
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
        if token != self._forced:
            self._way.clear()  # another processor chose otherwise
        self._forced = None
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
        blocked = mx.all(mx.isneginf(logits))
        # Computed with the step, so that reading it with the token waits for
        # nothing queued after it (the next forward pass).
        mx.async_eval(blocked)
        self._blocked.append(blocked)
        return logits

    def closing_token(self, position: int) -> int | None:
        """The token at ``position`` when the grammar's way to its end takes all
        the tokens left (an end-of-sequence token where it may end now); None
        while there is room, or no way is found."""
        closing = self._closing
        if closing is None or not 0 < self.limit - position <= CLOSING_WINDOW:
            return None
        if not self._way:
            left = self.limit - position
            if position < self._next_look:
                return None
            if self._scratch is None:
                self._scratch = llguidance.numpy.allocate_token_bitmask(
                    1, len(closing.lengths)
                )
            # After a look that found none, a look over fewer states: the way
            # rarely gets shorter than it was.
            nodes = CLOSING_NODES // 3 if self._misses else CLOSING_NODES
            path = find_close(self.matcher, closing, self._scratch, left - 1, nodes)
            if path is None:
                # Fewer tokens will be left: look again 4, 8, 16... steps on.
                self._next_look = position + (4 << self._misses)
                self._misses += 1
                return None
            if len(path) + 1 < left:
                # Look again once a third of the room the way leaves is gone (a
                # token can lengthen the way by about one).
                self._next_look = position + max(1, (left - len(path) - 1) // 3)
                return None
            self._way.extend([*path, min(closing.eos)])
        self._forced = self._way.popleft()
        return self._forced

    def ends_before(self, generated: int) -> bool:
        """Whether the token after ``generated`` ones lies past a complete grammar."""
        return self.complete and generated >= self.consumed


def make_grammar_processor(
    grammar: CompiledGrammar,
    eos_tokens: Iterable[int],
    vocab_size: int,
    limit: int | None = None,
) -> tuple[GrammarState, Callable[[mx.array, mx.array], mx.array]]:
    """A logits processor that allows only what ``grammar`` allows next, and with
    a ``limit`` of tokens, closes the grammar before the reply runs out of them.

    The matcher takes each sampled token at the next call (unless the reply
    pipeline saw it first). The previous token is read as soon as it exists,
    while the model's forward pass runs, so the mask is computed during the
    forward pass. A finished grammar, or a dead end, leaves only
    end-of-sequence: the sequence always ends. ``state.watch`` goes last in the
    processor chain.

    Returns:
        ``(state, processor)``: the engine reads ``state.error`` for each token.
    """
    state = GrammarState(grammar, limit)
    matcher = state.matcher
    # llguidance's Metal kernel where there is Metal; MLX ops elsewhere.
    metal = mx.metal.is_available()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    # The bitmask words without the end-of-sequence bits, to tell "only EOS" apart.
    not_eos = np.full(bitmask.shape[1], 0xFFFFFFFF, dtype=np.uint32)
    for token in eos_tokens:
        not_eos[token // 32] &= ~np.uint32(1 << token % 32)
    eos = min(eos_tokens)
    calls = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        # Queued before the forward pass, the previous token need not wait for it.
        last = tokens[-1]
        mx.async_eval(last)
        mx.async_eval(logits)
        if state.seen < calls:
            state.see(last.item())
        position = calls
        calls += 1
        if state.error is None and not state.complete:
            closing = state.closing_token(position)
            if closing is not None:
                # The rest of the way to the grammar's end just fits.
                return _only(closing, logits)
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
        return _only(eos, logits)

    return state, process


def _only(token: int, logits: mx.array) -> mx.array:
    """Logits under which any sampler picks ``token``."""
    return mx.where(
        mx.arange(logits.shape[-1]) == token, mx.zeros_like(logits), -mx.inf
    )


def _unpack(words: mx.array, width: int) -> mx.array:
    """A bitmask's words as ``width`` booleans; tokens past the mask are forbidden."""
    allowed = ((words[:, None] >> mx.arange(32, dtype=mx.int32)) & 1).reshape(-1)
    if allowed.size < width:
        allowed = mx.concatenate([allowed, mx.zeros(width - allowed.size, mx.int32)])
    return allowed[:width].astype(mx.bool_)
