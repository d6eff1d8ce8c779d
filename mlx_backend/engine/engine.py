"""The generation engine: one thread that owns the model and every MLX object.

gRPC handlers never touch MLX. They parse a request into a ``GenerationRequest``,
``submit`` it and read events from the returned ``RequestStream``; control work
(load, free) runs on the same thread through ``call``. The thread's ``Loop`` takes
the inbox's messages and steps; each step reads schedule (the ``Scheduler``
sweeps and admits), step (the decoder), emit (the scheduler turns the results
into each request's events), then a chunk of any Score or Embedding job.
"""

import gc
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future

import mlx.core as mx

from mlx_backend.decoders.base import thread_stream
from mlx_backend.distributed.leader import LeaderJobs, Solo, join_leader
from mlx_backend.engine.jobs import JobQueue
from mlx_backend.engine.loader import Loader, ServedModel, check_plan, resolve
from mlx_backend.engine.loop import (
    Call,
    Compute,
    Loop,
    RequestStream,
    Stop,
    Submit,
    Turns,
    Withdraw,
)
from mlx_backend.engine.scheduler import Scheduler, admission_refusal
from mlx_backend.engine.stats import EngineStats, RequestMetrics, Stats
from mlx_backend.errors import Aborted
from mlx_backend.models.loading import LoadPlan, ModelInfo
from mlx_backend.models.tokenizers import forget_tokenizers
from mlx_backend.request_parsing import ComputeRequest, GenerationRequest
from mlx_utils import release_memory
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# Bytes of the prompt cache's copies a step evaluates while sequences decode: a
# finished 3,800-token sequence's KV state of the embedded model (175 MB) took
# one step 50-120 ms more when copied at once on the 2-core CPU.
SETTLE_BYTES = 8 << 20


