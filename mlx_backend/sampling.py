"""Sampling and logits processors: a request's sampler and its processor chain."""

import math
import secrets
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from mlx_backend.grammar import GrammarState, make_grammar_processor
from mlx_backend.request_parsing import GenerationRequest


class SeededSampler:
    """A sampler like mlx-lm's ``make_sampler`` that draws from its own RNG key.

    Token ``position`` of a reply is drawn with the position-th key split off the
    seed's, so a seeded request is deterministic whatever else runs, the global
    RNG is never touched, and speculative decoding, which samples several
    positions in one call and may discard some, draws what plain decoding draws.
    """

    def __init__(self, temperature, top_p, min_p, top_k, seed: int):
        self._filters = []
        if 0 < top_p < 1.0:
            self._filters.append(lambda x: apply_top_p(x, top_p))
        if min_p > 0:
            self._filters.append(lambda x: apply_min_p(x, min_p, 1))
        if top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, top_k))
        self._scale = 1.0 / temperature
        self._key = mx.random.key(seed)
        # The keys of positions ``_first`` on, as far as they were split off.
        self._keys: list[mx.array] = []
        self._first = 0
        # The position of the next token drawn; a row of ``logprobs`` per position.
        self.position = 0

    def _key_at(self, position: int) -> mx.array:
        while self._first + len(self._keys) <= position:
            self._key, key = mx.random.split(self._key)
            self._keys.append(key)
        return self._keys[position - self._first]

    def __call__(self, logprobs: mx.array) -> mx.array:
        # Positions before this one are never drawn again.
        done = self.position - self._first
        del self._keys[:done]
        self._first += done
        for apply in self._filters:
            logprobs = apply(logprobs)
        logits = logprobs * self._scale
        drawn = [
            mx.random.categorical(
                logits[i : i + 1], key=self._key_at(self.position + i)
            )
            for i in range(logits.shape[0])
        ]
        self.position += len(drawn)
        return drawn[0] if len(drawn) == 1 else mx.concatenate(drawn)


def make_seeded_sampler(
    temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None
):
    """The request's sampler: greedy at temperature 0, else a ``SeededSampler``
    (``seed=None`` draws a fresh seed)."""
    if temperature <= 0:
        return greedy_sampler
    if seed is None:
        seed = secrets.randbits(32)
    return SeededSampler(temperature, top_p, min_p, top_k, seed)


def make_processors(
    logit_bias: dict[int, float],
    repetition_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
    context_size: int,
):
    """mlx-lm logits processors; zero disables a penalty, as does a repetition penalty of 1."""
    return make_logits_processors(
        logit_bias=logit_bias or None,
        repetition_penalty=(
            repetition_penalty if repetition_penalty not in (0, 1) else None
        ),
        repetition_context_size=context_size,
        presence_penalty=presence_penalty or None,
        presence_context_size=context_size,
        frequency_penalty=frequency_penalty or None,
        frequency_context_size=context_size,
    )


def see_cached_prompt(processors: list, cached: Sequence[int], context_size: int):
    """Logits processors that also see the prompt tokens served from the prompt cache.

    generate_step hands processors only the tokens it was given, so after a cache
    hit penalties would miss the cached part of the prompt. Prepending its last
    ``context_size`` tokens, only while the history is shorter than that, keeps
    the output the same as without the cache.
    """
    if not processors or not cached:
        return processors
    head = mx.array(cached[-context_size:])

    def wrap(processor):
        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            if tokens.size < context_size:
                tokens = mx.concatenate([head, tokens])
            return processor(tokens, logits)

        return process

    return [wrap(processor) for processor in processors]


def make_request_processors(
    request: GenerationRequest, eos_token_ids, vocab_size: int
) -> tuple[list, GrammarState | None]:
    """The request's logits processors: bias (and banned EOS), penalties, the
    grammar, its own extra ones, then the grammar's watch over what is left to
    sample; and the grammar's state."""
    sampling = request.sampling
    logit_bias = sampling.logit_bias
    if request.ignore_eos:
        # As llama.cpp does: never sample EOS, rather than sampling past it.
        logit_bias = {**logit_bias, **{t: -math.inf for t in eos_token_ids}}
    processors = make_processors(
        logit_bias,
        sampling.repetition_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        sampling.repetition_context_size,
    )
    grammar = None
    if request.grammar is not None:
        # After the ban, so a finished grammar's end-of-sequence overrides it.
        grammar, processor = make_grammar_processor(
            request.grammar, eos_token_ids, vocab_size, request.max_tokens
        )
        processors.append(processor)
    processors.extend(request.processors)
    if grammar is not None:
        processors.append(grammar.watch)
    return processors, grammar


def make_request_sampler(request: GenerationRequest):
    sampling = request.sampling
    return make_seeded_sampler(
        sampling.temperature,
        sampling.top_p,
        sampling.min_p,
        sampling.top_k,
        sampling.seed,
    )
