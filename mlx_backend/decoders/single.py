"""One mlx-lm ``generate_step`` per sequence, for KV caches that can't batch."""

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from mlx_backend.decoders.base import (
    Capabilities,
    Decoder,
    KVState,
    NewSequence,
    StepResult,
)
from mlx_backend.sampling import see_cached_prompt
from mlx_cache import cache_nbytes
from mlx_utils import gather_logprobs
from python_utils import LoadOptions

logger = logging.getLogger(__name__)


class _Cancelled(Exception):
    """Raised from the prefill progress callback to stop a cancelled prompt."""


@dataclass
class _SingleRow:
    tokens: Iterator
    kv_cache: list
    logprobs: int | None
    # Every token the model has been given a step for, prompt first.
    fed: list[int]
    # The tokens the KV cache holds: prefill adds whole chunks, and the step
    # for a token runs before it is yielded (the last one allowed included).
    held: int


class SingleDecoder(Decoder):
    """One mlx-lm ``generate_step`` per sequence, for models whose KV caches can't
    be merged into a batch."""

    def __init__(self, model: nn.Module, options: LoadOptions, trimmable: bool):
        self._model = model
        self._step_size = options.prefill_step_size
        self.capabilities = Capabilities(batching=False, trimmable_cache=trimmable)
        self._rows: dict[int, _SingleRow] = {}
        self._next_key = 0

    def add(self, sequence: NewSequence) -> int:
        reused = len(sequence.prompt) - len(sequence.rest)
        key = self._next_key

        def check_cancelled(processed: int, total: int) -> None:
            # The last call comes after the first token's step is queued: the
            # scheduler sees a cancellation then.
            if processed < total:
                self._rows[key].held = reused + processed
                if sequence.cancelled():
                    raise _Cancelled()

        tokens = generate_step(
            mx.array(sequence.rest),
            self._model,
            max_tokens=sequence.max_tokens,
            sampler=sequence.sampler,
            logits_processors=see_cached_prompt(
                sequence.processors, sequence.prompt[:reused], sequence.history
            ),
            prefill_step_size=self._step_size,
            prompt_cache=sequence.kv_cache,
            prompt_progress_callback=check_cancelled,
        )
        self._next_key += 1
        self._rows[key] = _SingleRow(
            tokens,
            sequence.kv_cache,
            sequence.logprobs,
            list(sequence.prompt),
            reused,
        )
        return key

    def step(self) -> list[StepResult]:
        results = []
        for key, row in list(self._rows.items()):
            try:
                token, logprobs = next(row.tokens)
            except StopIteration:
                results.append(StepResult(key, done=True))
                continue
            except _Cancelled:
                results.append(StepResult(key, done=True))
                continue
            except Exception as e:
                logger.exception("generation failed")
                # A failed step can leave arrays that fail again when evaluated.
                state = self._remove(key, keep_state=True, failed=True)
                error = e.with_traceback(None)
                results.append(StepResult(key, done=True, state=state, error=error))
                continue
            row.fed.append(token)
            row.held = len(row.fed)
            scored = None
            if row.logprobs is not None:
                scored = gather_logprobs([logprobs], [token], row.logprobs)[0]
            results.append(StepResult(key, (token,), (scored,)))
        return results

    def kv_nbytes(self) -> int:
        return sum(cache_nbytes(row.kv_cache) for row in self._rows.values())

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        return self._remove(key, keep_state, failed=False)

    def _remove(self, key: int, keep_state: bool, failed: bool) -> KVState | None:
        row = self._rows.pop(key, None)
        if row is None:
            return None
        row.tokens.close()
        if not keep_state:
            return None
        if failed:
            try:
                mx.eval([layer.state for layer in row.kv_cache])
            except Exception:
                logger.warning("not caching the KV state of a failed generation")
                return None
        return KVState(row.kv_cache, row.fed[: row.held])

    def reset(self) -> None:
        for row in self._rows.values():
            row.tokens.close()
        self._rows.clear()
