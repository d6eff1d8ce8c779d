"""Proposers for speculative decoding: prompt lookup (``NgramProposer``: the tokens
that followed the latest earlier occurrence of the sequence's last n tokens) and a
draft model (``DraftProposer``). ``cheap`` says whether a proposal costs nothing,
so that it can be checked against plain decoding's tokens for free."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache


class NgramProposer:
    """Prompt lookup over a sequence's tokens (prompt and output).

    Each n-gram maps to where the tokens that followed its latest occurrence start,
    so a proposal costs a few dictionary lookups whatever the sequence's length.
    """

    # Proposals cost nothing: they can be checked against plain decoding's tokens.
    cheap = True

    def __init__(self, n_min: int, n_max: int):
        self._sizes = range(n_max, n_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens`` (which only ever grows)."""
        for end in range(self._indexed, len(tokens)):
            # The n-grams that end just before ``end`` are followed by it.
            for n in self._sizes:
                if end >= n:
                    self._index[tuple(tokens[end - n : end])] = end
        self._indexed = len(tokens)
        for n in self._sizes:
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None and len(tokens) >= n:
                return tokens[start : start + limit]
        return []

    def catch_up(self, tokens: list[int]) -> bool:
        """Ready to propose after ``tokens``: lookups need no catching up."""
        return True

    def rewind(self, accepted: int, proposed: int) -> None:
        pass


class DraftProposer:
    """Greedy proposals from a small model with the model's vocabulary.

    It keeps its own KV cache of the sequence, catches up on tokens it has not
    seen (while the sequence decoded in the batch), and is rewound past the
    proposals the model rejected.
    """

    cheap = False

    def __init__(self, model: nn.Module, prefill_step_size: int):
        self._model = model
        self._step_size = prefill_step_size
        self._cache: list | None = None
        # Tokens of the sequence in the draft's KV cache, and proposals fed to it.
        self._fed = 0
        self._proposed = 0

    def catch_up(self, tokens: list[int]) -> bool:
        """Feed the draft one chunk of the tokens before the last of ``tokens``
        that it has not seen; whether it has seen them all now. A batch calls
        this once a step, so a long prompt's catching up never stalls a step by
        more than one chunk of the draft."""
        if self._cache is None:
            self._cache = make_prompt_cache(self._model)
        chunk = tokens[self._fed : -1][: self._step_size]
        if chunk:
            self._model(mx.array(chunk)[None], cache=self._cache)
            mx.eval([c.state for c in self._cache])
            self._fed += len(chunk)
        return self._fed >= len(tokens) - 1

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        if limit < 1:
            return []
        while not self.catch_up(tokens):
            pass
        y = mx.array(tokens[-1:])
        proposals = []
        for _ in range(limit):
            y = mx.argmax(self._model(y[None], cache=self._cache)[0, -1:], axis=-1)
            mx.async_eval(y)
            proposals.append(y)
        # Fed: the sequence and every proposal but the last.
        self._fed, self._proposed = len(tokens), limit - 1
        return mx.concatenate(proposals).tolist()

    def rewind(self, accepted: int, proposed: int) -> None:
        """Keep the accepted proposals in the draft's KV cache, drop the rest."""
        kept = min(accepted, self._proposed)
        trim_prompt_cache(self._cache, self._proposed - kept)
        self._fed += kept
        self._proposed = 0
