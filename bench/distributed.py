"""Part 7 of ``make bench``: serving over an MLX distributed group, on loopback.

The default model served by 1 process, by 2 ranks (pipeline: its 9 query heads
don't split in 2) and by 3 ranks (tensor parallel), side by side: TTFT and decode
tok/s of one stream, aggregate tok/s of 8 streams, the time each token gains over
one process (the collectives of a step), and each rank's resident memory. On one
machine more ranks only add work; the figures measure the group's overhead.
"""

import logging
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import backend_pb2 as pb
from bench.batching import grpc_stream, run_concurrently
from tests.support import MODEL, Server, Worker, rss_kib, write_hostfile

logger = logging.getLogger(__name__)

STREAMS = 8
# (ranks, split): collectives per token are 2 per layer plus the input sharing
# for tensor parallel, and a send/recv per stage boundary plus a gather for a
# pipeline.
GROUPS = ((1, ""), (2, "pipeline"), (3, "tensor"))


def start_group(stack: ExitStack, folder: Path, ranks: int, mode: str):
    """Rank 0's server (and its workers' processes) with the default model."""
    options = []
    workers = []
    if ranks > 1:
        hostfile = write_hostfile(folder, ranks)
        workers = [Worker(hostfile, rank, fresh_blas=True) for rank in range(1, ranks)]
        for worker in workers:
            stack.callback(worker.stop)
        options = [f"hostfile:{hostfile}", f"distributed_mode:{mode}"]
    server = Server(fresh_blas=True)
    stack.callback(server.stop)
    result = server.stub.LoadModel(
        pb.ModelOptions(Model=MODEL, Options=options), timeout=300
    )
    if not result.success:
        raise RuntimeError(f"{ranks} ranks: {result.message}")
    return server, workers


def measure(server, tokens: int, eos: int, rounds: int) -> dict:
    singles, ttfts, aggregates = [], [], []
    for round in range(rounds):
        stream = grpc_stream(
            server.stub, f"Tell me about lighthouses ({round}).", tokens, eos
        )
        ttfts.append(stream.arrivals[0] - stream.start)
        singles.append(
            (len(stream.arrivals) - 1) / (stream.arrivals[-1] - stream.arrivals[0])
        )
        prompts = [f"Write about the sea, part {i} ({round})." for i in range(STREAMS)]
        started = time.perf_counter()
        streams = run_concurrently(
            lambda p: grpc_stream(server.stub, p, tokens, eos), prompts
        )
        seconds = max(s.arrivals[-1] for s in streams) - started
        aggregates.append(sum(len(s.arrivals) for s in streams) / seconds)
    return {
        "ttft_s": statistics.median(ttfts),
        "decode_tok_s": statistics.median(singles),
        "aggregate_tok_s": statistics.median(aggregates),
    }


def bench_distributed(rounds: int, tokens: int, eos: int = 2) -> tuple[dict, list[str]]:
    report: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        for ranks, mode in GROUPS:
            with ExitStack() as stack:
                server, workers = start_group(stack, Path(folder), ranks, mode)
                figures = measure(server, tokens, eos, rounds)
                pids = [server.process.pid] + [w.process.pid for w in workers]
                figures["rss_mib"] = [(rss_kib(pid) or 0) // 1024 for pid in pids]
                report[f"{ranks}"] = {"split": mode or "one process", **figures}
                logger.info("part 7, %d ranks: %s", ranks, figures)
    one = report["1"]
    lines = [
        f"7. Serving over an MLX distributed group on loopback (ring), default model, "
        f"{tokens} tokens, median of {rounds}",
        f"   {'ranks':<18}{'TTFT s':>8}{'1 stream':>10}{'8 streams':>11}"
        f"{'+ms/token':>11}   RSS MiB per rank",
    ]
    for key, figures in report.items():
        extra = 1000 / figures["decode_tok_s"] - 1000 / one["decode_tok_s"]
        figures["added_ms_per_token"] = extra
        label = f"{key} ({figures['split']})"
        lines.append(
            f"   {label:<18}{figures['ttft_s']:>8.2f}{figures['decode_tok_s']:>10.1f}"
            f"{figures['aggregate_tok_s']:>11.1f}{extra:>11.1f}   "
            + " / ".join(str(m) for m in figures["rss_mib"])
        )
    return report, lines
