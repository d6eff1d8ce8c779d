"""Serving over an MLX distributed group: rank 0 serves gRPC and leads, the other
ranks follow it step by step.

Rank 0's engine runs as it does alone, with three wrappers: ``LeaderDecoder``
around its decoder, ``LeaderPromptCache`` as its prompt cache and ``LeaderJobs``
around its Score and Embedding queue. They record what the workers must replay
(admissions, removals, prompt-cache inserts, steps, jobs) as ops, and broadcast
them with an MLX collective just before each piece of work that runs collectives.
A worker (``run_worker``) replays the ops in order on its own shard of the model,
decoder, prompt cache and job queue, so every rank runs the same forward passes in
the same order, and a prompt-cache hit on rank 0 is a hit on every rank. Sampling,
grammars and logprobs stay on rank 0: every forward pass embeds rank 0's token ids
(sharding.py), whatever the workers sampled.
"""

import copy
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_backend.cpu.blas import set_blas_threads
from mlx_backend.cpu.pacing import make_pacing
from mlx_backend.decoders.base import (
    Decoder,
    KVState,
    NewSequence,
    StepResult,
    thread_stream,
)
from mlx_backend.decoders.factory import make_plain_decoder
from mlx_backend.errors import Aborted, InvalidArgument, Unavailable
from mlx_cache import ThreadSafeLRUPromptCache, cache_nbytes
from mlx_utils import make_kv_cache
from python_utils import DISTRIBUTED_BACKENDS, LoadOptions

logger = logging.getLogger(__name__)

HOSTFILE_ENV = "MLX_DISTRIBUTED_HOSTFILE"
BACKEND_ENV = "MLX_DISTRIBUTED_BACKEND"
# The first broadcast of a step carries this many bytes; longer payloads
# (long prompts) take a second one.
HEADER_BYTES = 4096
# While idle, rank 0 checks on the workers this often, so that a lost rank shows
# in Status without a request.
HEARTBEAT_SECONDS = 5.0
# Each rank's load outcome, gathered at the end of a load.
STATUS_BYTES = 512
# What a worker sends rank 0 before the group forms, followed by its rank.
CHECK_IN = b"mlx-backend-worker"
# run_worker's exit status when rank 0 was lost (not shut down): a worker
# started on its own then starts afresh and waits for rank 0 to come back.
LOST = 75


@dataclass(frozen=True)
class GroupSettings:
    """How this process joins its group (MLX's own environment variables)."""

    backend: str
    hostfile: str = ""
    rank: int = 0
    coordinator: str = ""
    timeout: float = 60.0


def launched_rank(environ) -> int | None:
    """The rank that ``mlx.launch`` (MLX_RANK) or mpirun gave this process."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return None


def _launched_backend(environ) -> str:
    if "MLX_IBV_DEVICES" in environ:
        return "jaccl"
    if "OMPI_COMM_WORLD_RANK" in environ and "MLX_RANK" not in environ:
        return "mpi"
    return "ring"


def leader_settings(options: LoadOptions, environ) -> GroupSettings | None:
    """Rank 0's group, from the load options or the environment; None: no group."""
    backend = options.distributed_backend or environ.get(BACKEND_ENV, "").lower()
    if backend and backend not in DISTRIBUTED_BACKENDS:
        raise InvalidArgument(
            f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(DISTRIBUTED_BACKENDS)}"
        )
    hostfile = options.hostfile or environ.get(HOSTFILE_ENV, "")
    if not hostfile and launched_rank(environ) is not None:
        backend = backend or _launched_backend(environ)
        hostfile = environ.get("MLX_HOSTFILE") or environ.get("MLX_IBV_DEVICES", "")
        if not hostfile and backend != "mpi":
            return None
    elif not hostfile:
        return None
    return GroupSettings(
        backend=backend or "ring",
        hostfile=hostfile,
        coordinator=environ.get("MLX_JACCL_COORDINATOR", ""),
        timeout=options.distributed_timeout,
    )


def group_environment(settings: GroupSettings) -> dict[str, str]:
    """The variables MLX's ``init`` reads for ``settings``."""
    if settings.backend == "mpi" or not settings.hostfile:
        return {}
    names = {"ring": "MLX_HOSTFILE", "jaccl": "MLX_IBV_DEVICES"}
    env = {names[settings.backend]: settings.hostfile, "MLX_RANK": str(settings.rank)}
    if settings.coordinator:
        env["MLX_JACCL_COORDINATOR"] = settings.coordinator
    return env


def init_group(settings: GroupSettings) -> mx.distributed.Group:
    os.environ.update(group_environment(settings))
    return mx.distributed.init(backend=settings.backend, strict=True)


