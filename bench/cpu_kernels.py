"""Part 12 of ``make bench`` (Linux CPU): the SIMD quantized-matmul kernels
(mlx_backend/cpu/kernels) against the float32 path they replace and MLX's own
quantized_matmul, each on its own server over the same Q4_1 weights: decode tok/s
at 1, 8 and 16 streams, prefill tok/s on a 1000-token prompt, peak RSS and the
weight bytes a decode step reads. Then a random-weight 1B-class 4-bit llama built
from mlx-lm's class, in-process: decode on the kernels against MLX's kernel.
"""

import logging
import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_logits_processors

import backend_pb2 as pb
from bench.batching import grpc_stream, run_level
from bench.cpu_paths import long_prompt, server_prefill
from bench.overhead import median_of, server_decode
from mlx_backend.cpu.kernels import kernel_settings, load_kernels, use_kernels
from mlx_backend.models.loading import default_model_path, load_model
from tests.support import rss_kib

logger = logging.getLogger(__name__)

MIB = 2**20
STREAMS = (8, 16)
# The paths, as LoadModel options and environment, in the order they run.
PATHS = {
    "kernels": (("kernel_activations:float32",), {}),
    "kernels_int16": (("kernel_activations:int16",), {}),
    "kernels_int8": (("kernel_activations:int8",), {}),
    "float32": (("dequantize:true",), {}),
    "mlx_quantized": (("dequantize:false",), {"MLX_BACKEND_CPU_KERNELS": "off"}),
}
LABELS = {
    "kernels": "kernels (float32 x)",
    "kernels_int16": "kernels, int16 x",
    "kernels_int8": "kernels, int8 x",
    "float32": "float32 (before)",
    "mlx_quantized": "MLX quantized",
}
# The 1B-class llama: Llama 3.2 1B's shape.
BIG_LLAMA = dict(
    model_type="llama",
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    vocab_size=32000,
    tie_word_embeddings=True,
)


