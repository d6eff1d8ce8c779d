"""A worker of a group: it replays rank 0's ops on its own shard of the model,
decoder, prompt store and job queue, so every rank runs the same forward passes in
the same order. Sampling, grammars and logprobs stay on rank 0: every forward pass
embeds rank 0's token ids (sharding.py), whatever the workers sampled."""

import logging
import time
from concurrent.futures import Future

import mlx.core as mx

from mlx_backend.decoders.base import NewSequence, thread_stream
from mlx_backend.distributed.group import (
    GroupSettings,
    check_in,
    init_group,
    share_cores,
)
from mlx_backend.distributed.lockstep import (
    AbortJobs,
    Add,
    AddJob,
    DropJob,
    Exit,
    Keep,
    Load,
    Lockstep,
    Ping,
    Remove,
    Reset,
    Step,
    StepJobs,
    Unload,
    step_states,
)
from mlx_backend.engine.jobs import JobQueue
from mlx_backend.engine.loader import ServedModel, prepare, resolve
from mlx_backend.engine.prompt_store import PromptCounts
from mlx_backend.errors import Aborted

logger = logging.getLogger(__name__)

# run_worker's exit status when rank 0 was lost (not shut down): a worker
# started on its own then starts afresh and waits for rank 0 to come back.
LOST = 75


def _greedy(logprobs: mx.array) -> mx.array:
    # Workers' picks are never used: every forward pass embeds rank 0's tokens.
    return mx.argmax(logprobs, axis=-1)


class Follower:
    """A worker's replay of rank 0's ops on its own shard of the model."""

    def __init__(self, lockstep: Lockstep):
        self._lockstep = lockstep
        self._served: ServedModel | None = None
        self._jobs = JobQueue()

    def run(self) -> None:
        """Replay ops until rank 0 says to exit (or its connection is lost)."""
        while True:
            *ops, last = self._lockstep.receive()
            for op in ops:
                self._apply(op)
            # Rank 0 forgot its KV states once it sent the ops that name them.
            self._lockstep.forget_states()
            if isinstance(last, Exit):
                logger.info("rank 0 is shutting down; leaving the group")
                return
            self._apply(last)

    def _apply(self, op) -> None:
        served = self._served
        match op:
            case Load():
                self._load(op)
            case Unload():
                self._unload()
            case Add():
                self._add(served, op)
            case Remove(key, keep_state):
                state = served.decoder.remove(key, keep_state)
                if state is not None:
                    self._lockstep.register(state.cache)
            case Reset():
                if served is not None:
                    served.decoder.reset()
            case Keep(ref, tokens, holders):
                state = self._lockstep.state(ref)
                with self._lockstep.watching():
                    served.store.keep(state, tokens, holders)
            case Step():
                with self._lockstep.watching():
                    results = served.decoder.step()
                for result in results:
                    if result.error is not None:
                        raise RuntimeError(f"a step failed: {result.error}")
                for kv_cache in step_states(results):
                    self._lockstep.register(kv_cache)
            case AddJob(request):
                self._jobs.add(request, Future())
            case StepJobs():
                with mx.stream(thread_stream()), self._lockstep.watching():
                    self._jobs.step(served, lambda: None)
            case AbortJobs():
                self._jobs.abort(Aborted("aborted on rank 0"))
            case DropJob(place):
                self._jobs.drop(place)
            case Ping():
                pass

    def _add(self, served: ServedModel, op: Add) -> None:
        kv_cache, rest = served.store.fetch(op.prompt)
        reused = len(op.prompt) - len(rest)
        if reused != op.reused:
            raise RuntimeError(
                f"out of step: the prompt cache served {reused} tokens here and "
                f"{op.reused} on rank 0"
            )
        key = served.decoder.add(
            NewSequence(
                prompt=op.prompt,
                rest=rest,
                kv_cache=kv_cache,
                sampler=_greedy,
                processors=[],
                max_tokens=op.max_tokens,
                snapshots=op.snapshots,
            )
        )
        if key != op.key:
            raise RuntimeError(f"out of step: sequence {key} here, {op.key} on rank 0")

    def _load(self, op: Load) -> None:
        self._unload()
        self._lockstep.stall_seconds = op.plan.options.distributed_step_timeout
        served, error = None, None
        started = time.perf_counter()
        try:
            resolved = resolve(op.plan, self._lockstep, op.mode)
            # The worker's counts go unread: Status is rank 0's.
            counts = PromptCounts()
            served = prepare(
                resolved, op.load_id, op.max_cache_bytes, counts, self._lockstep
            )
        except Exception as e:
            logger.exception("loading %r failed", op.plan.model)
            error = e
        try:
            self._lockstep.agree(error)
        except Exception:
            return
        self._served = served
        logger.info(
            "loaded %s in %.1f s: %s",
            served.info.source,
            time.perf_counter() - started,
            served.info.compute_path.description,
        )

    def _unload(self) -> None:
        if self._served is not None:
            self._served.decoder.close()
            self._served.store.close()
        self._served = None
        self._jobs = JobQueue()
        mx.clear_cache()


def run_worker(settings: GroupSettings, retry_seconds: float = 1.0) -> int:
    """Check in with rank 0 (waiting as long as it takes to load a model), join
    the group, then follow rank 0 until it exits; the process's exit status."""
    group = None
    while group is None:
        doorbell = check_in(settings)
        # After the check-in rank 0 joins at once; a worker that still can't
        # reach it checks in again.
        for _ in range(3):
            try:
                group = init_group(settings)
                break
            except RuntimeError as e:
                logger.info("rank %d: joining failed (%s); retrying", settings.rank, e)
                time.sleep(retry_seconds)
        if group is None and doorbell is not None:
            doorbell.close()
    logger.info("rank %d of %d joined the group", group.rank(), group.size())
    share_cores(settings, group.rank())
    try:
        Follower(Lockstep(group, doorbell=doorbell)).run()
    except Exception as e:
        logger.error("rank %d: leaving the group: %s", group.rank(), e)
        return LOST
    finally:
        if doorbell is not None:
            doorbell.close()
    return 0
