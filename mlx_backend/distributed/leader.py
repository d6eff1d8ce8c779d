"""Rank 0 of a group: its engine runs as it does alone, with three wrappers.

``LeaderDecoder`` around its decoder, ``LeaderPromptCache`` as its prompt cache
and ``LeaderJobs`` around its Score and Embedding queue record what the workers
must replay (admissions, removals, prompt-cache inserts, steps, jobs) as ops for
the ``Lockstep``. ``Leader`` is the rest of the engine's dealings with its group
(joining it, heartbeats, the watchdog, leaving it); ``Solo`` answers the same for
a process that serves alone.
"""

import copy
import logging
from concurrent.futures import Future
from contextlib import nullcontext

from mlx_backend.decoders.base import Decoder, KVState, NewSequence, StepResult
from mlx_backend.distributed.group import join_group, leader_settings
from mlx_backend.distributed.lockstep import (
    AbortJobs,
    Add,
    AddJob,
    DropJob,
    Exit,
    Keep,
    Lockstep,
    Ping,
    Remove,
    Reset,
    Step,
    StepJobs,
    Unload,
    step_states,
)
from mlx_backend.errors import Unavailable
from mlx_cache import ThreadSafeLRUPromptCache
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# While idle, rank 0 checks on the workers this often, so that a lost rank shows
# in Status without a request.
HEARTBEAT_SECONDS = 5.0


class LeaderPromptCache(ThreadSafeLRUPromptCache):
    """Rank 0's prompt cache: inserts of the decoder's KV states are recorded for
    the workers. Score jobs insert states of their own, which the workers' jobs
    insert themselves."""

    def __init__(self, lockstep: Lockstep, **kwargs):
        super().__init__(**kwargs)
        self._lockstep = lockstep

    def insert_state(
        self, model_key, tokens, prompt_cache, holders=1, evaluate=True
    ) -> bool:
        ref = self._lockstep.ref(prompt_cache)
        if ref is not None:
            self._lockstep.record(Keep(ref, tuple(tokens), holders))
        return super().insert_state(model_key, tokens, prompt_cache, holders, evaluate)


class LeaderDecoder(Decoder):
    """Rank 0's decoder: ``inner`` runs here, and every call is recorded for the
    workers, which replay it on their shards before each step.

    A failed step leaves the ranks out of step (rank 0 may have skipped
    collectives that the workers ran), so any failure ends the group.
    """

    def __init__(self, inner: Decoder, lockstep: Lockstep):
        self._inner = inner
        self._lockstep = lockstep
        self.capabilities = inner.capabilities
        self._keys: set[int] = set()

    @property
    def batch_steps(self) -> int:
        return self._inner.batch_steps

    @property
    def batch_tokens(self) -> int:
        return self._inner.batch_tokens

    def kv_nbytes(self) -> int:
        return self._inner.kv_nbytes()

    def add(self, sequence: NewSequence) -> int:
        self._lockstep.check()
        try:
            key = self._inner.add(sequence)
        except Exception as e:
            # Its prompt-cache fetch already ran here, and not on the workers.
            self._lockstep.fail(f"admitting a request failed on rank 0: {e}")
            raise
        reused = len(sequence.prompt) - len(sequence.rest)
        self._lockstep.record(
            Add(
                key,
                sequence.prompt,
                reused,
                sequence.max_tokens,
                sequence.snapshots,
            )
        )
        self._keys.add(key)
        return key

    def step(self) -> list[StepResult]:
        try:
            self._lockstep.flush(Step())
        except Unavailable as e:
            return self._fail_all(e)
        results = self._inner.step()
        failed = next((r.error for r in results if r.error is not None), None)
        if failed is not None:
            self._lockstep.fail(f"a step failed on rank 0: {failed}")
            return self._fail_all(Unavailable(self._lockstep.broken))
        for kv_cache in step_states(results):
            self._lockstep.register(kv_cache)
        self._keys.difference_update(r.key for r in results if r.done)
        return results

    def _fail_all(self, error: Exception) -> list[StepResult]:
        failed = [
            StepResult(key, done=True, error=copy.copy(error)) for key in self._keys
        ]
        self._keys.clear()
        self._inner.reset()
        return failed

    def remove(self, key: int, keep_state: bool = True) -> KVState | None:
        state = self._inner.remove(key, keep_state)
        if key in self._keys:
            self._keys.discard(key)
            self._lockstep.record(Remove(key, keep_state))
            if state is not None:
                self._lockstep.register(state.cache)
        return state

    def reset(self) -> None:
        self._inner.reset()
        self._keys.clear()
        self._lockstep.record(Reset())

    def close(self) -> None:
        self._inner.close()
        self._keys.clear()


class LeaderJobs:
    """Rank 0's Score, Rerank and Embedding queue: the workers run every job too."""

    def __init__(self, inner, lockstep: Lockstep):
        self._inner = inner
        self._lockstep = lockstep

    def __bool__(self) -> bool:
        return bool(self._inner)

    def add(self, request, future: Future) -> None:
        self._inner.add(request, future)
        self._lockstep.record(AddJob(request))

    def step(self, served, before_answer) -> None:
        try:
            self._lockstep.flush(StepJobs())
        except Unavailable as e:
            self._inner.abort(e)
            return
        self._inner.step(served, before_answer)

    def abort(self, error: Exception) -> None:
        self._inner.abort(error)
        self._lockstep.record(AbortJobs())

    def withdraw(self, future: Future) -> int | None:
        place = self._inner.withdraw(future)
        if place is not None:
            self._lockstep.record(DropJob(place))
        return place


class Solo:
    """A process that serves alone: what the engine asks of its group, answered
    for no group."""

    lockstep = None
    size = 1
    broken = None
    # An idle engine blocks until a message comes.
    idle_timeout = None

    def check(self) -> None:
        pass

    def watching(self):
        return nullcontext()

    def heartbeat(self) -> None:
        pass

    def unloaded(self) -> None:
        pass

    def exit(self) -> None:
        pass


class Leader:
    """Rank 0's dealings with its group beyond the wrapped decoder, prompt cache
    and jobs: heartbeats while idle, the watchdog over each step, the unload and
    the exit."""

    # While idle, rank 0 checks on the workers this often.
    idle_timeout = HEARTBEAT_SECONDS

    def __init__(self, lockstep: Lockstep):
        self.lockstep = lockstep

    @property
    def size(self) -> int:
        return self.lockstep.size

    @property
    def broken(self) -> str | None:
        return self.lockstep.broken

    def check(self) -> None:
        """Unavailable once a rank is lost."""
        self.lockstep.check()

    def watching(self):
        """Over a group, a turn that hangs in a collective ends the process."""
        return self.lockstep.watching()

    def heartbeat(self) -> None:
        """While idle, check that every rank of the group is still there."""
        if self.lockstep.broken is None:
            try:
                with self.lockstep.watching():
                    self.lockstep.flush(Ping(), wait=True)
            except Unavailable:
                pass

    def unloaded(self) -> None:
        if self.lockstep.broken is None:
            self.lockstep.record(Unload())

    def exit(self) -> None:
        if self.lockstep.broken is None:
            self.lockstep.flush(Exit(), wait=True)


def join_leader(options: LoadOptions, environ) -> Leader | None:
    """Rank 0's group, once every worker is up; None when neither the options
    nor the environment name one."""
    settings = leader_settings(options, environ)
    if settings is None:
        return None
    group, doorbell = join_group(settings)
    logger.info(
        "rank 0 of a %s group of %d ranks (%s)",
        settings.backend,
        group.size(),
        settings.hostfile,
    )
    return Leader(Lockstep(group, doorbell=doorbell))
