#!/usr/bin/env python3
"""Side-by-side benchmarks of the backend on the embedded default model.

1. Server overhead (bench/overhead.py): gRPC PredictStream against mlx-lm's own
   stream_generate on the same compute path, greedy, with EOS banned so every run
   decodes the same number of tokens, on the default server (the paged decoder on
   the CPU) and the batch decoder's with CPU pacing on and off (speculation off, as
   in stream_generate); with logprobs
   (top 5 alternatives) and under a JSON-schema grammar; Health latency while a
   long generation streams; and where each millisecond per token goes
   (bench/profile.py); pacing on and off only on the CPU. The header names the
   device: the GPU and its MLX backend, or the CPU, its cores, the BLAS and the
   pacing auto chose.
2. CPU paths (bench/cpu_paths.py; Linux CPU): the stock path (bundled BLAS,
   quantized kernels), float32 weights on OpenBLAS, and the fast path that ``auto``
   picks (MKL on x86_64): prefill on a 1000-token prompt, decode, and peak memory.
3. Prompt cache (bench/prompt_cache.py): time to first token for a ~1500-token
   prompt, cold and warm (after a request that shared its prefix), and the prompt
   tokens actually prefilled over a 6-turn chat against the tokens new in each turn.
4. Continuous batching (bench/batching.py): aggregate tokens/s, TTFT and inter-token
   latency at 1 to 16 concurrent streams, next to mlx_lm.server on the same weights.
5. Shared prefixes (bench/prefix.py): bursts of 8 and 16 chats with one ~1000-token
   system prompt, with prefix sharing on, off, and on mlx_lm.server: time to first
   token and wall time; and a cancel-then-resend's TTFT against a cold start.
6. Speculative decoding (bench/speculative.py): decode tok/s with n-gram prompt
   lookup on and off for a copy-heavy and an open-ended stream, aggregate tok/s of
   8 mixed streams, the acceptance rate, and the copy stream on mlx_lm.server.
7. Distributed (bench/distributed.py): 1 process, 2 ranks and 3 ranks on loopback.
8. Memory and persistence (bench/memory.py): KV bytes per token and decode tok/s at
   1 and 8 streams over a 4000-token context for full, q8_0 and q4_0 KV caches; the
   first request's TTFT after a restart with and without its PromptCachePath file.
9. Chat formats (bench/chat_formats.py): what classifying a reply (calls streamed
   as JSON) costs per token against the server's decode time per token, and decode
   under a ToolChoice "required" grammar against unconstrained decode.
10. Model families (bench/model_families.py): a random hybrid qwen3_5 (linear
   attention and full attention) of the default model's size: TTFT per turn of a
   6-turn chat with prompt snapshots on, off and on mlx_lm.server, the prompt
   tokens reused and the snapshots' bytes, for a chat and an agent's tool loop;
   decode tok/s on a copy workload with speculation auto and off, and its
   acceptance; speculation with rollback in-process (bench/rollback.py).
11. Admission under load (bench/admission.py), next to mlx_lm.server: a ~3800-token
   prompt arriving while two streams decode, 5 runs (--admission-runs) judged by the
   worst (the streams' longest gap and their inter-token time while it prefills
   against theirs before it, a short request's TTFT, the long one's against its
   prefill alone, the text against each request alone); 32 concurrent long
   prompts against a backend with a memory_budget (peak RSS, wall time, failures);
   aggregate tok/s at 8 and 16 streams.
12. CPU kernels (bench/cpu_kernels.py; Linux CPU): the SIMD quantized-matmul kernels
   (float32 and int8 activations) against the float32 path and MLX's own quantized
   kernel: decode at 1, 8 and 16 streams, prefill, peak memory, the bytes read per
   step; and a random 1B-class 4-bit llama on the kernels against MLX's.
13. CPU decode and prefill (bench/cpu_step.py; Linux CPU): the kernels with
   float32 and with int8 activations, llama.cpp and ik_llama.cpp on the same GGUF
   and threads (bench/llama_cpp.py, bench/ik_llama.py): decode in-process and at 1,
   8 and 16 streams, pp512 and pp4096, the linears' GB/s, int8's KL and perplexity.
14. Rerank (bench/rerank.py): documents per second for 100 documents of ~200 tokens
   against one query on a yes/no reranker, the judging prompt and the query shared
   through the prompt cache against no prompt cache.
15. Fine-tuning (bench/fine_tune.py): SFT LoRA training tokens/s, job seconds and
   peak memory on the embedded model through StartFineTune, against mlx_lm lora on
   the same weights and LocalAI's trl path (torch, peft and trl in an environment
   of their own) on the same data and settings.

Parts 2, 12 and 13 measure the Linux CPU path: elsewhere (a GPU, macOS) they are
skipped, with the reason among the tables.
Rounds alternate between the sides so machine noise hits both alike. Results go
to stdout and bench-results/core.json; the printed tables are appended, with the
date, the commit and the machine, to bench/RESULTS.md (``--no-results``: not).
This module is the entry point (``python -m bench.bench``, ``make bench``): the
command line, the header, the servers the parts share, the order they run in and
the results file.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import backend_pb2 as pb
from bench.admission import FLOOD_TOKENS, LONG_RUNS, bench_admission
from bench.batching import bench_batching
from bench.chat_formats import bench_chat_formats
from bench.cpu_kernels import bench_cpu_kernels
from bench.cpu_paths import bench_cpu_paths
from bench.cpu_step import bench_cpu_step
from bench.distributed import bench_distributed
from bench.fine_tune import bench_fine_tune
from bench.memory import bench_memory
from bench.model_families import bench_model_families
from bench.one_pass import bench_one_pass
from bench.overhead import bench_overhead, machine_header
from bench.prefix import bench_prefix
from bench.prompt_cache import bench_prompt_cache
from bench.rerank import bench_rerank
from bench.speculative import bench_speculative
from mlx_backend.cpu.allocator import ALLOCATOR_ENV, allocator_in_use
from mlx_backend.cpu.blas import (
    blas_choice_environment,
    fast_blas_in_use,
    find_fast_blas,
)
from mlx_backend.cpu.preload import maybe_reexec_with_preloads, without_preload
from mlx_backend.gpu import device_description
from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path
from tests.support import Server

# The parts that measure the Linux CPU path: its BLAS, kernels and decode step.
CPU_PARTS = {2, 12, 13}

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"


@contextmanager
def running_process(
    env: dict | None = None, options: tuple[str, ...] = (), model: str = "default"
):
    """A backend process with the default model loaded (reloaded with LoadModel
    ``options``, or replaced by ``model``, when given); yields its ``Server``."""
    server = Server("--model", "default", env=env, fresh_blas=True)
    try:
        server.wait_for_log("startup model", timeout=180)
        if options or model != "default":
            request = pb.ModelOptions(Model=model, Options=list(options))
            assert server.stub.LoadModel(request).success
        yield server
    finally:
        server.stop()


@contextmanager
def running_server(
    env: dict | None = None, options: tuple[str, ...] = (), model: str = "default"
):
    """``running_process``'s stub."""
    with running_process(env, options, model) as server:
        yield server.stub


