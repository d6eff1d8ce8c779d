"""The reply pipeline: one request's generated tokens in, its stream events out.

Each token goes through the same steps: detokenize (as a continuation of the
prompt) -> stop strings and classification into content, reasoning and tool calls
(``chat_output.OutputParser``) -> logprob entries -> ``Output`` / ``Finished``.
"""

import time
from dataclasses import dataclass

from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.base import ChatFormat
from mlx_backend.grammar import GrammarState
from mlx_backend.output.chat_output import Delta, OutputParser, merge_deltas
from mlx_backend.output.detokenizer import ContinuationDetokenizer, TokenBytes
from mlx_backend.request_parsing import GenerationRequest
from mlx_utils import Scored


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its bytes, logprob and the best alternatives."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class Output:
    """Streamed text, with the logprobs of the tokens it completes."""

    delta: Delta
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last event of a generation; ``delta`` is what was not yet streamed."""

    delta: Delta
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float
    generation_seconds: float
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()


class ReplyPipeline:
    """Turns one request's generated tokens into ``Output`` and ``Finished`` events.

    ``add`` takes each token as the model makes it and returns the event it
    completes, if any; the reply ends with one ``Finished``, after which
    ``finished`` holds it.
    """

    def __init__(
        self,
        request: GenerationRequest,
        tokenizer,
        chat_format: ChatFormat,
        token_bytes: TokenBytes,
        grammar: GrammarState | None = None,
    ):
        self.request = request
        self._token_bytes = token_bytes
        self._grammar = grammar
        self._eos = frozenset() if request.ignore_eos else tokenizer.eos_token_ids
        self._detokenizer = ContinuationDetokenizer(tokenizer, request.prompt)
        self._output = OutputParser(
            request.output.chat_format or chat_format, request.stop, request.output
        )
        # Logprob entries of tokens whose text has not gone out yet.
        self._logprobs: list[TokenLogprob] = []
        self.generated = 0
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished: Finished | None = None

    def add(self, token: int, scored: Scored | None = None) -> Output | Finished | None:
        """The event ``token`` completes: None while its text is held back.

        Raises:
            InvalidArgument: The grammar could not follow the generated tokens.
        """
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        grammar = self._grammar
        if grammar is not None and grammar.seen <= self.generated:
            # No processor call has seen it yet (the reply's last token).
            grammar.see(token)
        if grammar is not None and grammar.error is not None:
            raise InvalidArgument(
                f"Grammar: generation stopped after {self.generated} tokens: "
                f"{grammar.error}"
            )
        if token in self._eos:
            return self.finish("stop")
        if grammar is not None and grammar.ends_before(self.generated):
            # The grammar is complete; its end-of-sequence ends even an IgnoreEOS reply.
            return self.finish("stop")
        self.generated += 1
        if scored is not None:
            self._logprobs.append(self._logprob_entry(token, *scored))
        self._detokenizer.add_token(token)
        if self.generated >= self.request.max_tokens:
            return self.finish("length")
        delta, stopped = self._output.feed(self._detokenizer.last_segment)
        if stopped:
            return self.finish("stop", delta)
        return Output(delta, self._take_logprobs()) if delta else None

    def finish(self, reason: str, delta: Delta | None = None) -> Finished:
        """End the reply: what is still held back goes out with the ``Finished``."""
        if delta is None:
            self._detokenizer.finalize()
            delta, stopped = self._output.feed(self._detokenizer.last_segment)
            if stopped:
                reason = "stop"
        # Then what the parser holds back: unfinished markers, an open tool call.
        delta = merge_deltas((delta, self._output.finish()))
        now = time.perf_counter()
        first = self.first_token_at or now
        self.finished = Finished(
            delta=delta,
            prompt_tokens=len(self.request.prompt),
            completion_tokens=self.generated,
            prompt_seconds=first - self.started,
            generation_seconds=now - first,
            finish_reason=reason,
            logprobs=self._take_logprobs(),
        )
        return self.finished

    def _logprob_entry(self, token: int, logprob: float, top: list) -> TokenLogprob:
        text = self._token_bytes.of(token)
        alternatives = tuple((self._token_bytes.of(t), value) for t, value in top)
        return TokenLogprob(text, logprob, alternatives)

    def _take_logprobs(self) -> tuple[TokenLogprob, ...]:
        entries = tuple(self._logprobs)
        self._logprobs.clear()
        return entries
