"""Part 4 of ``make bench``: continuous batching, throughput against concurrency.

The backend (gRPC PredictStream) and ``mlx_lm.server`` (HTTP, streaming chat
completions) serve the same float32 weights on the same BLAS, with the same prompts
at the same concurrency: greedy, EOS banned, so every stream decodes the same
number of tokens. Rounds alternate between the two servers, each going first in
turn, so machine noise hits both alike.
"""

import http.client
import json
import logging
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import backend_pb2 as pb

logger = logging.getLogger(__name__)

LEVELS = (1, 2, 4, 8, 16)
TOPICS = (
    "a lighthouse keeper",
    "a dragon who bakes bread",
    "a robot learning to paint",
    "two rival chess players",
    "a lost city under the sea",
    "a fox and a crow",
    "the first day of spring",
    "a detective in Lyon",
    "a violin maker",
    "a ship in a storm",
    "a garden on Mars",
    "an old clock tower",
    "a mountain village",
    "a library at midnight",
    "a cat who travels by train",
    "the last snowfall",
)


@dataclass
class Stream:
    """One streamed reply: when it started, when each chunk came, how many tokens;
    its text, and the prompt's tokens and those the server had cached (as
    mlx_lm.server reports them; 0 from the backend, whose Status counts them)."""

    start: float
    arrivals: list[float]
    tokens: int
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


def prompt_for(level: int, round: int, i: int) -> str:
    # A new opening for every request, so no prompt cache serves it.
    return (
        f"Request {round}.{level}.{i}. Write a story about {TOPICS[i % len(TOPICS)]}."
    )


def chat_messages(prompt: str | list[dict]) -> list[dict]:
    """A chat: ``prompt`` as the user's message, or the messages as given."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def grpc_stream(
    stub,
    prompt: str | list[dict],
    tokens: int,
    eos: int,
    first_token: threading.Event | None = None,
) -> Stream:
    """A greedy PredictStream with ``eos`` banned; ``first_token`` is set when the
    first text arrives, for callers that act once a stream is decoding."""
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(**m) for m in chat_messages(prompt)],
        Tokens=tokens,
        LogitBias=json.dumps({str(eos): -1e9}),
    )
    start = time.perf_counter()
    arrivals, chunks, prompt_tokens = [], [], 0
    for reply in stub.PredictStream(request):
        if reply.message:
            arrivals.append(time.perf_counter())
            chunks.append(reply.message)
            if first_token is not None:
                first_token.set()
        prompt_tokens = max(prompt_tokens, reply.prompt_tokens)
    text = b"".join(chunks).decode()
    return Stream(start, arrivals, reply.tokens, text, prompt_tokens)


def http_stream(
    port: int,
    model: str,
    prompt: str | list[dict],
    tokens: int,
    eos: int,
    first_token: threading.Event | None = None,
) -> Stream:
    """``grpc_stream``'s request as mlx_lm.server's streaming chat completion."""
    body = {
        "model": model,
        "messages": chat_messages(prompt),
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": {str(eos): -1e9},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    for attempt in range(5):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            connection.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            response = connection.getresponse()
            break
        except (ConnectionResetError, http.client.RemoteDisconnected):
            # http.server's listen backlog of 5 can drop a burst of connections;
            # the retry's time still counts from the first attempt.
            connection.close()
            logger.info("mlx_lm.server reset a connection; retrying")
    else:
        raise RuntimeError("mlx_lm.server kept resetting the connection")
    arrivals, texts, usage = [], [], {}
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: ") :])
        usage = chunk.get("usage") or usage
        choices = chunk.get("choices") or [{}]
        content = choices[0].get("delta", {}).get("content")
        if content:
            arrivals.append(time.perf_counter())
            texts.append(content)
            if first_token is not None:
                first_token.set()
    connection.close()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Stream(
        start,
        arrivals,
        usage.get("completion_tokens") or len(arrivals),
        "".join(texts),
        usage.get("prompt_tokens", 0),
        cached,
    )


def run_all(make_stream, prompts: list) -> list[Stream | Exception]:
    """One stream per prompt, all started at once; each stream, or the exception
    it ended with."""
    streams: list = [None] * len(prompts)

    def run(i):
        try:
            streams[i] = make_stream(prompts[i])
        except Exception as e:
            streams[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams


def run_concurrently(make_stream, prompts: list) -> list[Stream]:
    """``run_all``'s streams; RuntimeError if any failed or returned no text."""
    streams = run_all(make_stream, prompts)
    for s in streams:
        if isinstance(s, Exception):
            raise RuntimeError(f"a stream failed: {s!r}") from s
    if not all(s.arrivals for s in streams):
        raise RuntimeError("a stream returned no text: the figures would be wrong")
    return streams