def _hostfile_entries(hostfile: str) -> list[list[str]]:
    """A hostfile's entries, one list of strings a rank (ring addresses, or a
    JACCL devices row); empty when it can't be read."""
    try:
        hosts = json.loads(Path(hostfile).read_text())
        return [[str(a) for a in (h if isinstance(h, list) else [h])] for h in hosts]
    except (OSError, ValueError, TypeError):
        return []


def _rank0_address(settings: GroupSettings) -> tuple[str, int, int] | None:
    """Where rank 0 takes the workers' check-ins, and the group's size: rank 0's
    ring address, or the JACCL coordinator's. None for MPI (mpirun starts every
    rank at once)."""
    if settings.backend == "ring":
        hosts = _hostfile_entries(
            settings.hostfile or os.environ.get("MLX_HOSTFILE", "")
        )
        address = hosts[0][0] if hosts else ""
    elif settings.backend == "jaccl":
        devices = settings.hostfile or os.environ.get("MLX_IBV_DEVICES", "")
        hosts = _hostfile_entries(devices)
        address = settings.coordinator or os.environ.get("MLX_JACCL_COORDINATOR", "")
    else:
        return None
    host, _, port = address.rpartition(":")
    if len(hosts) < 2 or not port.isdigit():
        return None
    return host, int(port), len(hosts)


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def gather_workers(settings: GroupSettings) -> None:
    """Rank 0: wait until every worker of a ring has checked in at rank 0's
    address, then let them all join.

    MLX's ``init`` holds the interpreter lock while it waits for missing ranks, so
    the whole backend would hang with it; this check-in waits without the lock,
    for ``settings.timeout`` at most, and names the ranks that never came.
    """
    found = _rank0_address(settings)
    if found is None:
        return
    host, port, size = found
    checked_in: dict[int, socket.socket] = {}
    deadline = time.monotonic() + settings.timeout
    try:
        with socket.create_server((host, port)) as server:
            server.settimeout(0.2)
            while len(checked_in) < size - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, size)) - set(checked_in))
                    names = ", ".join(str(rank) for rank in missing)
                    ranks = "ranks" if len(missing) > 1 else "rank"
                    raise Unavailable(
                        f"{ranks} {names} of the distributed group ({settings.hostfile}) "
                        f"did not join within {settings.timeout:g} s: start each "
                        "worker with run.sh --worker --hostfile HOSTFILE --rank N"
                    )
                try:
                    conn, _ = server.accept()
                    conn.settimeout(2)
                    hello = _read(conn, len(CHECK_IN) + 4)
                except OSError:
                    continue
                rank = int.from_bytes(hello[len(CHECK_IN) :], "little")
                if not hello.startswith(CHECK_IN) or not 0 < rank < size:
                    conn.close()
                    continue
                if rank in checked_in:
                    checked_in[rank].close()
                checked_in[rank] = conn
        # Closed before the workers go: their MLX connections must reach MLX's
        # listener, not this one's backlog.
        for conn in checked_in.values():
            conn.sendall(b"go")
        # Workers hang up first, so rank 0's port is free for MLX at once.
        for conn in checked_in.values():
            try:
                conn.recv(1)
            except OSError:
                pass
    finally:
        for conn in checked_in.values():
            conn.close()


def check_in(settings: GroupSettings, retry_seconds: float = 0.5) -> None:
    """A worker: wait until rank 0 lets the group join (see ``gather_workers``)."""
    found = _rank0_address(settings)
    if found is None:
        return
    host, port, _ = found
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                conn.sendall(CHECK_IN + settings.rank.to_bytes(4, "little"))
                conn.settimeout(None)
                if _read(conn, 2) == b"go":
                    return
        except OSError:
            pass
        time.sleep(retry_seconds)


def join_group(settings: GroupSettings) -> mx.distributed.Group:
    """Rank 0's group, once every worker is up."""
    gather_workers(settings)
    group = init_group(settings)
    share_cores(settings, group.rank())
    return group


def share_cores(settings: GroupSettings, rank: int) -> None:
    """Split this machine's cores between the ranks a ring hostfile puts on it:
    each rank's BLAS would otherwise run a thread per core, and the ranks would
    take turns on them (a 2-rank pipeline on 2 cores: 8 streams at 37 tok/s with
    2 threads each, 75 with 1)."""
    hostfile = settings.hostfile or os.environ.get("MLX_HOSTFILE", "")
    addresses = _hostfile_entries(hostfile) if settings.backend == "ring" else []
    if rank >= len(addresses):
        return
    host = addresses[rank][0].rpartition(":")[0]
    local = sum(1 for listed in addresses if listed[0].rpartition(":")[0] == host)
    if local < 2:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // local)
    if set_blas_threads(threads):
        logger.info(
            "%d ranks share %s: BLAS threads capped at %d each", local, host, threads
        )


