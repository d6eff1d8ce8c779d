"""The decoder contract: each generation path is a ``Decoder`` the engine drives.

A decoder holds the sequences being generated. ``add`` gives it one (its prompt
remainder, KV cache, sampler and processors), ``step`` runs one step for all of
them and returns a typed ``StepResult`` per sequence, ``remove`` takes one out
with its KV state, and ``reset`` drops them all. The engine never asks which
decoder runs; a new generation path is one new ``Decoder`` class.
"""

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_utils import Scored

# MLX streams belong to the thread that made them: one per engine thread.
_thread = threading.local()


def thread_stream() -> mx.Stream:
    """The calling thread's stream for decode steps: small evaluations on its
    default stream, such as logprobs, need not wait behind the next step."""
    if not hasattr(_thread, "stream"):
        _thread.stream = mx.new_stream(mx.default_device())
    return _thread.stream


@dataclass(frozen=True)
class Capabilities:
    """What a decoder can do; the engine refuses requests that need more."""

    # Sequences share forward passes.
    batching: bool
    # KV caches can be trimmed, so prompt-cache hits can be exact and drafts undone.
    trimmable_cache: bool
    logprobs: bool = True
    grammar: bool = True
    # KV states of prompt prefixes are handed back as prefill passes them.
    prefix_snapshots: bool = False


@dataclass(frozen=True)
class KVState:
    """A sequence's KV cache and the tokens it was given, for the prompt cache."""

    cache: list
    tokens: list[int]


@dataclass(frozen=True)
class Pending:
    """A decoding sequence taken out between steps: its KV state holds every token
    it returned, and ``token`` is the next one, sampled but not yet returned."""

    state: KVState
    token: int
    # The log probabilities ``token`` was sampled from (after processors).
    logprobs: mx.array


@dataclass(frozen=True)
class NewSequence:
    """What a decoder needs to start generating one sequence."""

    prompt: tuple[int, ...]
    # The prompt tokens ``kv_cache`` lacks (at least one, for the first logits).
    rest: tuple[int, ...]
    kv_cache: list
    sampler: Callable
    processors: list
    max_tokens: int
    # Alternatives per token for its logprob entries; None: no logprobs.
    logprobs: int | None = None
    # The prompt tokens penalty processors look back over.
    history: int = 64
    # Polled between prefill chunks, so a long prompt stops within one chunk.
    cancelled: Callable[[], bool] = lambda: False
    # Prompt lengths whose KV state is handed back as prefill passes them
    # (``StepResult.snapshots``), where the decoder can.
    snapshots: tuple[int, ...] = ()
    # Proposed tokens a step may verify, where the decoder speculates (0: none).
    draft_tokens: int = 0
    # It was decoding elsewhere and comes back: its prefill is a decode step's work.
    resumes: bool = False


@dataclass(frozen=True)
class StepResult:
    """One sequence's share of a step."""

    key: int
    tokens: tuple[int, ...] = ()
    # Per token, when asked for: its logprob and its best alternatives.
    logprobs: tuple[Scored | None, ...] = ()
    # The decoder is done with the sequence (token limit, cancelled prefill, error).
    done: bool = False
    # The KV state of a sequence that left the decoder within the step.
    state: KVState | None = None
    # Without its traceback: it must not hold MLX arrays on the handlers' thread.
    error: Exception | None = None
    # Copies of the KV state of the prompt prefixes that prefill passed this step.
    snapshots: tuple[KVState, ...] = ()
    # Speculative decoding: tokens proposed this step, and how many the model kept.
    proposed: int = 0
    accepted: int = 0


class Decoder(ABC):
    """One generation path. Every method runs on the engine thread."""

    capabilities: Capabilities
    # Steps that decoded sequences together, and the tokens they made.
    batch_steps = 0
    batch_tokens = 0
    # Speculative decoding: whether it runs, tokens proposed, and those kept.
    speculates = False
    draft_proposed = 0
    draft_accepted = 0
    # Prompt tokens the step budget gave the last step it bounded.
    step_token_budget = 0

    @abstractmethod
    def add(self, sequence: NewSequence) -> int:
        """Start generating ``sequence``; the key its results carry."""

    @abstractmethod
    def step(self) -> list[StepResult]:
        """One step for every sequence: a result for each one it advanced."""

    @abstractmethod
    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        """Take a sequence out; its KV state when asked for and sound."""

    def kv_nbytes(self) -> int:
        """Bytes of KV cache the sequences hold now."""
        return 0

    def free_pool_nbytes(self) -> int:
        """Bytes of a KV pool kept for the next sequences, held by none now."""
        return 0

    def take_pending(self, key: int) -> "Pending | None":
        """Take a decoding sequence out with the token its next step already
        sampled; None where the decoder can't (then ``remove`` it)."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Drop every sequence and keep serving."""

    def close(self) -> None:
        """Drop every sequence for good (the model is unloaded)."""
        self.reset()
