"""Distributed serving's settings and splits, without processes: rank 0's and the
workers' group settings, the distributed options, the check-in before the group
forms and the doorbell after (over loopback sockets), the tensor or pipeline
split, and BLAS threads."""

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from mlx_backend.cpu.blas import blas_threads, set_blas_threads
from mlx_backend.distributed.group import (
    CHECK_IN,
    GroupSettings,
    check_in,
    gather_workers,
    group_environment,
    leader_settings,
    worker_settings,
)
from mlx_backend.distributed.lockstep import pipeline_size_fn
from mlx_backend.distributed.sharding import ShardingError, choose_mode
from mlx_backend.errors import InvalidArgument, Unavailable
from python_utils import parse_options
from tests.support import write_hostfile


def test_rank_0_joins_a_group_from_the_option_or_the_environment():
    assert leader_settings(parse_options([]), {}) is None
    by_option = leader_settings(parse_options(["hostfile:/x/Hosts.json"]), {})
    assert by_option == GroupSettings("ring", "/x/Hosts.json", timeout=60.0)
    by_env = leader_settings(
        parse_options(["distributed_timeout:5"]),
        {"MLX_DISTRIBUTED_HOSTFILE": "/h.json", "MLX_DISTRIBUTED_BACKEND": "jaccl"},
    )
    assert (by_env.backend, by_env.hostfile, by_env.timeout) == ("jaccl", "/h.json", 5)
    launched = leader_settings(
        parse_options([]), {"MLX_RANK": "0", "MLX_HOSTFILE": "/tmp/launch.json"}
    )
    assert (launched.backend, launched.hostfile) == ("ring", "/tmp/launch.json")
    assert group_environment(by_option) == {
        "MLX_HOSTFILE": "/x/Hosts.json",
        "MLX_RANK": "0",
    }


def test_worker_flags_are_checked():
    settings = worker_settings("/h.json", 2, "jaccl", "10.0.0.1:5000", {})
    assert group_environment(settings) == {
        "MLX_IBV_DEVICES": "/h.json",
        "MLX_RANK": "2",
        "MLX_JACCL_COORDINATOR": "10.0.0.1:5000",
    }
    for args, field in [
        (("/h.json", 0, "ring", ""), "--rank"),
        (("/h.json", None, "ring", ""), "--rank"),
        (("", 1, "ring", ""), "--hostfile"),
        (("/h.json", 1, "tcp", ""), "--backend"),
    ]:
        with pytest.raises(InvalidArgument, match=field):
            worker_settings(*args, {})


def test_bad_distributed_options_are_invalid_argument():
    for option, field in [
        ("distributed_backend:tcp", "distributed_backend"),
        ("distributed_mode:data", "distributed_mode"),
        ("distributed_timeout:0", "distributed_timeout"),
        ("distributed_step_timeout:-1", "distributed_step_timeout"),
    ]:
        with pytest.raises(InvalidArgument, match=field):
            parse_options([option])


def test_workers_check_in_and_take_the_doorbell_before_the_group_forms(tmp_path):
    """The check-in that precedes MLX's init, and the doorbell it hands out, over
    loopback sockets alone: a worker wakes once for each ring, and learns that
    rank 0 is gone when its doorbell closes."""
    ring = write_hostfile(tmp_path, 3)
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps([[None, "rdma_en2"], ["rdma_en2", None]]))
    # A free port for the JACCL coordinator (rank 0's, as mlx.launch sets it).
    (coordinator,) = json.loads(write_hostfile(tmp_path, 1).read_text())[0]
    for backend, hostfile, ranks in (("ring", ring, 3), ("jaccl", devices, 2)):
        settings = GroupSettings(backend, str(hostfile), coordinator=coordinator)
        woken: list[str] = []

        def worker(rank: int):
            doorbell = check_in(dataclasses.replace(settings, rank=rank), 0.05)
            try:
                for _ in range(2):
                    doorbell.wait()
                    woken.append(f"{rank} woke")
                doorbell.wait()
            except ConnectionError as e:
                woken.append(f"{rank}: {e}")
            finally:
                doorbell.close()

        workers = [
            threading.Thread(target=worker, args=(rank,)) for rank in range(1, ranks)
        ]
        for thread in workers:
            thread.start()
        doorbell = gather_workers(dataclasses.replace(settings, timeout=10))
        doorbell.ring()
        doorbell.ring()
        doorbell.close()
        for thread in workers:
            thread.join(10)
            assert not thread.is_alive()
        for rank in range(1, ranks):
            assert [w for w in woken if w.startswith(str(rank))] == [
                f"{rank} woke",
                f"{rank} woke",
                f"{rank}: rank 0 is gone",
            ]
    # No worker comes: the message names the ranks.
    with pytest.raises(Unavailable, match="ranks 1, 2 of the distributed group"):
        gather_workers(GroupSettings("ring", str(ring), timeout=1))


def test_a_worker_that_checks_in_without_the_doorbell_fails_the_gathering(tmp_path):
    settings = GroupSettings("ring", str(write_hostfile(tmp_path, 2)), timeout=0.5)
    host, _, port = json.loads(Path(settings.hostfile).read_text())[0][0].rpartition(
        ":"
    )
    answers: list[bytes] = []

    def check_in_alone():
        # A check-in as an older worker makes it: it reads "go" and goes.
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=2) as conn:
                    conn.sendall(CHECK_IN + (1).to_bytes(4, "little"))
                    answers.append(conn.recv(4))
                    return
            except OSError:
                time.sleep(0.05)

    worker = threading.Thread(target=check_in_alone)
    worker.start()
    with pytest.raises(Unavailable, match="rank 1 .* connect to rank 0's doorbell"):
        gather_workers(settings)
    worker.join(10)
    assert answers and answers[0].startswith(b"go")


class _Args:
    num_attention_heads = 9
    num_key_value_heads = 3
    intermediate_size = 1536


class _Inner:
    layers = [object()] * 30


class _SmolLM2:
    """The default model's shape, as the split checks read it."""

    args = _Args()
    model = _Inner()

    def shard(self, group):
        pass


def test_the_split_follows_the_head_and_layer_counts():
    model = _SmolLM2()
    assert choose_mode(model, 3, "auto") == "tensor"
    assert choose_mode(model, 2, "auto") == "pipeline"
    with pytest.raises(ShardingError, match="9 query heads and 3 KV heads"):
        choose_mode(model, 2, "tensor")
    with pytest.raises(ShardingError, match="the model has 30"):
        choose_mode(model, 31, "pipeline")


def test_blas_threads_are_set_through_the_blas():
    before = blas_threads()
    if before is None:
        pytest.skip("no fast BLAS preloaded (make test preloads one on Linux CPU)")
    try:
        assert set_blas_threads(1)
        assert blas_threads() == 1
    finally:
        set_blas_threads(before)


def test_pipeline_ranks_count_an_entry_as_if_it_held_every_layer():
    class Layer:
        nbytes = 1000

    assert pipeline_size_fn([Layer()] * 15, 30) == 30000
    assert pipeline_size_fn([Layer()] * 10, 30) == 30000
