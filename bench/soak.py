"""Soak test: a real backend serving the default model under mixed concurrent load.

``make soak`` (``SOAK_MINUTES=``) or ``python -m bench.soak --minutes M`` from the
project root. Streaming and unary requests, client cancels and short deadlines,
JSON-schema grammars and copy requests that speculation takes, seeded and greedy,
chat and raw prompts of 10 to 4,000 tokens, from 1 to 32 at a time (on a CPU up
to 16, of up to 450 tokens), a number that changes every few seconds, so the batch
does. It reports the requests done, errors
by status code, latency per kind, Health latency and the server's memory over time
(RSS, and on a GPU the device memory MLX holds), and fails on UNKNOWN/INTERNAL (or
any other unexpected status), a hang, memory growth of more than 15% after the
warm-up, MLX's CUDA graph-cache error in the log, a wrong greedy reference answer at
the end, or an unclean SIGTERM shutdown.
"""

import argparse
import logging
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

import backend_pb2 as pb
import backend_pb2_grpc
from bench.batching import TOPICS, percentile
from bench.overhead import PROMPT, STORY_SCHEMA
from mlx_backend.gpu import device_description
from tests.support import ANSWER, QUESTION, Server, chat, rss_kib

logger = logging.getLogger(__name__)

PHASE_SECONDS = 6.0  # how long one number of requests at a time lasts
HANG_LIMIT = 120.0  # seconds any call without its own short deadline may take
RSS_INTERVAL = 5.0
HEALTH_INTERVAL = 0.5
RSS_GROWTH_LIMIT = 0.15
KINDS = ("stream", "unary", "cancel", "deadline", "grammar", "copy")
WEIGHTS = (30, 25, 12, 12, 11, 10)


@dataclass(frozen=True)
class Load:
    """The most requests at a time, and prompt lengths in words (about a token and
    a half each) with their weights."""

    concurrency: int
    prompt_words: tuple[tuple[int, int], ...]
    weights: tuple[int, ...]


# A GPU takes batches of 32 and prompts of up to 4,000 tokens; two CPU cores take
# 16 short ones (longer ones there make every request wait past HANG_LIMIT).
GPU_LOAD = Load(32, ((10, 100), (100, 1000), (1000, 2600)), (60, 30, 10))
CPU_LOAD = Load(16, ((10, 60), (60, 300)), (80, 20))
GRAPH_CACHE_ERROR = "Cache thrashing is happening"
EXPECTED = {
    "cancel": grpc.StatusCode.CANCELLED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
}


def context(rng: random.Random, words: int) -> str:
    """``words`` words of prose, from a random place in a repeated paragraph."""
    paragraph = PROMPT.split()
    start = rng.randrange(len(paragraph))
    return " ".join(paragraph[(start + i) % len(paragraph)] for i in range(words))


@dataclass
class Call:
    kind: str
    code: str  # a grpc.StatusCode name, or "OK"
    seconds: float
    details: str = ""

    @property
    def expected(self) -> bool:
        return self.code == "OK" or (
            self.kind in EXPECTED and self.code == EXPECTED[self.kind].name
        )


