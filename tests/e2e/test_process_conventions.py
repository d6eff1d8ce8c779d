"""End-to-end tests of the backend as a process: SIGTERM shuts it down
gracefully, and with LOCALAI_BACKEND_PARENT_WATCH on it stops once its parent is
gone (off, it goes on serving)."""

import os
import re
import signal
import time

import pytest

import backend_pb2 as pb
from tests.support import Server


def test_sigterm_shuts_down_gracefully():
    srv = Server()
    assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
    srv.process.send_signal(signal.SIGTERM)
    assert srv.process.wait(30) == 0
    assert "stopped" in srv.logs()
    srv.stop()


@pytest.mark.parametrize("watch", ["true", "off"])
def test_parent_watch(watch):
    # A shell parents the backend; once the shell is killed the backend is re-parented.
    env = {
        "LOCALAI_BACKEND_PARENT_WATCH": watch,
        "LOCALAI_BACKEND_PARENT_WATCH_INTERVAL": "200ms",
    }
    srv = Server(env=env, launcher=["sh", "-c", '"$0" "$@" & wait'])
    pid = int(re.search(r"\(pid (\d+)\)", srv.logs()).group(1))
    try:
        assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
        srv.process.kill()
        srv.process.wait()
        if watch == "true":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "stopped" not in srv.logs():
                time.sleep(0.1)
            assert "is gone, shutting down" in srv.logs()
            assert "stopped" in srv.logs()
        else:
            time.sleep(1.0)
            assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.stop()
