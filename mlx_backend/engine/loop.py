"""The engine thread's loop and its hand-offs: messages in, events out.

Handlers on any thread put messages in the ``Inbox``. Each turn of the loop takes
them (blocking while there is nothing to do), lets the engine step, and sends the
step's events through the ``Outbox`` to each request's ``RequestStream``. A request
that wakes an idle engine waits for the rest of its burst first, so that requests
that come together are prefilled together.
"""

import asyncio
import logging
import queue
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mlx_backend.errors import Aborted
from mlx_backend.output.reply_pipeline import Finished, Output
from mlx_backend.request_parsing import ComputeRequest, GenerationRequest

logger = logging.getLogger(__name__)

# A request that wakes an idle engine waits for others that arrive within this gap
# of the last one, for at most this long, so that a burst is prefilled together.
BURST_GAP_SECONDS = 0.005
BURST_SECONDS = 0.03


class Outbox:
    """Events for the handlers, sent once per engine step.

    One ``call_soon_threadsafe`` per event loop and step wakes the handlers'
    loop once for a whole batch, not once for every token of every stream.
    """

    def __init__(self):
        self._pending: list[tuple[RequestStream, object]] = []

    def put(self, stream: "RequestStream", event) -> None:
        self._pending.append((stream, event))

    def flush(self) -> None:
        if not self._pending:
            return
        by_loop: dict = {}
        for stream, event in self._pending:
            by_loop.setdefault(stream.loop, []).append((stream, event))
        self._pending = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                # The handlers' loop is gone; nobody is listening any more.
                for stream, _ in items:
                    stream.cancelled = True


def _deliver(items: list) -> None:
    for stream, event in items:
        stream.queue.put_nowait(event)


class RequestStream:
    """The handler's end of one generation, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._outbox = outbox
        self.cancelled = False
        # Events put by the engine, and those the handler has taken.
        self._put = 0
        self._taken = 0

    def put(self, event) -> None:
        """Queue ``event`` for the handler (engine thread only)."""
        self._put += 1
        self._outbox.put(self, event)

    @property
    def backlog(self) -> int:
        """Events the handler has not taken yet: its client is not reading."""
        return self._put - self._taken

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[Output | Finished]:
        while True:
            event = await self.queue.get()
            self._taken += 1
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                return


# Inbox messages, from any thread to the engine thread.
@dataclass(frozen=True)
class Submit:
    request: GenerationRequest
    stream: RequestStream


@dataclass(frozen=True)
class Compute:
    request: ComputeRequest
    future: Future


@dataclass(frozen=True)
class Withdraw:
    # A Compute's future whose caller went away.
    future: Future


@dataclass(frozen=True)
class Call:
    fn: Callable
    args: tuple
    future: Future


@dataclass(frozen=True)
class Stop:
    pass


class Turns(ABC):
    """What the loop drives: the engine, one turn at a time."""

    @abstractmethod
    def busy(self) -> bool:
        """Work is waiting or running: the loop steps instead of blocking."""

    @abstractmethod
    def decoding(self) -> bool:
        """Sequences are running: a new request joins them without a burst wait."""

    @abstractmethod
    def accept(self, message: Submit | Compute | Withdraw | Call) -> None:
        """Take one message from the inbox."""

    @abstractmethod
    def step(self) -> None:
        """One engine step."""

    @abstractmethod
    def idle(self) -> None:
        """Nothing to do: the loop is about to block for a message."""

    @abstractmethod
    def heartbeat(self) -> None:
        """An idle wait of ``idle_timeout`` seconds passed without a message."""

    @abstractmethod
    def fail(self, reason: str) -> None:
        """A turn raised: end every request, keep serving."""

    @abstractmethod
    def close(self) -> None:
        """The loop is ending: end every request and release the model's work."""

    # Seconds an idle loop blocks before ``heartbeat``; None: for ever.
    idle_timeout: float | None = None


class Loop:
    """The engine thread's turns: take the inbox's messages, then step."""

    def __init__(self, turns: Turns):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox = Outbox()
        self._turns = turns

    def run(self) -> None:
        """Turn until a ``Stop`` message; then answer whatever is still queued."""
        turns = self._turns
        running = True
        while running:
            try:
                running = self.take_messages()
                if running and turns.busy():
                    turns.step()
            except Exception:
                # Never let the thread die: every waiting handler would hang.
                logger.exception("engine loop failed")
                try:
                    turns.fail("the generation engine failed")
                except Exception:
                    logger.exception("could not abort the running generations")
            self.outbox.flush()
        try:
            turns.close()
        finally:
            self._drain()
            self.outbox.flush()

    def take_messages(self) -> bool:
        """Take the inbox's messages; block while idle. False when asked to stop."""
        turns = self._turns
        burst_ends = None
        while True:
            busy = turns.busy()
            if not busy:
                self.outbox.flush()  # before waiting for work
                turns.idle()
            block, timeout = not busy, turns.idle_timeout
            if burst_ends is not None:
                # The rest of a burst: each may come within the gap of the last.
                timeout = min(BURST_GAP_SECONDS, burst_ends - time.monotonic())
                block = timeout > 0
            try:
                message = self.inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                if busy:
                    return True
                turns.heartbeat()
                continue
            if isinstance(message, Stop):
                return False
            if isinstance(message, Submit) and burst_ends is None:
                if not turns.decoding():
                    # Requests that come together arrive over some milliseconds:
                    # the first prefilled alone would hold the rest a step.
                    burst_ends = time.monotonic() + BURST_SECONDS
            turns.accept(message)

    def _drain(self) -> None:
        """Answer whatever was queued behind the stop request."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            match message:
                case Submit(stream=stream):
                    stream.put(Aborted("the backend is shutting down"))
                case Withdraw():
                    pass
                case Compute(future=future) | Call(future=future):
                    if future.set_running_or_notify_cancel():
                        future.set_exception(Aborted("the backend is shutting down"))
