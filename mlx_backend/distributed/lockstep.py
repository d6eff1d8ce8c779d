"""The group's channel: rank 0 records what the workers must replay as ops, and
broadcasts them with an MLX collective just before each piece of work that runs
collectives; each worker receives them and replays them in order."""

import logging
import os
import pickle
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_backend.decoders.base import StepResult, thread_stream
from mlx_backend.distributed.group import Doorbell
from mlx_backend.errors import Unavailable
from mlx_backend.models.loading import LoadPlan
from mlx_backend.refusals import Described, describe_error
from mlx_cache import cache_nbytes

logger = logging.getLogger(__name__)

# The first broadcast of a step carries this many bytes; longer payloads
# (long prompts) take a second one.
HEADER_BYTES = 4096
# Each rank's load outcome, gathered at the end of a load.
STATUS_BYTES = 512


# Ops: what rank 0 did that the workers replay, in order.
@dataclass(frozen=True)
class Load:
    """Load the plan's shard, split by ``mode``, as load ``load_id``."""

    plan: LoadPlan
    load_id: int
    mode: str
    max_cache_bytes: int


@dataclass(frozen=True)
class Unload:
    pass


@dataclass(frozen=True)
class Add:
    key: int
    prompt: tuple[int, ...]
    # Prompt tokens rank 0 took from its prompt cache; every rank must match.
    reused: int
    max_tokens: int
    snapshots: tuple[int, ...]


@dataclass(frozen=True)
class Remove:
    key: int
    keep_state: bool


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class Keep:
    """A KV state the decoder handed out goes into the prompt cache."""

    ref: int
    tokens: tuple[int, ...]
    holders: int


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class AddJob:
    request: object


@dataclass(frozen=True)
class StepJobs:
    pass


@dataclass(frozen=True)
class AbortJobs:
    pass


@dataclass(frozen=True)
class DropJob:
    # Where the request was: a waiting one's index, or RUNNING_JOB.
    place: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Exit:
    pass


def step_states(results: list[StepResult]) -> Iterator[list]:
    """The KV states a step handed out, in the order every rank numbers them."""
    for result in results:
        if result.state is not None:
            yield result.state.cache
        for snapshot in result.snapshots:
            yield snapshot.cache


