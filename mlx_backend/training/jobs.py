"""The fine-tuning jobs of this backend: each a training worker process
(``worker.py``) whose progress lines a thread collects for ``FineTuneProgress``."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlx_backend.errors import FailedPrecondition, NotFound
from mlx_backend.training.plan import CHECKPOINT_PREFIX, STATE_FILE, FineTunePlan

logger = logging.getLogger(__name__)

ENDED = ("completed", "failed", "stopped")
# Where the training and export processes run (``python -m mlx_backend...``).
ROOT = Path(__file__).resolve().parents[2]


class FineTuneJob:
    """One worker process and the progress it reported, in order."""

    def __init__(self, plan: FineTunePlan):
        self.plan = plan
        self.updates: list[dict] = [{"status": "queued"}]
        # The worker's estimate of its memory, once it has made one.
        self._memory = 0
        self._changed = threading.Condition()
        self._ended = False
        read, write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mlx_backend.training.worker", str(write)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            pass_fds=(write,),
            cwd=ROOT,
            text=True,
        )
        os.close(write)
        self._process.stdin.write(plan.to_json() + "\n")
        self._process.stdin.flush()
        threading.Thread(target=self._collect, args=(read,), daemon=True).start()

    @property
    def ended(self) -> bool:
        return self._ended

    def _collect(self, read: int) -> None:
        with os.fdopen(read) as lines:
            for line in lines:
                self._add(json.loads(line))
        code = self._process.wait()
        if self.updates[-1].get("status") not in ENDED:
            self._add(
                {"status": "failed", "message": f"the training process ended ({code})"}
            )
        logger.info(
            "fine-tuning job %s: %s", self.plan.job_id, self.updates[-1]["status"]
        )
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def memory_bytes(self) -> int:
        """The device memory the job holds by its estimate (0 once it ended)."""
        return 0 if self._ended else self._memory

    def _add(self, update: dict) -> None:
        estimate = update.get("extra_metrics", {}).get("estimated_memory_gb")
        if estimate is not None:
            self._memory = int(estimate * 1e9)
        with self._changed:
            self.updates.append(update)
            self._changed.notify_all()

    def wait(self, seen: int, timeout: float) -> tuple[list[dict], bool]:
        """The updates after the first ``seen``, waiting up to ``timeout`` seconds
        for one; and whether the job has ended."""
        with self._changed:
            self._changed.wait_for(
                lambda: len(self.updates) > seen or self._ended, timeout
            )
            return self.updates[seen:], self._ended

    def stop(self, save: bool) -> None:
        """Ask the worker to stop after its current step (saving a checkpoint of
        it with ``save``)."""
        if self._ended or self._process.poll() is not None:
            return
        try:
            self._process.stdin.write("stop save\n" if save else "stop\n")
            self._process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def close(self, timeout: float) -> None:
        """Stop the worker; kill it if it has not ended within ``timeout``."""
        self.stop(save=False)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class FineTuneJobs:
    """This backend's fine-tuning jobs by id; one runs at a time."""

    def __init__(self):
        self._jobs: dict[str, FineTuneJob] = {}
        self._lock = threading.Lock()

    def start(self, plan: FineTunePlan) -> FineTuneJob:
        with self._lock:
            running = [j for j in self._jobs.values() if not j.ended]
            if running:
                raise FailedPrecondition(
                    f"job_id: fine-tuning job {running[0].plan.job_id} is running; "
                    "one runs at a time"
                )
            if plan.job_id in self._jobs:
                raise FailedPrecondition(f"job_id: {plan.job_id} was used already")
            Path(plan.output_dir).mkdir(parents=True, exist_ok=True)
            job = FineTuneJob(plan)
            self._jobs[plan.job_id] = job
        logger.info(
            "fine-tuning job %s: %s %s, %d steps",
            plan.job_id,
            plan.fine_tune_type,
            plan.method,
            plan.iters,
        )
        return job

    def held_bytes(self) -> int:
        """The device memory the running jobs hold, by their estimates."""
        with self._lock:
            return sum(job.memory_bytes for job in self._jobs.values())

    def get(self, job_id: str) -> FineTuneJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job_id: no fine-tuning job {job_id!r}")
        return job

    def close(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for job in list(self._jobs.values()):
            job.close(max(deadline - time.monotonic(), 0.1))


def list_checkpoints(output_dir: Path) -> list[dict]:
    """Each finished ``checkpoint-<step>`` folder's state, by step."""
    found = []
    if not output_dir.is_dir():
        return found
    for folder in output_dir.glob(f"{CHECKPOINT_PREFIX}*"):
        try:
            state = json.loads((folder / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        found.append({"path": str(folder), **state})
    return sorted(found, key=lambda c: c["step"])
