"""Token text: each token's bytes, and a streaming detokenizer for a reply that
continues a prompt."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    _byte_decoder,
)


@dataclass(frozen=True)
class TokenBytes:
    """Each token's bytes as they continue a text."""

    table: tuple[bytes, ...]

    def of(self, token: int) -> bytes:
        return self.table[token] if 0 <= token < len(self.table) else b""


def make_token_bytes(tokenizer: TokenizerWrapper) -> TokenBytes:
    detokenizer = tokenizer.detokenizer
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        return TokenBytes(tuple(map(_bpe_bytes, detokenizer.tokenmap)))
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        return TokenBytes(
            tuple(t.replace("\u2581".encode(), b" ") for t in detokenizer.tokenmap)
        )
    tokens = range(len(tokenizer.vocab))
    return TokenBytes(tuple(tokenizer.decode([t]).encode("utf-8") for t in tokens))


def _bpe_bytes(piece: str) -> bytes:
    """A byte-level BPE piece's bytes: each character the byte it stands for, any
    other character its UTF-8 (an added token's text)."""
    try:
        # One C pass: the table maps each character below 256 to Latin-1 text
        # whose encoding is those bytes; a character above it that stands for
        # no byte fails the encoding.
        return piece.translate(_bpe_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        decoder = _byte_decoder()
        return b"".join(
            bytes((decoder[c],)) if c in decoder else c.encode("utf-8") for c in piece
        )


@cache
def _bpe_latin1() -> dict[int, str]:
    decoder = _byte_decoder()
    table = {ord(c): chr(b) for c, b in decoder.items()}
    for code in range(256):
        if chr(code) not in decoder:
            table[code] = chr(code).encode("utf-8").decode("latin-1")
    return table


# Prompt tokens a reply's detokenizer starts from: enough to hold the bytes of any
# character and the space before a word.
DETOKENIZER_CONTEXT = 4


class ContinuationDetokenizer:
    """mlx-lm's streaming detokenizer for a reply that continues a prompt.

    Its text is ``decode(prompt + reply)`` minus ``decode(prompt)``. mlx-lm's
    detokenizers drop the first space of their text, which is right at the start of
    a text and wrong after a prompt ("The capital of France is" -> " Paris"), so this
    one starts from the prompt's last tokens and streams only what follows them.
    """

    def __init__(self, tokenizer: TokenizerWrapper, prompt: Sequence[int]):
        context = list(prompt[-DETOKENIZER_CONTEXT:])
        self._detokenizer = tokenizer.detokenizer
        measure = tokenizer.detokenizer
        for token in context:
            self._detokenizer.add_token(token)
            measure.add_token(token)
        # The context's whole text, including what the detokenizer still holds.
        measure.finalize()
        self._offset = len(measure.text)

    def add_token(self, token: int) -> None:
        self._detokenizer.add_token(token)

    def finalize(self) -> None:
        self._detokenizer.finalize()

    @property
    def last_segment(self) -> str:
        """The reply's text since the last call."""
        text = self._detokenizer.text
        segment = text[self._offset :]
        self._offset = max(self._offset, len(text))
        return segment
