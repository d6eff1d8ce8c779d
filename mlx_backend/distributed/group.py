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


def gather_workers(settings: GroupSettings) -> socket.socket | None:
    """Rank 0: wait until every worker of a ring has checked in at rank 0's
    address, then let them all join; the doorbell's listener, whose port the
    workers were given (None without a check-in: MPI).

    MLX's ``init`` holds the interpreter lock while it waits for missing ranks, so
    the whole backend would hang with it; this check-in waits without the lock,
    for ``settings.timeout`` at most, and names the ranks that never came.
    """
    found = _rank0_address(settings)
    if found is None:
        return None
    host, port, size = found
    checked_in: dict[int, socket.socket] = {}
    deadline = time.monotonic() + settings.timeout
    bell = None
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
                    rank = _read_check_in(conn, size)
                except OSError:
                    continue
                if rank is None:
                    conn.close()
                    continue
                if rank in checked_in:
                    checked_in[rank].close()
                checked_in[rank] = conn
        bell = socket.create_server((host, 0))
        go = GO + bell.getsockname()[1].to_bytes(2, "little")
        # Closed before the workers go: their MLX connections must reach MLX's
        # listener, not this one's backlog.
        for conn in checked_in.values():
            conn.sendall(go)
        # Workers hang up first, so rank 0's port is free for MLX at once.
        for conn in checked_in.values():
            try:
                conn.recv(1)
            except OSError:
                pass
        return bell
    except BaseException:
        if bell is not None:
            bell.close()
        raise
    finally:
        for conn in checked_in.values():
            conn.close()


def _read_check_in(conn: socket.socket, size: int) -> int | None:
    """The rank a worker's check-in names; None for anything else."""
    hello = _read(conn, len(CHECK_IN) + 4)
    rank = int.from_bytes(hello[len(CHECK_IN) :], "little")
    if not hello.startswith(CHECK_IN) or not 0 < rank < size:
        return None
    return rank


def check_in(settings: GroupSettings, retry_seconds: float = 0.5) -> int | None:
    """A worker: wait until rank 0 lets the group join (see ``gather_workers``);
    the port of rank 0's doorbell (None without a check-in: MPI)."""
    found = _rank0_address(settings)
    if found is None:
        return None
    host, port, _ = found
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                conn.sendall(CHECK_IN + settings.rank.to_bytes(4, "little"))
                conn.settimeout(None)
                go = _read(conn, len(GO) + 2)
                if go.startswith(GO):
                    return int.from_bytes(go[len(GO) :], "little")
        except OSError:
            pass
        time.sleep(retry_seconds)


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


def answer_doorbells(
    bell: socket.socket, settings: GroupSettings, size: int
) -> Doorbell:
    """Rank 0: take every worker's doorbell connection, made once the group has
    formed, within ``settings.timeout``."""
    conns: dict[int, socket.socket] = {}
    deadline = time.monotonic() + settings.timeout
    try:
        with bell:
            while len(conns) < size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, size)) - set(conns))
                    raise Unavailable(
                        f"rank {missing[0]} of the distributed group joined MLX's "
                        f"group but not its doorbell within {settings.timeout:g} s"
                    )
                bell.settimeout(left)
                try:
                    conn, _ = bell.accept()
                    conn.settimeout(2)
                    rank = _read_check_in(conn, size)
                except OSError:
                    continue
                if rank is None:
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[rank] = conn
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    return Doorbell([conns[rank] for rank in sorted(conns)])


def call_doorbell(settings: GroupSettings, port: int) -> Doorbell:
    """A worker, once the group has formed: connect to rank 0's doorbell."""
    host, _, _ = _rank0_address(settings)
    conn = socket.create_connection((host, port), timeout=10)
    conn.sendall(CHECK_IN + settings.rank.to_bytes(4, "little"))
    conn.settimeout(None)
    return Doorbell([conn])


def join_group(settings: GroupSettings) -> tuple[mx.distributed.Group, Doorbell | None]:
    """Rank 0's group, once every worker is up, and its doorbell (None for MPI)."""
    if settings.backend != "mpi" and settings.hostfile:
        check_hostfile(Path(settings.hostfile))
    bell = gather_workers(settings)
    try:
        group = init_group(settings)
    except BaseException:
        if bell is not None:
            bell.close()
        raise
    share_cores(settings, group.rank())
    doorbell = None if bell is None else answer_doorbells(bell, settings, group.size())
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