@dataclass
class Soak:
    stub: backend_pb2_grpc.BackendStub
    pid: int
    seconds: float
    gpu: bool = False  # the server's memory counts MLX's device memory too
    calls: list[Call] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (t, kB)
    start: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def running(self) -> bool:
        return time.monotonic() - self.start < self.seconds

    @property
    def load(self) -> Load:
        return GPU_LOAD if self.gpu else CPU_LOAD

    def at_a_time(self) -> int:
        """How many workers send now: a random 1 to the load's concurrency per phase."""
        phase = int((time.monotonic() - self.start) / PHASE_SECONDS)
        return random.Random(phase).randint(1, self.load.concurrency)

    def request(self, rng: random.Random, kind: str) -> pb.PredictOptions:
        topic = rng.choice(TOPICS)
        # Cancels and deadlines need a long reply to cut into.
        long = kind in EXPECTED
        fields = dict(
            Tokens=64 if long else rng.randint(8, 64),
            IgnoreEOS=long or rng.random() < 0.3,
        )
        if kind == "copy":
            # Greedy and copied from the prompt: n-gram speculation's case.
            text = context(
                rng, rng.randint(60, min(400, self.load.prompt_words[-1][1]))
            )
            return chat(f"Repeat this text exactly:\n\n{text}", Tokens=64)
        if kind == "grammar":
            fields["Grammar"] = STORY_SCHEMA
        if rng.random() < 0.5:
            fields.update(Temperature=rng.uniform(0.5, 1.0), Seed=rng.randint(1, 2**30))
        low, high = rng.choices(self.load.prompt_words, self.load.weights)[0]
        text = context(rng, rng.randint(low, high))
        if rng.random() < 0.5:
            return chat(f"{text}\n\nWrite a short story about {topic}.", **fields)
        return pb.PredictOptions(Prompt=f"{text}\nOnce upon a time, {topic}", **fields)

    def one(self, rng: random.Random) -> Call:
        kind = rng.choices(KINDS, WEIGHTS)[0]
        request = self.request(rng, kind)
        timeout = rng.uniform(0.3, 2.0) if kind == "deadline" else HANG_LIMIT
        either = kind in ("deadline", "grammar", "copy")
        unary = kind == "unary" or (either and rng.random() < 0.5)
        start = time.monotonic()
        try:
            if unary:
                self.stub.Predict(request, timeout=timeout)
            else:
                stream = self.stub.PredictStream(request, timeout=timeout)
                cut = rng.randint(1, 4) if kind == "cancel" else None
                for n, _ in enumerate(stream, 1):
                    if n == cut:
                        stream.cancel()
            code, details = "OK", ""
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        return Call(kind, code, time.monotonic() - start, details)

    def worker(self, index: int) -> None:
        rng = random.Random(index)
        while self.running():
            if index >= self.at_a_time():
                time.sleep(0.1)
                continue
            try:
                self.calls.append(self.one(rng))
            except Exception as e:  # a bug here must not pass for a clean run
                logger.exception("client error")
                self.calls.append(Call("client", "CLIENT_ERROR", 0.0, repr(e)))

    def sample_health(self) -> None:
        while self.running():
            start = time.monotonic()
            try:
                self.stub.Health(pb.HealthMessage(), timeout=HANG_LIMIT)
                self.health.append(time.monotonic() - start)
            except grpc.RpcError as e:
                self.calls.append(
                    Call("health", e.code().name, time.monotonic() - start, e.details())
                )
            time.sleep(HEALTH_INTERVAL)

    def memory_kib(self) -> int | None:
        """The server's RSS, and on a GPU the device memory MLX holds besides."""
        kb = rss_kib(self.pid)
        if kb is None or not self.gpu:
            return kb
        try:
            status = self.stub.Status(pb.HealthMessage(), timeout=HANG_LIMIT)
        except grpc.RpcError:
            return None
        return kb + status.memory.total // 1024

    def sample_rss(self) -> None:
        while True:
            t = time.monotonic() - self.start
            kb = self.memory_kib()
            if kb is not None:
                self.rss.append((t, kb))
            if len(self.rss) % 6 == 1:
                unexpected = sum(not c.expected for c in self.calls)
                logger.info(
                    "t=%3.0fs requests=%d unexpected=%d at a time=%d memory=%s",
                    t,
                    len(self.calls),
                    unexpected,
                    self.at_a_time(),
                    f"{kb / 1024:.1f} MiB" if kb else "gone",
                )
            if kb is None or self.done.wait(RSS_INTERVAL):
                return


def report_calls(soak: Soak) -> list[str]:
    failures = []
    calls = soak.calls
    codes = Counter(c.code for c in calls)
    expected = Counter(c.code for c in calls if c.expected and c.code != "OK")
    logger.info(
        "requests done: %d (OK %d; expected: %s)",
        sum(c.kind in KINDS for c in calls),
        codes["OK"],
        ", ".join(f"{k} {v}" for k, v in sorted(expected.items())) or "none",
    )
    logger.info(
        "%-9s %6s %6s %9s %8s %8s", "kind", "n", "OK", "expected", "p50 s", "p95 s"
    )
    for kind in KINDS:
        mine = [c for c in calls if c.kind == kind]
        seconds = [c.seconds for c in mine]
        logger.info(
            "%-9s %6d %6d %9d %8.2f %8.2f",
            kind,
            len(mine),
            sum(c.code == "OK" for c in mine),
            sum(c.expected and c.code != "OK" for c in mine),
            percentile(sorted(seconds), 0.5),
            percentile(sorted(seconds), 0.95),
        )
    unexpected = [c for c in calls if not c.expected]
    if not unexpected:
        logger.info("unexpected errors: none")
    for code, n in sorted(Counter(c.code for c in unexpected).items()):
        first = next(c for c in unexpected if c.code == code)
        logger.info(
            "unexpected %s: %d (first: %s %r)", code, n, first.kind, first.details
        )
        hang = code == "DEADLINE_EXCEEDED" and first.kind != "deadline"
        what = f"hang: a call ran past {HANG_LIMIT:.0f} s" if hang else "status"
        failures.append(f"{n} x {code} ({what}; first: {first.kind} {first.details!r})")
    if soak.health:
        logger.info(
            "Health: %d calls, p50 %.1f ms, p95 %.1f ms, max %.1f ms",
            len(soak.health),
            1000 * percentile(sorted(soak.health), 0.5),
            1000 * percentile(sorted(soak.health), 0.95),
            1000 * max(soak.health),
        )
    return failures


