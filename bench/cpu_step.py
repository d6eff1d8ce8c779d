"""Part 13 of ``make bench`` (Linux CPU): decode and prefill on the SIMD kernels
with float32 activations and with int8 ones, beside llama.cpp and ik_llama.cpp
on the same GGUF and threads (``bench/llama_cpp.py``, ``bench/ik_llama.py``), in
alternating rounds. Columns: decode tok/s in-process and through a server at 1,
8 and 16 streams, prefill of 512 and 4096 tokens, the linears' GB/s (a decode
step's quantized products alone, back to back), and the int8 side's mean KL
divergence and perplexity change from float32 over a fixed text of 2,048 tokens,
read in chunks of 256 (a server's prefill: the int8 GEMM) and of 16 (the row
kernels). The header names the CPU and its instruction sets.
"""

import logging
import math
import re
import time
from pathlib import Path
from pydoc_data.topics import topics

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench import ik_llama, llama_cpp
from bench.batching import grpc_stream, run_level
from bench.cpu_kernels import library_tps
from bench.cpu_paths import long_prompt, server_prefill
from bench.overhead import server_decode
from mlx_backend.cpu.compute_path import prepare_for_cpu
from mlx_backend.cpu.kernels import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    KernelSiblingLinear,
    load_kernels,
    match_blas_threads,
    use_kernels,
)
from mlx_backend.cpu.kernels.decode_layers import route_decode_layers
from mlx_backend.cpu.kernels.fast_ops import route_fast_ops
from mlx_backend.models.loading import default_model_path, load_model

logger = logging.getLogger(__name__)

SIDES = ("float32", "int8")
REFERENCES = ("llama.cpp", "ik_llama.cpp")
STREAMS = (8, 16)
PROMPTS = {"pp512": 512, "pp4096": 4096}
KEYS = ("decode", "server", *STREAMS, *PROMPTS)
# About the tokens of the batch levels' chat prompts, for llama-batched-bench.
BATCH_PROMPT = 32
# The fixed text of the divergence columns: Python's own reference prose (the
# same text wherever this Python runs), cut to KL_TOKENS tokens.
KL_TOPICS = ("execmodel", "exceptions", "naming", "truth", "numbers", "typesseq")
KL_TOKENS = 2048
# A prompt's chunks (the GEMM, x per 8), a batch's 16 rows (the GEMM, per 8) and
# 3 rows (the row kernels, per 4: a decode row's rounding).
KL_CHUNKS = (256, 16, 3)


def cpu_flags() -> str:
    """The instruction sets this CPU reports that the kernels could use."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "neon")
    text = cpuinfo()
    found = set(re.findall(r"\b[\w]+\b", text.split("flags", 1)[-1].split("\n", 1)[0]))
    return ", ".join(flag for flag in wanted if flag in found) or "none of AVX2/NEON"


def cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    found = re.search(r"model name\s*:\s*(.+)", cpuinfo())
    return found.group(1).strip() if found else "unknown CPU"


def kl_ids(tokenizer) -> list[int]:
    """KL_TOKENS tokens of the fixed text."""
    ids = []
    for name in KL_TOPICS:
        ids += tokenizer.encode(topics[name] + "\n\n")
        if len(ids) >= KL_TOKENS:
            return ids[:KL_TOKENS]
    raise ValueError(f"the KL text has {len(ids)} tokens, fewer than {KL_TOKENS}")


def next_token_logprobs(model, ids: list[int], chunk: int) -> np.ndarray:
    """Each position's next-token log-probabilities, the text read ``chunk``
    tokens a pass."""
    cache, rows = make_prompt_cache(model), []
    for i in range(0, len(ids), chunk):
        logits = model(mx.array(ids[i : i + chunk])[None], cache=cache)[0]
        rows.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(rows[-1])
    return np.array(mx.concatenate(rows))


def divergence(model, qmm, ids: list[int], chunk: int) -> dict:
    """int8's mean KL divergence from float32's next-token distributions, and
    its perplexity over float32's, minus one."""
    logprobs = {}
    for name in SIDES:
        qmm.set_activations(name)
        logprobs[name] = next_token_logprobs(model, ids, chunk)
    exact, rounded = logprobs["float32"], logprobs["int8"]
    kl = (np.exp(exact) * (exact - rounded)).sum(axis=-1)[:-1]
    taken = np.arange(len(ids) - 1), np.array(ids[1:])
    nll = [-x[:-1][taken].mean() for x in (exact, rounded)]
    return {"kl": float(kl.mean()), "ppl": math.exp(nll[1] - nll[0]) - 1}


