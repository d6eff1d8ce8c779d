"""pytest's hooks and shared fixtures. The helpers they use, which bench/ uses too,
are in ``tests/support.py``.

Each test is marked by the folder it lives in: ``unit`` (fakes and tiny models),
``engine`` (an in-process engine on the default model) or ``e2e`` (a backend
process on a real port).
"""

import os
from pathlib import Path

import pytest

from mlx_backend.cpu.path import BLAS_THREAD_ENV, CPU_PACING_ENV, physical_cores
from tests.support import Server, start_default_server

KINDS = ("unit", "engine", "e2e")


def pytest_configure(config):
    # Engines and backends under test don't spend ~2.5 s measuring pacing at every
    # load: the host setting pins it (greedy tokens are the same either way). Pacing
    # tests ask for auto; bench/, which imports tests/support.py, measures.
    os.environ.setdefault(CPU_PACING_ENV, "off")
    # xdist's workers split the cores: BLAS threads beyond a worker's share spin
    # against the other worker's (make test on 2 cores: 8m24s, 6m48s split).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, physical_cores() // workers))
        for name in BLAS_THREAD_ENV:
            os.environ.setdefault(name, share)


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = next((k for k in KINDS if k in Path(item.fspath).parts), None)
        if kind is not None:
            item.add_marker(kind)


@pytest.fixture(scope="module")
def server():
    srv = start_default_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bare_server():
    """No model loaded and bearer auth on (``AUTH`` passes it)."""
    srv = Server(env={"LOCALAI_GRPC_AUTH_TOKEN": "s3cret"})
    yield srv
    srv.stop()