# Ops: what rank 0 did that the workers replay, in order.
@dataclass(frozen=True)
class Load:
    name: str
    kwargs: dict
    options: LoadOptions
    context_size: int
    generation: int
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
    model_key: int
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

    def __init__(self, group: mx.distributed.Group, stall_seconds: float = 20.0):
        self.group = group
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
        message = b"" if error is None else f"{error}".encode()[: STATUS_BYTES - 3]
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


class LoadFailed(Exception):
    """A rank of the group could not load the model."""


def pipeline_size_fn(kv_cache: list, total_layers: int) -> int:
    """Bytes of a KV state as if it held every layer: ranks of a pipeline hold
    different layer counts, and must evict the same prompt-cache entries."""
    return cache_nbytes(kv_cache) * total_layers // max(1, len(kv_cache))


def make_group_prompt_cache(
    lockstep: Lockstep | None,
    options: LoadOptions,
    max_bytes: int,
    total_layers: int,
    can_trim_fn,
    trim_fn,
) -> ThreadSafeLRUPromptCache:
    """The prompt cache of a rank: the same bounds and entry sizes on every rank."""
    kind = ThreadSafeLRUPromptCache
    kwargs = {}
    if lockstep is not None:
        kwargs["size_fn"] = lambda kv: pipeline_size_fn(kv, total_layers)
        if lockstep.rank == 0:
            kind, kwargs["lockstep"] = LeaderPromptCache, lockstep
    return kind(
        max_size=options.max_cache_entries,
        can_trim_fn=can_trim_fn,
        trim_fn=trim_fn,
        max_bytes=max_bytes,
        **kwargs,
    )


class LeaderPromptCache(ThreadSafeLRUPromptCache):
    """Rank 0's prompt cache: inserts of the decoder's KV states are recorded for
    the workers. Score jobs insert states of their own, which the workers' jobs
    insert themselves."""

    def __init__(self, lockstep: Lockstep, **kwargs):
        super().__init__(**kwargs)
        self._lockstep = lockstep

    def insert_state(self, model_key, tokens, prompt_cache, holders=1) -> None:
        ref = self._lockstep.ref(prompt_cache)
        if ref is not None:
            self._lockstep.record(Keep(ref, model_key, tuple(tokens), holders))
        super().insert_state(model_key, tokens, prompt_cache, holders)


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
    """Rank 0's Score and Embedding queue: the workers run every job too."""

    def __init__(self, inner, lockstep: Lockstep):
        self._inner = inner
        self._lockstep = lockstep

    def __bool__(self) -> bool:
        return bool(self._inner)

    def add(self, request, future: Future) -> None:
        self._inner.add(request, future)
        self._lockstep.record(AddJob(request))

    def step(self, model, options, before_answer) -> None:
        try:
            self._lockstep.flush(StepJobs())
        except Unavailable as e:
            self._inner.abort(e)
            return
        self._inner.step(model, options, before_answer)

    def abort(self, error: Exception) -> None:
        self._inner.abort(error)
        self._lockstep.record(AbortJobs())


def _greedy(logprobs: mx.array) -> mx.array:
    # Workers' picks are never used: every forward pass embeds rank 0's tokens.
    return mx.argmax(logprobs, axis=-1)