def decode_products(model) -> tuple[list, int]:
    """Thunks of a decode step's quantized products (siblings in one call, as
    the model runs them) on one row of x, and the bytes they read."""
    products, nbytes = [], 0
    for _, module in model.named_modules():
        if isinstance(module, KernelSiblingLinear):
            if module.sibling_index:
                continue
            layers = module.shared_input.layers
        elif isinstance(module, (KernelQuantizedLinear, KernelQuantizedEmbedding)):
            layers = [module]
        else:
            continue
        first = layers[0]
        x = mx.random.normal((1, first["weight"].shape[1] * 32 // first.bits))
        parts = [[m[k] for m in layers] for k in ("weight", "scales", "biases")]
        nbytes += sum(a.nbytes for group in parts for a in group)
        products.append((x, parts, first.group_size, first.bits))
    return products, nbytes


def linears_gbps(qmm, products, nbytes: int, repeats: int = 20) -> float:
    """The products back to back in one evaluation, at their best of
    ``repeats``: the bytes they read over the time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([qmm.quantized_matmuls(x, *parts, g, b) for x, parts, g, b in products])
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def bench_in_process(qmm, rounds: int, tokens: int) -> dict:
    loaded = load_model(str(default_model_path()))
    mx.eval(loaded.model.parameters())
    model, _ = prepare_for_cpu(loaded.model, None, None)
    use_kernels(model)
    match_blas_threads(0)
    route_fast_ops()
    route_decode_layers(model)
    products, nbytes = decode_products(model)
    mx.eval([x for x, *_ in products])
    runs = {name: {"decode": [], "gbps": []} for name in SIDES}
    runs["bandwidth"] = []
    for i in range(rounds):
        runs["bandwidth"].append(qmm.read_bandwidth())
        for name in SIDES:
            logger.info("cpu step: in-process, %s, round %d", name, i + 1)
            qmm.set_activations(name)
            runs[name]["gbps"].append(linears_gbps(qmm, products, nbytes))
            runs[name]["decode"].append(library_tps(model, tokens))
    ids = kl_ids(loaded.tokenizer)
    runs["divergence"] = {c: divergence(model, qmm, ids, c) for c in KL_CHUNKS}
    runs["linear_mb"] = nbytes / 1e6
    qmm.set_activations("float32")
    return runs


def bench_servers(
    running_process, rounds: int, tokens: int, batch_tokens: int, references: dict
) -> dict:
    """The two servers' figures, and the references' (their tools) after them in
    each round."""
    eos = 2
    runs = {name: {key: [] for key in KEYS} for name in SIDES + tuple(references)}
    options = {name: (f"kernel_activations:{name}",) for name in SIDES}
    with running_process(options=options["float32"]) as plain, running_process(
        options=options["int8"]
    ) as rounded:
        servers = {"float32": plain.stub, "int8": rounded.stub}
        for stub in servers.values():
            server_decode(stub, 8, eos)  # warm
        for i in range(rounds):
            for name in SIDES:
                logger.info("cpu step: server, %s, round %d", name, i + 1)
                stub, r = servers[name], runs[name]
                for key, length in PROMPTS.items():
                    prompt = long_prompt(stub, 2 * i + (name == "int8"), length)
                    r[key].append(server_prefill(stub, prompt)["prefill_tps"])
                r["server"].append(server_decode(stub, tokens, eos)["decode_tps"])
                for n in STREAMS:
                    level = run_level(
                        lambda p: grpc_stream(stub, p, batch_tokens, eos), n, i
                    )
                    r[n].append(level["throughput_tps"])
            for name, tools in references.items():
                logger.info("cpu step: %s, round %d", name, i + 1)
                r = runs[name]
                for key, length in PROMPTS.items():
                    r[key].append(tools.bench(length, 0))
                r["decode"].append(tools.bench(0, tokens))
                for n in STREAMS:
                    r[n].append(tools.batched(n, BATCH_PROMPT, batch_tokens))
    return runs


def worst(values) -> float:
    return min(values) if values else float("nan")


def bench_cpu_step(
    running_process, rounds: int, tokens: int, batch_tokens: int
) -> tuple[dict, list[str]]:
    qmm, why = load_kernels()
    if qmm is None:
        return {"skipped": why}, [f"13. CPU decode and prefill: skipped ({why})"]
    model_path, threads = str(default_model_path()), qmm.settings()["threads"]
    references, skipped = {}, {}
    for name, module in (("llama.cpp", llama_cpp), ("ik_llama.cpp", ik_llama)):
        tools = module.build(model_path, threads)
        if isinstance(tools, str):
            skipped[name] = tools
            logger.warning("cpu step: no %s row: %s", name, tools)
        else:
            references[name] = tools
    library = bench_in_process(qmm, rounds, tokens)
    servers = bench_servers(running_process, rounds, tokens, batch_tokens, references)
    for name in SIDES:
        servers[name].update(library[name])
    report = {
        "runs": servers,
        "divergence": library["divergence"],
        "read_bandwidth": library["bandwidth"],
    }

    def cells(values: list, fmt: str = "{:.1f}") -> str:
        return " / ".join(fmt.format(v) for v in values) if values else ""

    columns = ("decode", "server", *STREAMS, *PROMPTS)
    header = (
        "| | decode in-process | server, 1 stream | 8 streams | 16 streams | pp512"
        " | pp4096 | linears GB/s | mean KL | Δ perplexity |"
    )
    rows = []
    for name in SIDES + tuple(references):
        r = servers[name]
        row = [name, *(cells(r[key], "{:.0f}" if key in PROMPTS else "{:.1f}")
                       for key in columns)]  # fmt: skip
        row.append(cells(r.get("gbps", []), "{:.1f}"))
        if name == "int8":
            div = library["divergence"]
            row.append(" / ".join(f"{div[c]['kl']:.5f}" for c in KL_CHUNKS))
            row.append(" / ".join(f"{100 * div[c]['ppl']:+.2f}%" for c in KL_CHUNKS))
        else:
            row += ["", ""]
        rows.append("| " + " | ".join(row) + " |")
    ratios = {}
    for over in ("float32", *references):
        key = f"int8 / {over}"
        ratios[key] = {
            c: worst(servers["int8"][c]) / worst(servers[over][c])
            for c in columns
            if servers[over][c] and servers["int8"][c]
        }
        cells_ = [f"{ratios[key][c]:.2f}x" if c in ratios[key] else "" for c in columns]
        rows.append("| " + " | ".join([key, *cells_, "", "", ""]) + " |")
    report["ratios"] = ratios
    settings = qmm.settings()
    lines = [
        "13. CPU decode and prefill (bench/cpu_step.py): the kernels with float32"
        " and int8 activations, llama.cpp and ik_llama.cpp",
        f"    {cpu_name()}; instruction sets: {cpu_flags()}; int8 kernels"
        f" {settings['isa']}, {threads} threads; every run listed (rounds alternate);"
        " ratios are of the worst runs",
        f"    llama.cpp ({llama_cpp.SDIST}) and ik_llama.cpp (its repository's"
        f" snapshot) on the same GGUF and threads: llama-bench tg{tokens} and"
        f" pp512 / pp4096, llama-batched-bench at {BATCH_PROMPT}-token prompts and"
        f" {batch_tokens} tokens a stream, prefill included (as the servers' levels)",
        *(f"    {name}: skipped ({why})" for name, why in skipped.items()),
        f"    linears: a decode step's {library['linear_mb']:.1f} MB of quantized"
        f" products back to back, against the kernels' threads reading memory at"
        f" {cells(library['bandwidth'])} GB/s (qmm.read_bandwidth); KL and perplexity: int8 against float32 over"
        f" {KL_TOKENS} tokens of Python's reference prose, in chunks of "
        + " / ".join(str(c) for c in KL_CHUNKS),
        "",
        header,
        "|---" * (header.count("|") - 1) + "|",
        *rows,
    ]
    return report, lines