def bench_server_paths(
    running_process, rounds: int, tokens: int, batch_tokens: int
) -> dict:
    """Each path on its own server, one after another (they would share the
    cores): prefill, 1-stream decode and 8 and 16 streams, over ``rounds``."""
    eos = 2
    results = {}
    for name, (options, env) in PATHS.items():
        environment = {**os.environ, **env} if env else None
        with running_process(environment, options) as server:
            stub = server.stub
            # What the loaded model holds, before any request: its weights.
            loaded = stub.Status(pb.HealthMessage()).memory.breakdown["active"]
            loaded_rss = rss_kib(server.process.pid) or 0
            server_decode(stub, 8, eos)  # warm
            runs = {"prefill": [], "decode": [], **{n: [] for n in STREAMS}}
            # MLX's own kernel is several times slower: fewer tokens, one round.
            slow = name == "mlx_quantized"
            for i in range(1 if slow else rounds):
                logger.info("cpu kernels: %s, round %d", name, i + 1)
                runs["prefill"].append(server_prefill(stub, long_prompt(stub, i)))
                share = 4 if slow else 1
                runs["decode"].append(server_decode(stub, tokens // share, eos))
                for n in STREAMS:
                    runs[n].append(
                        run_level(
                            lambda p: grpc_stream(stub, p, batch_tokens // share, eos),
                            n,
                            i,
                        )
                    )
            breakdown = stub.Status(pb.HealthMessage()).memory.breakdown
            results[name] = {
                "prefill_tps": median_of(runs["prefill"], "prefill_tps"),
                "decode_tps": median_of(runs["decode"], "decode_tps"),
                **{
                    f"streams_{n}_tps": statistics.median(
                        r["throughput_tps"] for r in runs[n]
                    )
                    for n in STREAMS
                },
                "peak_rss_mib": (rss_kib(server.process.pid, "VmHWM") or 0) / 1024,
                "mlx_peak_mib": breakdown["peak"] / MIB,
                "loaded_mib": loaded / MIB,
                "loaded_rss_mib": loaded_rss / 1024,
                "breakdown": dict(breakdown),
            }
    return results


def quantized_weight_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def make_big_llama() -> nn.Module:
    model = llama.Model(llama.ModelArgs.from_dict(BIG_LLAMA))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def library_tps(model, tokens: int) -> float:
    """Greedy decode tok/s after the first token, in-process."""
    prompt = mx.array(list(range(100, 132)))
    processors = make_logits_processors(logit_bias={0: -1e9})
    first, n = None, 0
    for n, _ in enumerate(
        generate_step(prompt, model, max_tokens=tokens, logits_processors=processors),
        start=1,
    ):
        if first is None:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first) if n > 1 else float("nan")


def bench_big_llama(tokens: int) -> dict:
    """Decode tok/s of the random 1B-class 4-bit llama on MLX's kernel, then on ours."""
    model = make_big_llama()
    size = quantized_weight_bytes(model)
    mlx_tps = library_tps(model, max(4, tokens // 8))
    use_kernels(model)
    ours = [library_tps(model, tokens) for _ in range(2)]
    return {
        "weights_mib": size / MIB,
        "mlx_quantized_tps": mlx_tps,
        "kernels_tps": max(ours),
    }


def bench_cpu_kernels(
    running_process, rounds: int, tokens: int, batch_tokens: int
) -> tuple[dict, list[str]]:
    qmm, why = load_kernels()
    if qmm is None:
        return {"skipped": why}, [f"12. CPU kernels: skipped ({why})"]
    settings = kernel_settings()
    stored = quantized_weight_bytes(load_model(str(default_model_path())).model)
    paths = bench_server_paths(running_process, rounds, tokens, batch_tokens)
    big = bench_big_llama(tokens // 4)
    base = paths["float32"]
    weights = base["breakdown"]["dequantized_weights"]
    lines = [
        f"12. CPU kernels ({settings.isa}; AVX-512, VNNI and NEON untested here): "
        f"decode {tokens} tokens (MLX quantized: {tokens // 4}), {batch_tokens} per "
        f"stream at 8 and 16 streams, prefill 1000 tokens; median of {rounds} rounds",
        f"{'path':<18}{'prefill':>9}{'1 stream':>10}{'8 streams':>11}"
        f"{'16 streams':>12}{'loaded MiB':>12}{'RSS then':>10}{'peak RSS':>10}"
        f"{'MLX peak':>10}",
    ]
    for name, r in paths.items():
        lines.append(
            f"{LABELS[name]:<18}{r['prefill_tps']:>9.1f}{r['decode_tps']:>10.1f}"
            f"{r['streams_8_tps']:>11.1f}{r['streams_16_tps']:>12.1f}"
            f"{r['loaded_mib']:>12.0f}{r['loaded_rss_mib']:>10.0f}"
            f"{r['peak_rss_mib']:>10.0f}{r['mlx_peak_mib']:>10.0f}"
        )
    ours = paths["kernels"]
    lines += [
        "kernels / float32: "
        + ", ".join(
            f"{label} {ours[key] / base[key]:.2f}x"
            for label, key in (
                ("1 stream", "decode_tps"),
                ("8 streams", "streams_8_tps"),
                ("16 streams", "streams_16_tps"),
                ("prefill", "prefill_tps"),
            )
        ),
        f"weight bytes per decode step: float32 {weights / MIB:.0f} MiB, "
        f"kernels {stored / MIB:.0f} MiB (Q4_1 as stored); the loaded model (MLX's "
        f"active memory before any request) / stored weights: kernels "
        f"{ours['loaded_mib'] * MIB / stored:.2f}x, float32 "
        f"{base['loaded_mib'] * MIB / stored:.2f}x (MiB columns: MLX's active memory "
        f"once loaded, the process's RSS then, its peak RSS and MLX's peak)",
        f"1B-class random 4-bit llama ({big['weights_mib']:.0f} MiB): kernels "
        f"{big['kernels_tps']:.2f} tok/s, MLX quantized {big['mlx_quantized_tps']:.2f} "
        f"tok/s: {big['kernels_tps'] / big['mlx_quantized_tps']:.1f}x",
    ]
    return {"paths": paths, "big_llama": big, "settings": settings.__dict__}, lines