class Follower:
    """A worker's replay of rank 0's ops on its own shard of the model."""

    def __init__(self, lockstep: Lockstep):
        self._lockstep = lockstep
        self._model = None
        self._options: LoadOptions | None = None
        self._decoder: Decoder | None = None
        self._cache: ThreadSafeLRUPromptCache | None = None
        self._jobs = None
        self._generation = 0

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
        match op:
            case Load():
                self._load(op)
            case Unload():
                self._unload()
            case Add():
                self._add(op)
            case Remove(key, keep_state):
                state = self._decoder.remove(key, keep_state)
                if state is not None:
                    self._lockstep.register(state.cache)
            case Reset():
                if self._decoder is not None:
                    self._decoder.reset()
            case Keep(ref, model_key, tokens, holders):
                state = self._lockstep.state(ref)
                with self._lockstep.watching():
                    self._cache.insert_state(model_key, tokens, state, holders)
            case Step():
                with self._lockstep.watching():
                    results = self._decoder.step()
                for result in results:
                    if result.error is not None:
                        raise RuntimeError(f"a step failed: {result.error}")
                for kv_cache in step_states(results):
                    self._lockstep.register(kv_cache)
            case AddJob(request):
                self._jobs.add(request, Future())
            case StepJobs():
                with mx.stream(thread_stream()), self._lockstep.watching():
                    self._jobs.step(self._model, self._options, lambda: None)
            case AbortJobs():
                if self._jobs is not None:
                    self._jobs.abort(Aborted("aborted on rank 0"))
            case Ping():
                pass

    def _add(self, op: Add) -> None:
        kv_cache, rest = self._fetch(op.prompt)
        reused = len(op.prompt) - len(rest)
        if reused != op.reused:
            raise RuntimeError(
                f"out of step: the prompt cache served {reused} tokens here and "
                f"{op.reused} on rank 0"
            )
        key = self._decoder.add(
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
        # Imported here: model loading pulls in what only serving needs.
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        from mlx_backend.distributed.sharding import Sharding
        from mlx_backend.engine.jobs import JobQueue
        from mlx_backend.models.loading import load_model, prepare_model

        self._unload()
        self._lockstep.stall_seconds = op.options.distributed_step_timeout
        error = None
        try:
            started = time.perf_counter()
            loaded = load_model(
                op.name, trust_remote_code=op.options.trust_remote_code, **op.kwargs
            )
            sharding = Sharding(self._lockstep.group, op.mode)
            total_layers = len(loaded.model.layers)
            loaded, info = prepare_model(
                loaded, "", op.options, op.context_size, op.generation, sharding
            )
            pacing = make_pacing(loaded.model, info.options, False, os.environ)
            decoder = make_plain_decoder(loaded.model, info.options, pacing.paced)
            cache = make_group_prompt_cache(
                self._lockstep,
                op.options,
                op.max_cache_bytes,
                total_layers,
                can_trim_prompt_cache,
                trim_prompt_cache,
            )
        except Exception as e:
            logger.exception("loading %r failed", op.name)
            error = e
        try:
            self._lockstep.agree(error)
        except Exception:
            return
        self._model, self._options = loaded.model, info.options
        self._decoder, self._cache = decoder, cache
        self._jobs = JobQueue(self._fetch, self._keep)
        self._generation = op.generation
        logger.info(
            "loaded %s in %.1f s: %s",
            loaded.source,
            time.perf_counter() - started,
            info.compute_path.description,
        )

    def _fetch(self, prompt) -> tuple[list, tuple[int, ...]]:
        kv_cache, rest = self._cache.fetch_for_prompt(self._generation, prompt)
        if kv_cache is None:
            kv_cache = make_kv_cache(self._model, self._options)
        return kv_cache, tuple(rest)

    def _keep(self, generation: int, kv_cache: list, tokens, holders: int = 1) -> None:
        # As the engine's _save_cache, which rank 0's jobs call.
        self._cache.insert_state(generation, tokens, kv_cache, holders)

    def _unload(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
        self._model = self._decoder = self._cache = self._jobs = None
        mx.clear_cache()


def worker_settings(
    hostfile: str, rank: int | None, backend: str, coordinator: str, environ
) -> GroupSettings:
    """A worker's group from its flags, or from ``mlx.launch``'s environment."""
    if rank is None:
        rank = launched_rank(environ)
    if rank is None:
        raise InvalidArgument(
            "--rank: a worker needs its rank (or mlx.launch's MLX_RANK)"
        )
    if rank < 1:
        raise InvalidArgument("--rank: workers are ranks 1 and up; rank 0 serves gRPC")
    backend = (
        backend or environ.get(BACKEND_ENV, "") or _launched_backend(environ)
    ).lower()
    if backend not in DISTRIBUTED_BACKENDS:
        raise InvalidArgument(
            f"--backend: expected one of {', '.join(DISTRIBUTED_BACKENDS)}"
        )
    if hostfile or launched_rank(environ) is None:
        if not hostfile and backend != "mpi":
            raise InvalidArgument("--hostfile: a worker needs MLX's hostfile JSON")
        return GroupSettings(backend, hostfile, rank, coordinator)
    # Launched by mlx.launch: MLX's variables are already set.
    return GroupSettings(backend, rank=rank)


def run_worker(settings: GroupSettings, retry_seconds: float = 1.0) -> int:
    """Check in with rank 0 (waiting as long as it takes to load a model), join
    the group, then follow rank 0 until it exits; the process's exit status."""
    group = None
    while group is None:
        check_in(settings)
        # After the check-in rank 0 joins at once; a worker that still can't
        # reach it checks in again.
        for _ in range(3):
            try:
                group = init_group(settings)
                break
            except RuntimeError as e:
                logger.info("rank %d: joining failed (%s); retrying", settings.rank, e)
                time.sleep(retry_seconds)
    logger.info("rank %d of %d joined the group", group.rank(), group.size())
    share_cores(settings, group.rank())
    try:
        Follower(Lockstep(group)).run()
    except Exception as e:
        logger.error("rank %d: leaving the group: %s", group.rank(), e)
        return LOST
    return 0
