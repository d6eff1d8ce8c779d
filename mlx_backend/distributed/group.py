"""Joining an MLX distributed group: the group's settings (from the load options,
MLX's environment or a worker's flags), the check-in that gathers the workers at
rank 0 before MLX connects them, the doorbell that wakes them for each step, and
the cores the ranks on one machine share."""

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_backend.cpu.blas import set_blas_threads
from mlx_backend.errors import InvalidArgument, Unavailable
from mlx_backend.refusals import Described, describe_path, read_json
from python_utils import DISTRIBUTED_BACKENDS, LoadOptions

logger = logging.getLogger(__name__)

HOSTFILE_ENV = "MLX_DISTRIBUTED_HOSTFILE"
BACKEND_ENV = "MLX_DISTRIBUTED_BACKEND"
# A hostfile lists a few hosts: a larger file is not read whole.
HOSTFILE_LIMIT = 1 << 20
# What a worker sends rank 0 before the group forms, followed by its rank.
CHECK_IN = b"mlx-backend-worker"
# Rank 0's answer to a check-in, followed by its doorbell's port (2 bytes).
GO = b"go"


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


class Doorbell:
    """Wakes the workers before each of rank 0's broadcasts. MLX's ring backend
    polls its sockets while a receive is pending, so a worker waiting in a
    collective for rank 0's next step would keep a core busy, idle or not (and
    ranks sharing a machine would take turns on its cores); a worker sleeps on
    its doorbell instead, and enters the collective once rank 0 rings."""

    def __init__(self, sockets: list[socket.socket]):
        self._sockets = sockets

    def ring(self) -> None:
        """Rank 0: one ring for each broadcast. A lost worker is found by the
        collective, not here."""
        for conn in self._sockets:
            try:
                conn.send(b"\x01")
            except OSError:
                pass

    def wait(self) -> None:
        """A worker: until rank 0 rings; ConnectionError once rank 0 is gone."""
        if not self._sockets[0].recv(1):
            raise ConnectionError("rank 0 is gone")

    def close(self) -> None:
        for conn in self._sockets:
            conn.close()


def gather_workers(settings: GroupSettings) -> Doorbell | None:
    """Rank 0: wait until every worker of a ring has checked in at rank 0's
    address, let them all join, and take their doorbell connections; the
    doorbell (None without a check-in: MPI).

    MLX's ``init`` holds the interpreter lock while it waits for missing ranks, so
    the whole backend would hang with it; this check-in waits without the lock,
    for ``settings.timeout`` at most, and names the ranks that never came. Every
    connection is made before ``init``: once MLX's group has formed, it is kept
    for the process's life, and a failure then would need a restart.
    """
    found = _rank0_address(settings)
    if found is None:
        return None
    host, port, size = found
    deadline = time.monotonic() + settings.timeout

    def check(ranks: dict[int, socket.socket], what: str) -> None:
        missing = sorted(set(range(1, size)) - set(ranks))
        if missing:
            names = ", ".join(str(rank) for rank in missing)
            raise Unavailable(
                f"{'ranks' if len(missing) > 1 else 'rank'} {names} of the distributed "
                f"group ({settings.hostfile}) did not {what} within "
                f"{settings.timeout:g} s: start each worker with run.sh --worker "
                "--hostfile HOSTFILE --rank N"
            )

    checked_in: dict[int, socket.socket] = {}
    rung: dict[int, socket.socket] = {}
    try:
        with socket.create_server((host, port)) as server:
            _take_ranks(server, checked_in, size, deadline)
        check(checked_in, "join")
        # Closed before the workers go: their MLX connections must reach MLX's
        # listener, not this one's backlog.
        with socket.create_server((host, 0)) as bell:
            go = GO + bell.getsockname()[1].to_bytes(2, "little")
            for conn in checked_in.values():
                conn.sendall(go)
            # Workers hang up first, so rank 0's port is free for MLX at once.
            for conn in checked_in.values():
                try:
                    conn.recv(1)
                except OSError:
                    pass
            # Workers connect as soon as they read "go".
            soon = time.monotonic() + min(settings.timeout, 5.0)
            _take_ranks(bell, rung, size, max(deadline, soon))
        check(rung, "connect to rank 0's doorbell port")
    except BaseException:
        for conn in rung.values():
            conn.close()
        raise
    finally:
        for conn in checked_in.values():
            conn.close()
    for conn in rung.values():
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Doorbell([rung[rank] for rank in sorted(rung)])


def _take_ranks(
    server: socket.socket, ranks: dict[int, socket.socket], size: int, deadline: float
) -> None:
    """Accept connections on ``server`` until every worker's rank has said hello
    or the deadline passes, into ``ranks`` (a rank's later connection replaces
    its earlier one)."""
    server.settimeout(0.2)
    while len(ranks) < size - 1 and time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
        except OSError:
            continue
        try:
            conn.settimeout(2)
            hello = _read(conn, len(CHECK_IN) + 4)
        except OSError:
            conn.close()
            continue
        rank = int.from_bytes(hello[len(CHECK_IN) :], "little")
        if not hello.startswith(CHECK_IN) or not 0 < rank < size:
            conn.close()
            continue
        if rank in ranks:
            ranks[rank].close()
        ranks[rank] = conn


def check_in(settings: GroupSettings, retry_seconds: float = 0.5) -> Doorbell | None:
    """A worker: wait until rank 0 lets the group join (see ``gather_workers``),
    then connect to rank 0's doorbell; None without a check-in (MPI)."""
    found = _rank0_address(settings)
    if found is None:
        return None
    host, port, _ = found
    hello = CHECK_IN + settings.rank.to_bytes(4, "little")
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                conn.sendall(hello)
                conn.settimeout(None)
                go = _read(conn, len(GO) + 2)
            if go.startswith(GO):
                # Rank 0 is listening on the doorbell's port by now.
                bell = socket.create_connection(
                    (host, int.from_bytes(go[len(GO) :], "little")), timeout=2
                )
                try:
                    bell.sendall(hello)
                except OSError:
                    bell.close()
                    raise
                bell.settimeout(None)
                return Doorbell([bell])
        except OSError:
            pass
        time.sleep(retry_seconds)


def join_group(settings: GroupSettings) -> tuple[mx.distributed.Group, Doorbell | None]:
    """Rank 0's group, once every worker is up, and its doorbell (None for MPI)."""
    if settings.backend != "mpi" and settings.hostfile:
        check_hostfile(Path(settings.hostfile))
    doorbell = gather_workers(settings)
    try:
        group = init_group(settings)
        share_cores(settings, group.rank())
    except BaseException:
        if doorbell is not None:
            doorbell.close()
        raise
    return group, doorbell


def check_hostfile(path: Path) -> None:
    """Refuse a hostfile that is not a JSON list, describing it: MLX's own parse
    error quotes the file."""
    why = ""
    if not path.is_file():
        why = describe_path(path)
    else:
        try:
            if not isinstance(read_json(path, limit=HOSTFILE_LIMIT), list):
                why = f"{path.name} is not a JSON list"
        except Described as e:
            why = str(e)
    if why:
        raise InvalidArgument(
            f"Options: hostfile: {path}: {why}; MLX's hostfile is a JSON list of "
            "the ranks' hosts"
        )


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
