#!/usr/bin/env python3
"""Side-by-side benchmark: the gRPC backend against mlx-lm's own stream_generate.

Both run the embedded default model on the same prompt, greedy, with EOS banned
so every run decodes the same number of tokens. Rounds alternate between the two
so machine noise hits both alike. It also samples Health latency while a long
generation streams. Results go to stdout and bench-results/core.json.
"""

import argparse
import json
import logging
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors

import backend_pb2 as pb
import backend_pb2_grpc
from gguf_loader import load_gguf
from mlx_utils import default_model_path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def start_server(log_path: Path) -> tuple[subprocess.Popen, int]:
    log = open(log_path, "w")
    process = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "backend.py"),
            "--addr",
            "127.0.0.1:0",
            "--model",
            "default",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=HERE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())
        if found and "startup model" in log_path.read_text():
            return process, int(found.group(1))
        if process.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"backend did not start:\n{log_path.read_text()}")


def server_decode(stub, tokens: int, eos: int) -> dict:
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content=PROMPT)],
        Tokens=tokens,
        LogitBias=json.dumps({str(eos): -1e9}),
    )
    start = time.perf_counter()
    first = None
    for reply in stub.PredictStream(request):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {
        "tokens": reply.tokens,
        "ttft_s": first - start,
        "decode_tps": (reply.tokens - 1) / (end - first),
    }


def library_decode(model, tokenizer, tokens: int, eos: int) -> dict:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    processors = make_logits_processors(logit_bias={eos: -1e9})
    start = time.perf_counter()
    first = None
    n = 0
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=tokens, logits_processors=processors
    ):
        if first is None:
            first = time.perf_counter()
        n = response.generation_tokens
    end = time.perf_counter()
    return {"tokens": n, "ttft_s": first - start, "decode_tps": (n - 1) / (end - first)}


def health_latency(stub, tokens: int) -> dict:
    """Health round trips (ms) sampled while one long generation streams."""
    done = threading.Event()
    samples: list[float] = []

    def probe():
        while not done.is_set():
            start = time.perf_counter()
            stub.Health(pb.HealthMessage())
            samples.append((time.perf_counter() - start) * 1000)
            time.sleep(0.02)

    stream = stub.PredictStream(
        pb.PredictOptions(
            UseTokenizerTemplate=True,
            Messages=[pb.Message(role="user", content=PROMPT)],
            Tokens=tokens,
            IgnoreEOS=True,
        )
    )
    next(stream)
    thread = threading.Thread(target=probe)
    thread.start()
    for _ in stream:
        pass
    done.set()
    thread.join()
    samples.sort()
    return {
        "samples": len(samples),
        "p50_ms": statistics.median(samples),
        "p95_ms": samples[int(0.95 * (len(samples) - 1))],
        "max_ms": samples[-1],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=128, help="tokens decoded per run"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "bench-results" / "core.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    model, tokenizer, _ = load_gguf(default_model_path())
    eos = next(iter(tokenizer.eos_token_ids))
    with tempfile.TemporaryDirectory() as folder:
        process, port = start_server(Path(folder) / "backend.log")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = backend_pb2_grpc.BackendStub(channel)
                # Warm both paths once before measuring.
                server_decode(stub, 16, eos)
                library_decode(model, tokenizer, 16, eos)
                runs = {"grpc": [], "mlx_lm": []}
                for i in range(args.rounds):
                    logger.info("round %d/%d", i + 1, args.rounds)
                    runs["grpc"].append(server_decode(stub, args.tokens, eos))
                    runs["mlx_lm"].append(
                        library_decode(model, tokenizer, args.tokens, eos)
                    )
                health = health_latency(stub, args.tokens)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)

    summary = {
        name: {
            "decode_tps": statistics.median(r["decode_tps"] for r in results),
            "ttft_s": statistics.median(r["ttft_s"] for r in results),
            "tokens": results[0]["tokens"],
        }
        for name, results in runs.items()
    }
    ratio = summary["grpc"]["decode_tps"] / summary["mlx_lm"]["decode_tps"]
    report = {
        "runs": runs,
        "summary": summary,
        "grpc_over_mlx_lm": ratio,
        "health": health,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    lines = [
        f"decode, {args.tokens} tokens, median of {args.rounds} alternating rounds",
        f"{'path':<28}{'decode tok/s':>14}{'TTFT s':>10}",
    ]
    for name, label in (
        ("mlx_lm", "mlx-lm stream_generate"),
        ("grpc", "gRPC PredictStream"),
    ):
        s = summary[name]
        lines.append(f"{label:<28}{s['decode_tps']:>14.2f}{s['ttft_s']:>10.3f}")
    lines.append(
        f"gRPC / mlx-lm decode ratio: {ratio:.3f} (overhead {100 * (1 - ratio):.1f}%)"
    )
    lines.append(
        f"Health during generation: p50 {health['p50_ms']:.2f} ms, p95 {health['p95_ms']:.2f} ms, "
        f"max {health['max_ms']:.2f} ms over {health['samples']} calls"
    )
    sys.stdout.write("\n".join(lines) + f"\nwritten to {out}\n")


if __name__ == "__main__":
    main()