def report_rss(soak: Soak, warmup: float) -> list[str]:
    what = "RSS and device memory" if soak.gpu else "RSS"
    logger.info("server %s (MiB) every %.0f s:", what, RSS_INTERVAL)
    for i in range(0, len(soak.rss), 6):
        row = soak.rss[i : i + 6]
        logger.info("  %s", " | ".join(f"{t:4.0f}s {kb / 1024:7.1f}" for t, kb in row))
    base = next(((t, kb) for t, kb in soak.rss if t >= warmup), None)
    after = [kb for t, kb in soak.rss if base and t > base[0]]
    if not after:
        return [f"too few RSS samples after the {warmup:.0f} s warm-up"]
    growth = max(after) / base[1] - 1
    logger.info(
        "%s growth after warm-up: %.1f MiB at %.0f s -> max %.1f MiB after: %+.1f%% "
        "(limit %+.0f%%)",
        what,
        base[1] / 1024,
        base[0],
        max(after) / 1024,
        100 * growth,
        100 * RSS_GROWTH_LIMIT,
    )
    if growth > RSS_GROWTH_LIMIT:
        return [f"{what} grew {100 * growth:.1f}% after the warm-up"]
    return []


def final_checks(server: Server) -> list[str]:
    failures = []
    if GRAPH_CACHE_ERROR in server.logs():
        failures.append(f"MLX's CUDA graph cache failed: {GRAPH_CACHE_ERROR!r} logged")
    deadline = time.monotonic() + 30
    while server.stub.Status(pb.HealthMessage(), timeout=10).state != (
        pb.StatusResponse.READY
    ):
        if time.monotonic() > deadline:
            failures.append("server still BUSY 30 s after the load stopped")
            break
        time.sleep(0.1)
    try:
        reply = server.stub.Predict(chat(QUESTION, Tokens=64), timeout=HANG_LIMIT)
        answer = reply.message.decode()
    except grpc.RpcError as e:
        answer = f"<{e.code().name}: {e.details()}>"
    logger.info("greedy reference: %r", answer)
    if answer != ANSWER:
        failures.append(f"greedy reference {answer!r} != {ANSWER!r}")
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    stopped = "stopped" in server.logs()
    logger.info("SIGTERM: exit code %s, 'stopped' logged: %s", code, stopped)
    if code != 0 or not stopped:
        failures.append(f"unclean SIGTERM shutdown (exit code {code})")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    seconds = 60 * args.minutes
    warmup = 60.0 * min(1.0, args.minutes / 2)
    if args.minutes < 2:
        logger.info(
            "a run under 2 minutes: the RSS warm-up is %.0f s, not 60 s", warmup
        )

    server = Server("--model", "default", fresh_blas=True)
    failures: list[str] = []
    try:
        server.wait_for(pb.StatusResponse.READY)
        device = device_description()
        soak = Soak(server.stub, server.process.pid, seconds, gpu=device != "CPU")
        load = soak.load
        logger.info(
            "soak: %.0f s at 1 to %d requests at a time (a new number every %.0f s) "
            "against pid %d, port %d, on the %s",
            seconds,
            load.concurrency,
            PHASE_SECONDS,
            soak.pid,
            server.port,
            device,
        )
        threads = [
            threading.Thread(target=soak.worker, args=(i,), daemon=True)
            for i in range(load.concurrency)
        ]
        threads.append(threading.Thread(target=soak.sample_health, daemon=True))
        sampler = threading.Thread(target=soak.sample_rss, daemon=True)
        for thread in threads + [sampler]:
            thread.start()
        end = soak.start + seconds + HANG_LIMIT + 30
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        soak.done.set()  # RSS is sampled until the last request is done
        sampler.join()
        if any(thread.is_alive() for thread in threads):
            failures.append("hang: the run did not finish")
        soak.calls = list(soak.calls)  # a stuck worker can't add to the report
        failures += report_calls(soak)
        failures += report_rss(soak, warmup)
        if server.process.poll() is not None:
            failures.append(f"the server died (exit code {server.process.returncode})")
        elif not any("hang" in f for f in failures):
            failures += final_checks(server)
    except Exception as e:
        logger.exception("soak error")
        failures.append(f"soak error: {e!r}")
    finally:
        if failures:
            kept = tempfile.NamedTemporaryFile(
                prefix="soak-backend-", suffix=".log", delete=False
            ).name
            shutil.copy(server.log.name, kept)
            logger.info("backend log kept at %s", kept)
        server.stop()
    for failure in failures:
        logger.error("FAIL: %s", failure)
    if not failures:
        logger.info("PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
