"""The CUDA graph cache settings (mlx_backend/gpu/cuda_graphs.py): sized from the
batch, MLX's thrashing error off, the user's own settings kept, nothing on a
machine without CUDA."""

import mlx.core as mx
import pytest

from mlx_backend.gpu.cuda_graphs import (
    CACHE_SIZE_ENV,
    THRASHING_CHECK_ENV,
    configure_graph_cache,
)


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)


def test_sized_from_the_batch_with_the_thrashing_error_off(cuda):
    environ = {"PATH": "/bin"}
    assert configure_graph_cache(environ, 32) == {
        CACHE_SIZE_ENV: "1024",
        THRASHING_CHECK_ENV: "0",
    }
    assert environ[CACHE_SIZE_ENV] == "1024" and environ["PATH"] == "/bin"
    # Never under MLX's own default.
    assert configure_graph_cache({}, 2)[CACHE_SIZE_ENV] == "400"


def test_the_users_settings_are_kept(cuda):
    environ = {CACHE_SIZE_ENV: "50"}
    assert configure_graph_cache(environ, 32) == {THRASHING_CHECK_ENV: "0"}
    assert environ == {CACHE_SIZE_ENV: "50", THRASHING_CHECK_ENV: "0"}
    environ = {THRASHING_CHECK_ENV: "1"}
    assert configure_graph_cache(environ, 32) == {CACHE_SIZE_ENV: "1024"}
    assert environ[THRASHING_CHECK_ENV] == "1"


@pytest.mark.skipif(mx.cuda.is_available(), reason="a CUDA build")
def test_nothing_without_cuda():
    environ = {}
    assert configure_graph_cache(environ, 32) == {} and environ == {}