def run_level(make_stream, level: int, round: int) -> dict:
    """``level`` concurrent streams; throughput and latency figures."""
    prompts = [prompt_for(level, round, i) for i in range(level)]
    streams = run_concurrently(make_stream, prompts)
    begin = min(s.start for s in streams)
    end = max(s.arrivals[-1] for s in streams)
    ttfts = sorted(s.arrivals[0] - s.start for s in streams)
    gaps = sorted(b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]))
    return {
        "tokens": sum(s.tokens for s in streams),
        "throughput_tps": sum(s.tokens for s in streams) / (end - begin),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "itl_p50_ms": percentile(gaps, 0.5) * 1000,
        "itl_p95_ms": percentile(gaps, 0.95) * 1000,
    }


def percentile(values: list[float], q: float) -> float:
    return values[round(q * (len(values) - 1))] if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class MlxLmProcess:
    """A running mlx_lm.server: its port, and its pid for memory readings."""

    port: int
    pid: int


@contextmanager
def mlx_lm_server(folder: str, log_folder: str) -> Iterator[int]:
    """``python -m mlx_lm.server`` on ``folder``; yields its port."""
    with mlx_lm_process(folder, log_folder) as server:
        yield server.port


@contextmanager
def mlx_lm_process(folder: str, log_folder: str) -> Iterator[MlxLmProcess]:
    """``python -m mlx_lm.server`` on ``folder``, once it answers."""
    port = free_port()
    log_path = Path(log_folder) / "mlx_lm_server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", folder]
            + ["--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/v1/models")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlx_lm.server did not start:\n{log_path.read_text()}"
                )
            time.sleep(0.2)
        yield MlxLmProcess(port, process.pid)
    finally:
        process.terminate()
        process.wait(30)


def bench_batching(
    stub, folder: str, log_folder: str, rounds: int, tokens: int, plot: Path
) -> tuple[dict, list[str]]:
    eos = 2
    sides = {}
    with mlx_lm_server(folder, log_folder) as port:
        makers = {
            "grpc": lambda p: grpc_stream(stub, p, tokens, eos),
            "mlx_lm": lambda p: http_stream(port, "default_model", p, tokens, eos),
        }
        for name, make in makers.items():
            make("Warm up.")
            sides[name] = {level: [] for level in LEVELS}
        for level in LEVELS:
            for r in range(rounds):
                # Each round swaps which server goes first.
                order = list(makers.items())[:: 1 if r % 2 == 0 else -1]
                for name, make in order:
                    logger.info(
                        "batching: %s, %d streams, round %d", name, level, r + 1
                    )
                    sides[name][level].append(run_level(make, level, r))
    summary = {
        name: {
            level: {
                key: statistics.median(run[key] for run in runs)
                for key in runs[0]
                if key != "tokens"
            }
            for level, runs in levels.items()
        }
        for name, levels in sides.items()
    }
    lines = [
        f"4. continuous batching: {tokens} tokens per stream, greedy, median of "
        f"{rounds} alternating rounds; mlx_lm.server on the same float32 weights",
        f"{'streams':>7}  {'server':<8}{'tok/s':>8}{'TTFT p50':>10}{'p95 s':>8}"
        f"{'ITL p50':>9}{'p95 ms':>8}",
    ]
    for level in LEVELS:
        for name, label in (("grpc", "backend"), ("mlx_lm", "mlx_lm")):
            s = summary[name][level]
            lines.append(
                f"{level:>7}  {label:<8}{s['throughput_tps']:>8.1f}"
                f"{s['ttft_p50_s']:>10.3f}{s['ttft_p95_s']:>8.3f}"
                f"{s['itl_p50_ms']:>9.1f}{s['itl_p95_ms']:>8.1f}"
            )
    ours = {level: summary["grpc"][level]["throughput_tps"] for level in LEVELS}
    theirs = {level: summary["mlx_lm"][level]["throughput_tps"] for level in LEVELS}
    lines.append(
        f"backend 8 streams / 1 stream: {ours[8] / ours[1]:.2f}x; backend / mlx_lm: "
        + ", ".join(f"{level}: {ours[level] / theirs[level]:.2f}x" for level in LEVELS)
    )
    write_plot(plot, ours, theirs, tokens)
    lines.append(f"plot: {plot}")
    return {"runs": sides, "summary": summary}, lines


def write_plot(path: Path, ours: dict, theirs: dict, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6, 4))
    axes.plot(list(ours), list(ours.values()), marker="o", label="this backend (gRPC)")
    axes.plot(
        list(theirs), list(theirs.values()), marker="s", label="mlx_lm.server (HTTP)"
    )
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(ours), [str(level) for level in ours])
    axes.set_xlabel("concurrent streams")
    axes.set_ylabel("generated tokens/s (all streams)")
    axes.set_title(f"Continuous batching, {tokens} tokens per stream")
    axes.grid(True, alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