def cpu_part_skipped(device: str) -> str | None:
    """Why a Linux CPU part doesn't apply here, or None when it does."""
    if sys.platform != "linux":
        return "the Linux CPU path's part, not on Linux"
    if device != "CPU":
        return f"the Linux CPU path's part, and this runs on the {device}"
    return None


def git_commit() -> str:
    """The checkout's short commit hash, or "" outside a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def append_results(path: Path, header: str, parts: list[int], lines: list[str]) -> None:
    """Append a run's printed tables to ``path`` (RESULTS.md) as a dated section:
    the date (UTC), the commit and the machine's ``header``, then ``lines`` fenced."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ran = ", ".join(map(str, parts))
    which = "all" if parts == list(range(1, 15)) else ran
    tables = "\n".join(line.rstrip() for line in lines).strip("\n")
    section = [
        "",
        f"## {date}, commit {git_commit() or 'unknown'}",
        "",
        header,
        "",
        f"Parts run: {which}.",
        "",
        "```",
        tables,
        "```",
        "",
    ]
    with path.open("a") as results:
        results.write("\n".join(section))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cpu-rounds", type=int, default=2)
    parser.add_argument("--cache-rounds", type=int, default=3)
    parser.add_argument("--batch-rounds", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--prefix-rounds", type=int, default=1)
    parser.add_argument("--speculative-rounds", type=int, default=5)
    parser.add_argument("--memory-rounds", type=int, default=2)
    parser.add_argument("--memory-tokens", type=int, default=48)
    parser.add_argument("--format-rounds", type=int, default=3)
    parser.add_argument("--distributed-rounds", type=int, default=1)
    parser.add_argument("--distributed-tokens", type=int, default=32)
    parser.add_argument("--families-rounds", type=int, default=1)
    parser.add_argument("--admission-rounds", type=int, default=2)
    parser.add_argument(
        "--admission-runs",
        type=int,
        default=LONG_RUNS,
        help="part 11's runs of the long-prompt scenario on the backend",
    )
    parser.add_argument("--kernel-rounds", type=int, default=2)
    parser.add_argument("--step-rounds", type=int, default=3)
    parser.add_argument("--rerank-rounds", type=int, default=2)
    parser.add_argument("--fine-tune-rounds", type=int, default=2)
    parser.add_argument(
        "--one-pass-runs",
        type=int,
        default=3,
        help="part 16's runs of the long-prompt scenario on each side",
    )
    parser.add_argument(
        "--one-pass-seconds",
        type=float,
        default=180.0,
        help="how long part 16's arrival clients send requests on each side",
    )
    parser.add_argument(
        "--one-pass-options",
        default="",
        help="part 16: more LoadModel options for the paged side, comma-separated "
        "(kv_dtype:float16)",
    )
    parser.add_argument(
        "--speculative-options",
        default="",
        help="part 6: more LoadModel options for both servers, comma-separated "
        "(paged:true)",
    )
    parser.add_argument(
        "--admission-flood-tokens",
        type=int,
        default=FLOOD_TOKENS,
        help="part 11's flood prompt length in tokens (issue 39 asks for 2000)",
    )
    parser.add_argument(
        "--parts",
        type=lambda text: {int(part) for part in text.split(",")},
        default=set(range(1, 17)),
        help="the parts to run, e.g. 1,4 (default: all)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "core.json"))
    parser.add_argument(
        "--no-results",
        action="store_true",
        help="don't append the printed tables to bench/RESULTS.md",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    device = device_description()
    skipped = {
        part: reason
        for part in sorted(args.parts & CPU_PARTS)
        if (reason := cpu_part_skipped(device))
    }
    parts = args.parts - skipped.keys()
    # The library side runs on the same compute path as the server.
    maybe_reexec_with_preloads()
    fast_library = fast_blas_in_use(os.environ)

    report, lines = {}, []
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        fast = stack.enter_context(running_server())
        header = machine_header(fast.Status(pb.HealthMessage()).memory.breakdown)
        lines += [f"{part}. skipped: {reason}" for part, reason in skipped.items()]
        if 1 in parts:
            # Part 1's servers: the default decoder (paged on the CPU), and the
            # batch decoder paced and not (pacing is the CPU's and the batch
            # decoder's); without speculation, which stream_generate does not do
            # either (part 6).
            modes = ("auto", "on", "off") if device == "CPU" else ("auto",)
            with ExitStack() as pinned:
                servers = {
                    mode: pinned.enter_context(
                        running_process(
                            options=(
                                f"cpu_pacing:{mode}",
                                "speculative:off",
                                *(("paged:false",) if mode != "auto" else ()),
                            )
                        )
                    )
                    for mode in modes
                }
                report["overhead"], part = bench_overhead(
                    servers, args.rounds, args.tokens
                )
            lines += part
        if 2 in parts:
            # The stock path, OpenBLAS where "auto" picked MKL, and the fast path.
            stubs = {}
            for name, choice in (("stock", "off"), ("openblas", "openblas")):
                library = find_fast_blas(choice) if choice != "off" else None
                if choice == "off" or library not in (None, fast_library):
                    env = blas_choice_environment(os.environ, choice)
                    stubs[name] = stack.enter_context(running_server(env))
            # The fast path on glibc's malloc, where jemalloc is preloaded.
            if allocator_in_use(os.environ):
                env = without_preload(os.environ, ALLOCATOR_ENV, "off")
                stubs["glibc malloc"] = stack.enter_context(running_server(env))
            stubs["fast"] = fast
            report["cpu_paths"], part = bench_cpu_paths(
                stubs, args.cpu_rounds, args.tokens
            )
            lines += [""] + part
        if 3 in parts:
            report["prompt_cache"], part = bench_prompt_cache(fast, args.cache_rounds)
            lines += [""] + part
        # mlx_lm.server gets the weights in float32 where this backend runs on a
        # CPU (its fastest path there: MLX's quantized CPU kernel is slower).
        breakdown = fast.Status(pb.HealthMessage()).memory.breakdown
        dequantize = breakdown["dequantized_weights"] > 0 or breakdown["cpu_kernels"]
        exported = export_mlx_folder(
            default_model_path(), Path(folder) / "mlx", dequantize=dequantize
        )
        if 4 in parts:
            report["batching"], part = bench_batching(
                fast,
                str(exported),
                folder,
                args.batch_rounds,
                args.batch_tokens,
                Path(args.out).parent / "batching.png",
            )
            lines += [""] + part
        if 5 in parts:
            no_sharing = stack.enter_context(
                running_server(options=("prefix_sharing:false",))
            )
            report["prefix"], part = bench_prefix(
                fast, no_sharing, str(exported), folder, args.prefix_rounds
            )
            lines += [""] + part
        if 6 in parts:
            # Two fresh servers, so neither carries the earlier parts' state.
            more = tuple(o for o in args.speculative_options.split(",") if o)
            speculating = stack.enter_context(running_server(options=more))
            plain = stack.enter_context(
                running_server(options=("speculative:off", *more))
            )
            report["speculative"], part = bench_speculative(
                speculating, plain, str(exported), folder, args.speculative_rounds
            )
            lines += [""] + part
        if 9 in parts:
            report["chat_formats"], part = bench_chat_formats(
                stack.enter_context(running_server()),
                folder,
                args.format_rounds,
                args.tokens,
            )
            lines += [""] + part
        if 8 in parts:
            fresh = stack.enter_context(running_server())
            report["memory"], part = bench_memory(
                fresh, running_server, args.memory_rounds, args.memory_tokens
            )
            lines += [""] + part
        if 10 in parts:
            report["model_families"], part = bench_model_families(
                running_server, folder, args.families_rounds
            )
            lines += [""] + part
        if 14 in parts:
            report["rerank"], part = bench_rerank(running_server, args.rerank_rounds)
            lines += [""] + part
        if 11 in parts:
            report["admission"], part = bench_admission(
                fast,
                running_process,
                str(exported),
                folder,
                args.admission_rounds,
                args.batch_tokens,
                args.admission_flood_tokens,
                args.admission_runs,
            )
            lines += [""] + part
        if 15 in parts:
            report["fine_tune"], part = bench_fine_tune(
                running_server, exported, args.fine_tune_rounds
            )
            lines += [""] + part
    if 16 in parts:
        # Its two servers alone, after the other parts' are gone.
        with tempfile.TemporaryDirectory() as folder:
            exported = export_mlx_folder(default_model_path(), Path(folder))
            report["one_pass"], part = bench_one_pass(
                running_process,
                exported,
                args.one_pass_runs,
                args.one_pass_seconds,
                tuple(o for o in args.one_pass_options.split(",") if o),
            )
        lines += [""] + part
    if 12 in parts:
        # After the other parts' servers are gone: its servers run one at a time.
        report["cpu_kernels"], part = bench_cpu_kernels(
            running_process, args.kernel_rounds, args.tokens, args.batch_tokens
        )
        lines += [""] + part
    if 13 in parts:
        # Its two servers alone, after the other parts' are gone.
        report["cpu_step"], part = bench_cpu_step(
            running_process, args.step_rounds, args.tokens, args.batch_tokens
        )
        lines += [""] + part
    if 7 in parts:
        # After the other parts' servers are gone: each rank wants the cores.
        report["distributed"], part = bench_distributed(
            args.distributed_rounds, args.distributed_tokens
        )
        lines += [""] + part

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    sys.stdout.write("\n".join(lines) + f"\nwritten to {out}\n")
    if not args.no_results:
        append_results(RESULTS, header, sorted(parts), lines)
        sys.stdout.write(f"appended to {RESULTS}\n")


if __name__ == "__main__":
    main()
