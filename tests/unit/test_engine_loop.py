"""The engine loop without its thread: messages taken with the burst window, the
idle wait, and the shutdown that answers what is still queued; and the engine
thread's own end."""

import threading
import time
from concurrent.futures import Future

import mlx.core as mx

from mlx_backend.engine.engine import Engine
from mlx_backend.engine.loop import (
    BURST_GAP_SECONDS,
    Call,
    Loop,
    Stop,
    Submit,
    Turns,
)
from mlx_backend.errors import Aborted


class FakeStream:
    def __init__(self):
        self.events = []
        self.cancelled = False

    def put(self, event):
        self.events.append(event)


class Recorder(Turns):
    """Turns that record what the loop asked for."""

    def __init__(self, decoding=False, idle_timeout=None):
        self.accepted, self.calls = [], []
        self._decoding = decoding
        self.idle_timeout = idle_timeout
        self.loop: Loop | None = None

    def busy(self):
        return any(isinstance(m, Submit) for m in self.accepted)

    def decoding(self):
        return self._decoding

    def accept(self, message):
        self.accepted.append(message)

    def step(self):
        self.calls.append("step")

    def idle(self):
        self.calls.append("idle")

    def heartbeat(self):
        self.calls.append("heartbeat")
        self.loop.inbox.put(Stop())

    def fail(self, reason):
        self.calls.append(("fail", reason))

    def close(self):
        self.calls.append("close")


def make_loop(**kwargs) -> tuple[Loop, Recorder]:
    turns = Recorder(**kwargs)
    loop = Loop(turns)
    turns.loop = loop
    return loop, turns


def submit() -> Submit:
    return Submit(request=None, stream=FakeStream())


def test_a_request_that_wakes_the_engine_waits_for_the_rest_of_its_burst():
    loop, turns = make_loop()
    first, second = submit(), submit()
    loop.inbox.put(first)
    loop.inbox.put(second)
    start = time.monotonic()
    assert loop.take_messages()
    # Both taken in one turn, after the burst's gap passed without a third.
    assert turns.accepted == [first, second]
    assert time.monotonic() - start >= BURST_GAP_SECONDS


def test_a_request_joins_running_sequences_without_a_wait():
    loop, turns = make_loop(decoding=True)
    loop.inbox.put(submit())
    start = time.monotonic()
    assert loop.take_messages()
    assert len(turns.accepted) == 1
    assert time.monotonic() - start < BURST_GAP_SECONDS


def test_an_idle_loop_waits_its_timeout_then_stops_on_stop():
    loop, turns = make_loop(idle_timeout=0.01)
    assert not loop.take_messages()
    assert turns.calls == ["idle", "heartbeat", "idle"]
    assert turns.accepted == []


def test_run_answers_what_was_queued_behind_stop():
    loop, turns = make_loop()
    queued, future = submit(), Future()
    loop.inbox.put(Stop())
    loop.inbox.put(queued)
    loop.inbox.put(Call(lambda: None, (), future))
    loop.run()
    assert turns.calls == ["idle", "close"]
    (event,) = queued.stream.events
    assert isinstance(event, Aborted) and str(event) == "the backend is shutting down"
    assert isinstance(future.exception(timeout=0), Aborted)


def test_a_failed_turn_aborts_and_the_loop_goes_on():
    loop, turns = make_loop()

    def broken_step():
        turns.step = Recorder.step.__get__(turns)
        loop.inbox.put(Stop())
        raise RuntimeError("step failed")

    turns.step = broken_step
    loop.inbox.put(submit())
    loop.run()
    assert ("fail", "the generation engine failed") in turns.calls
    assert turns.calls[-1] == "close"


def test_the_engine_thread_clears_its_streams_as_it_ends(monkeypatch):
    """MLX (0.32) frees a thread's compile cache at the thread's exit, where it can
    meet the finalizing interpreter: a script that served from an engine then exits
    aborted ("terminate called without an active exception", about 1 run in 3).
    MLX asks each thread to call ``mx.clear_streams()`` before it ends."""
    ended = []
    monkeypatch.setattr(
        mx, "clear_streams", lambda: ended.append(threading.current_thread().name)
    )
    engine = Engine()
    engine.call(lambda: None).result()
    assert ended == []
    engine.shutdown()
    assert ended == ["mlx-engine"]