class Lockstep:
    """The group's channel: rank 0 records ops and broadcasts them; workers
    receive them. Both number the KV states their decoders hand out between two
    broadcasts the same way, so an op can name one (``Keep.ref``)."""

    def __init__(
        self,
        group: mx.distributed.Group,
        stall_seconds: float = 20.0,
        doorbell: Doorbell | None = None,
    ):
        self.group = group
        self.doorbell = doorbell
        self.rank = group.rank()
        self.size = group.size()
        self.broken: str | None = None
        self._ops: list = []
        self._states: list[list] = []
        # A step that takes longer is a hung collective (distributed_step_timeout).
        self.stall_seconds = stall_seconds
        self._since: float | None = None
        threading.Thread(target=self._watch, name="mlx-watchdog", daemon=True).start()

    @contextmanager
    def watching(self):
        """A stretch of work that must not hang: MLX can't interrupt every
        collective whose peer is gone (a pipeline's recv waits on), so the
        process exits, and LocalAI (or whoever started it) starts it again."""
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            since = self._since
            if since is not None and time.monotonic() - since > self.stall_seconds:
                logger.critical(
                    "rank %d: a step of the distributed group has hung for %.0f s "
                    "(a rank is gone or stuck); exiting so that the backend is "
                    "restarted",
                    self.rank,
                    time.monotonic() - since,
                )
                logging.shutdown()
                os._exit(70)

    # -- rank 0 --------------------------------------------------------------

    def record(self, op) -> None:
        self._ops.append(op)

    def flush(self, *ops, wait: bool = False) -> None:
        """Send every recorded op, then ``ops``; Unavailable once a rank is lost."""
        self.check()
        self._ops.extend(ops)
        payload = pickle.dumps(self._ops, protocol=pickle.HIGHEST_PROTOCOL)
        self._ops = []
        self.forget_states()
        if self.doorbell is not None:
            self.doorbell.ring()
        try:
            sent = self._broadcast(payload)
            if wait:
                mx.eval(sent)
            else:
                # Queued behind the step in flight, as mlx-lm overlaps its steps.
                mx.async_eval(sent)
        except Exception as e:
            self.fail(f"broadcasting to the workers failed: {e}")
            self.check()

    def check(self) -> None:
        if self.broken is not None:
            raise Unavailable(self.broken)

    def fail(self, why: str) -> None:
        if self.broken is None:
            logger.error(
                "the distributed group is lost (%s); this backend must be restarted",
                why,
            )
            self.broken = (
                f"the distributed group of {self.size} ranks is lost ({why}); "
                "restart the backend and its workers"
            )

    def register(self, kv_cache: list) -> None:
        self._states.append(kv_cache)

    def ref(self, kv_cache: list) -> int | None:
        return next((i for i, s in enumerate(self._states) if s is kv_cache), None)

    # -- workers -------------------------------------------------------------

    def receive(self) -> list:
        """The next ops from rank 0 (blocks until rank 0 sends)."""
        if self.doorbell is not None:
            self.doorbell.wait()
        return pickle.loads(self._broadcast(None))

    def forget_states(self) -> None:
        self._states.clear()

    def state(self, ref: int) -> list:
        return self._states[ref]

    # -- every rank ----------------------------------------------------------

    def _broadcast(self, payload: bytes | None):
        """rank 0's ``payload`` on every rank: rank 0 gets the arrays to evaluate,
        workers the bytes. Runs on the stream of the model's forward passes, so
        that every rank's collectives stay in one order."""
        leader = payload is not None
        with mx.stream(thread_stream()):
            head = np.zeros(HEADER_BYTES, np.uint8)
            if leader:
                size = len(payload)
                head[:4] = np.frombuffer(size.to_bytes(4, "little"), np.uint8)
                first = payload[: HEADER_BYTES - 4]
                head[4 : 4 + len(first)] = np.frombuffer(first, np.uint8)
            summed = mx.distributed.all_sum(mx.array(head), group=self.group)
            if leader:
                rest = payload[HEADER_BYTES - 4 :]
                if not rest:
                    return [summed]
                tail = mx.array(np.frombuffer(rest, np.uint8))
                return [summed, mx.distributed.all_sum(tail, group=self.group)]
            data = bytes(np.array(summed, copy=False))
            size = int.from_bytes(data[:4], "little")
            if size == 0:
                # Rank 0 never sends nothing: its sockets closed mid-collective.
                raise ConnectionError("rank 0 is gone")
            body = data[4 : 4 + size]
            if size > HEADER_BYTES - 4:
                tail = mx.zeros((size - (HEADER_BYTES - 4),), mx.uint8)
                tail = mx.distributed.all_sum(tail, group=self.group)
                body += bytes(np.array(tail, copy=False))
            return body

    def agree(self, error: Exception | None) -> None:
        """Every rank's load outcome on every rank; raises, naming the ranks that
        failed, when any did."""
        # Shown to the client by rank 0: described, as rank 0's own errors are.
        why = "" if error is None else describe_error(error)
        message = why.encode()[: STATUS_BYTES - 3]
        status = np.zeros(STATUS_BYTES, np.uint8)
        status[0] = 1 if error is not None else 0
        status[1:3] = np.frombuffer(len(message).to_bytes(2, "little"), np.uint8)
        status[3 : 3 + len(message)] = np.frombuffer(message, np.uint8)
        with mx.stream(thread_stream()):
            gathered = mx.distributed.all_gather(mx.array(status), group=self.group)
            mx.eval(gathered)
        rows = np.array(gathered, copy=False).reshape(self.size, STATUS_BYTES)
        failed = []
        for rank, row in enumerate(rows):
            if row[0]:
                length = int.from_bytes(bytes(row[1:3]), "little")
                failed.append(
                    (rank, bytes(row[3 : 3 + length]).decode(errors="replace"))
                )
        if error is not None:
            raise error
        if failed:
            raise LoadFailed(
                "; ".join(f"rank {rank} could not load: {why}" for rank, why in failed)
            )


class LoadFailed(Described):
    """A rank of the group could not load the model."""


def pipeline_size_fn(kv_cache: list, total_layers: int) -> int:
    """Bytes of a KV state as if it held every layer: ranks of a pipeline hold
    different layer counts, and must evict the same prompt-cache entries."""
    return cache_nbytes(kv_cache) * total_layers // max(1, len(kv_cache))