class Engine(Turns):
    """Owns the model and runs every MLX call on its own thread."""

    def __init__(self):
        self._loop = Loop(self)
        self._stats = Stats()
        self._scheduler = Scheduler()
        self._jobs = JobQueue()
        self._loader = Loader(self._stats.prompts)
        self._group = Solo()
        # The model being served, swapped whole by a load; None: no model.
        self.served: ServedModel | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_thread, name="mlx-engine", daemon=True
        )
        self._thread.start()

    def _run_thread(self) -> None:
        try:
            self._loop.run()
        finally:
            # MLX (0.32) frees a thread's compiled functions only when asked; left to
            # the thread's exit they can meet a finalizing interpreter and abort it.
            mx.clear_streams()

    # -- any thread ---------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        """What handlers may read about the model being served."""
        served = self.served
        return None if served is None else served.info

    @property
    def stats(self) -> EngineStats:
        """The figures Status reports, as last published."""
        return self._stats.published

    @property
    def last_metrics(self) -> RequestMetrics:
        """What GetMetrics reports of the most recently finished request."""
        return self._scheduler.last_metrics

    def submit(self, request: GenerationRequest, loop) -> RequestStream:
        self._check_open()
        stream = RequestStream(loop, self._loop.outbox)
        self._loop.inbox.put(Submit(request, stream))
        return stream

    def compute(self, request: ComputeRequest) -> Future:
        """An embedding vector, a Score request's per-token logprobs for each
        candidate, or a Rerank's (yes, no) logprobs for each document, computed a
        chunk at a time between decode steps."""
        self._check_open()
        future: Future = Future()
        self._loop.inbox.put(Compute(request, future))
        return future

    def count_beside(self, lent: Callable[[], int]) -> None:
        """Shrink the memory budget's room by ``lent()`` bytes, read at each
        admission: the device memory fine-tuning jobs hold."""
        self._scheduler.lent = lent

    def withdraw(self, future: Future) -> None:
        """Drop the work of ``compute``'s ``future``, whose caller went away."""
        if not self._closed:
            self._loop.inbox.put(Withdraw(future))

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the engine thread between steps."""
        self._check_open()
        future: Future = Future()
        self._loop.inbox.put(Call(fn, args, future))
        return future

    def load(self, plan: LoadPlan) -> Future:
        """Load ``plan``'s model; a failure before its weights load keeps the
        current model. The future's result is the new model's ``ModelInfo``."""
        return self.call(self._load, plan)

    def free(self) -> Future:
        return self.call(self._free)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._loop.inbox.put(Stop())
        self._thread.join(timeout)

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise Aborted("the backend is shutting down")

    # -- the engine thread's turns ------------------------------------------

    @property
    def idle_timeout(self) -> float | None:
        return self._group.idle_timeout

    def busy(self) -> bool:
        return bool(self._scheduler or self._jobs)

    def decoding(self) -> bool:
        return bool(self._scheduler.running)

    def accept(self, message: Submit | Compute | Withdraw | Call) -> None:
        match message:
            case Submit():
                self._scheduler.waiting.append(message)
            case Compute(request, future):
                self._queue_job(request, future)
            case Withdraw(future):
                self._jobs.withdraw(future)
            case Call(fn, args, future):
                self._run_call(fn, args, future)
        self._publish()

    def step(self) -> None:
        served, scheduler = self.served, self._scheduler
        had_sequences = bool(scheduler.running)
        with self._group.watching():
            # Cancelled rows retire first, so that their KV state serves new requests.
            if scheduler.schedule(served, self._group.broken):
                self._publish()
            if scheduler.running:
                had_sequences = True
                scheduler.update(served, served.decoder.step())
            if served is not None:
                # With nothing left decoding, whatever is left settles now.
                served.store.settle(SETTLE_BYTES if scheduler.running else None)
            if self._jobs:
                # On the decode steps' stream: one BLAS thread team, and one order
                # of collectives on every rank of a group.
                with mx.stream(thread_stream()):
                    self._jobs.step(served, self._publish)
        # Status shows the engine idle as soon as its last sequence retires.
        if self._stats.count_step() or (had_sequences and not scheduler.running):
            self._publish()

    def idle(self) -> None:
        if self.served is not None:
            self.served.store.sync()

    def heartbeat(self) -> None:
        self._group.heartbeat()
        self._publish()

    def fail(self, reason: str) -> None:
        self._abort_all(reason)

    def close(self) -> None:
        self._closed = True
        self._abort_all("the backend is shutting down", keep_decoder=False)
        if self.served is not None:
            self.served.store.sync()
        self._group.exit()

    def _queue_job(self, request: ComputeRequest, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        refusal = admission_refusal(self.served, request.load_id, self._group.broken)
        if refusal is not None:
            future.set_exception(refusal)
        else:
            self._jobs.add(request, future)

    def _run_call(self, fn, args, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:
            self._publish()
            future.set_exception(e)
        else:
            # Status must show the new state once the caller has the result.
            self._publish()
            future.set_result(result)

    def _abort_all(self, reason: str, keep_decoder: bool = True) -> None:
        # Unload clears the cache, shutdown ends it, and a failed loop's state
        # is suspect: nothing here is worth keeping.
        self._scheduler.abort(reason)
        self._jobs.abort(Aborted(reason))
        # Tell the handlers now: an unload may be followed by a long load.
        self._loop.outbox.flush()
        if self.served is None:
            return
        if keep_decoder:
            self.served.decoder.reset()
        else:
            self.served.decoder.close()

    def _publish(self) -> None:
        running = len(self._scheduler.running)
        admission = self._scheduler.breakdown(self.served)
        self._stats.publish(self.served, running, self._group, admission)

    # -- loading ------------------------------------------------------------

    def _load(self, plan: LoadPlan) -> ModelInfo:
        previous = self._stats.state
        self._stats.state = "loading"
        self._publish()
        try:
            check_plan(plan)
            self._join(plan.options)
            # Resolved and checked beside the running model, which a failure keeps.
            resolved = resolve(plan, self._group.lockstep)
        except Exception:
            self._stats.state = previous
            raise
        self._unload()
        try:
            self.served = self._loader.load(resolved, self._group.lockstep)
        except Exception:
            self._stats.state = "error"
            raise
        self._stats.state = "ready"
        # The loaded model's objects live until the next load: keep the garbage
        # collector from scanning them while tokens stream. The load's own garbage
        # is young; older garbage waits for the unload's full collection (a full
        # one here took 45-90 ms of each load).
        gc.collect(1)
        gc.freeze()
        return self.served.info

    def _join(self, options: LoadOptions) -> None:
        """Rank 0's group, joined at the first load that names one."""
        if self._group.lockstep is None:
            leader = join_leader(options, os.environ)
            if leader is not None:
                self._group = leader
                self._jobs = LeaderJobs(self._jobs, leader.lockstep)
        self._group.check()

    def _unload(self) -> None:
        self._abort_all("the model was unloaded", keep_decoder=False)
        if self.served is not None:
            self.served.store.close()
        self._group.unloaded()
        self.served = None
        gc.unfreeze()
        gc.collect()
        release_memory()

    def _free(self) -> None:
        forget_tokenizers()
        self._unload()
        self._stats.state = "uninitialized"
