"""Part 15 of ``make bench``: fine-tuning. SFT LoRA of rank 8 on every linear layer
of the embedded model, three ways on the same data and settings: through the
backend's RPCs (StartFineTune, then FineTuneProgress to the end), mlx-lm's own
``mlx_lm lora`` on the same weights as an MLX folder, and LocalAI's ``trl`` path
(transformers, peft and trl, in a virtual environment of their own under
bench-results/, installed on first use from bench/trl-requirements.txt) on the same
weights as a Hugging Face folder. Training tokens per second from the second step
on, the job's seconds from start to end, and peak memory (MLX's allocator peak
where MLX trains, and the training process's peak RSS). Rounds rotate the order of
the sides.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import backend_pb2 as pb
from bench.overhead import LONG_TEXT
from mlx_backend.cpu.blas import blas_choice_environment
from mlx_backend.models.gguf import export_mlx_folder
from mlx_backend.models.loading import default_model_path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE.parent / "bench-results" / "trl-venv"
TRL_REQUIREMENTS = HERE / "trl-requirements.txt"
EXAMPLES = 32
WORDS = 96
STEPS = 12
BATCH = 4
RANK = 8
ALPHA = 160  # mlx-lm's scale of 20
RATE = 1e-4
SIDES = ("service", "mlx_lm.lora", "trl")


def make_dataset(folder: Path) -> Path:
    """32 training and 4 validation texts of about 120 tokens each."""
    words = LONG_TEXT.split()
    texts = [
        " ".join(words[(13 * i + j) % len(words)] for j in range(WORDS))
        for i in range(EXAMPLES + BATCH)
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", texts[:EXAMPLES]), ("valid", texts[EXAMPLES:])):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in part)
        (folder / f"{name}.jsonl").write_text(lines)
    return folder


def steady_rate(reports: list[dict]) -> float:
    """Tokens per second over the reports after the first (mlx-lm's tuner reports
    each step's tokens per second and the running count of trained tokens)."""
    tokens = seconds = 0.0
    for before, report in zip(reports, reports[1:]):
        step_tokens = report["trained_tokens"] - before["trained_tokens"]
        tokens += step_tokens
        seconds += step_tokens / report["tokens_per_second"]
    return tokens / seconds


def run_service(stub, data: Path, output: Path) -> dict:
    began = time.perf_counter()
    request = pb.FineTuneRequest(
        training_type="lora",
        training_method="sft",
        adapter_rank=RANK,
        adapter_alpha=ALPHA,
        learning_rate=RATE,
        batch_size=BATCH,
        max_steps=STEPS,
        dataset_source=str(data),
        output_dir=str(output),
    )
    job = stub.StartFineTune(request).job_id
    updates = list(stub.FineTuneProgress(pb.FineTuneProgressRequest(job_id=job)))
    seconds = time.perf_counter() - began
    if updates[-1].status != "completed":
        raise RuntimeError(f"the service's job ended {updates[-1].status}")
    reports = [dict(u.extra_metrics) for u in updates if u.status == "training"]
    return {
        "tokens_per_second": steady_rate(reports),
        "seconds": seconds,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in reports),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in reports),
    }


def run_mlx_lm(folder: Path, data: Path, output: Path) -> dict:
    reports = output / "reports.jsonl"
    output.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "bench.fine_tune_mlx_lm",
        str(reports),
        "--",
        *("--model", str(folder), "--train", "--data", str(data)),
        *("--fine-tune-type", "lora", "--num-layers", "-1"),
        *("--batch-size", str(BATCH), "--iters", str(STEPS)),
        *("--learning-rate", str(RATE), "--steps-per-report", "1"),
        *("--adapter-path", str(output / "adapter"), "--seed", "0"),
    ]
    began = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=HERE.parent)
    seconds = time.perf_counter() - began
    lines = [json.loads(line) for line in reports.read_text().splitlines()]
    return {
        "tokens_per_second": steady_rate(lines),
        "seconds": seconds,
        "peak_memory_gb": max(r["peak_memory"] for r in lines),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in lines),
    }


def trl_python() -> tuple[Path | None, str]:
    """The trl environment's Python, made on first use; or why there is none."""
    python = TRL_VENV / "bin" / "python"
    done = TRL_VENV / ".installed"
    if done.is_file() and done.read_text() == TRL_REQUIREMENTS.read_text():
        return python, ""
    shutil.rmtree(TRL_VENV, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(TRL_VENV)],
        [str(python), "-m", "pip", "install", "-q", "-r", str(TRL_REQUIREMENTS)],
    )
    for command in steps:
        done_step = subprocess.run(command, capture_output=True, text=True)
        if done_step.returncode:
            tail = (done_step.stderr.strip().splitlines() or ["no message"])[-1]
            return None, f"torch, transformers, peft and trl did not install: {tail}"
    done.write_text(TRL_REQUIREMENTS.read_text())
    return python, ""


def hf_folder(mlx_folder: Path, out: Path) -> Path:
    """The MLX folder as a Hugging Face llama folder: q and k un-permuted from
    GGUF's layout (the MLX folder runs them with traditional RoPE)."""
    out.mkdir(parents=True)
    config = json.loads((mlx_folder / "config.json").read_text())
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }
    weights = mx.load(str(mlx_folder / "model.safetensors"))
    for name, w in weights.items():
        for proj, n in heads.items():
            if name.endswith(f"self_attn.{proj}.weight"):
                rows = w.shape[0]
                w = w.reshape(n, rows // n // 2, 2, -1).swapaxes(1, 2)
                weights[name] = w.reshape(rows, -1)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    config.pop("rope_traditional", None)
    config.pop("quantization", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(mlx_folder / name, out / name)
    return out


def run_trl(python: Path, folder: Path, data: Path) -> dict:
    # torch brings its own BLAS: the MLX sides' preloaded one stays out (their
    # malloc stays, as for any process on this host).
    env = blas_choice_environment(os.environ, "off")
    command = [
        str(python),
        # -P: bench/ off sys.path, where its profile.py would hide the standard one.
        "-P",
        str(HERE / "fine_tune_trl.py"),
        *(str(folder), str(data / "train.jsonl"), str(STEPS), str(BATCH)),
        *(str(RANK), str(ALPHA), str(RATE)),
    ]
    done = subprocess.run(
        command, check=True, capture_output=True, text=True, env=env, cwd=data
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(values: list[float], fmt: str) -> str:
    return ", ".join(format(v, fmt) for v in values)


def bench_fine_tune(
    running_server, mlx_folder: Path, rounds: int
) -> tuple[dict, list[str]]:
    """``mlx_folder``: the embedded model as the service trains it (float32 on the
    CPU, quantized on a GPU), for mlx_lm lora."""
    python, why = trl_python()
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as scratch, running_server(model="mlx") as stub:
        scratch = Path(scratch)
        data = make_dataset(scratch / "data")
        hf = None
        if python:
            weights = export_mlx_folder(
                default_model_path(), scratch / "float32", dequantize=True
            )
            hf = hf_folder(weights, scratch / "hf")
        for r in range(rounds):
            order = SIDES[r % 3 :] + SIDES[: r % 3]
            for side in order:
                out = scratch / f"{side}-{r}"
                if side == "service":
                    runs[side].append(run_service(stub, data, out))
                elif side == "mlx_lm.lora":
                    runs[side].append(run_mlx_lm(mlx_folder, data, out))
                elif python:
                    runs[side].append(run_trl(python, hf, data))
    rates = {s: [run["tokens_per_second"] for run in runs[s]] for s in SIDES}
    lines = [
        f"15. Fine-tuning (bench/fine_tune.py): SFT LoRA rank {RANK} (alpha {ALPHA}) on "
        f"every linear layer of the embedded model, batch {BATCH}, {STEPS} steps, "
        f"{EXAMPLES} texts of {WORDS} words; tokens/s from step 2 on, per round",
        "",
        "| side | tokens/s | worst | job seconds | peak MLX memory GB | peak RSS GB |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "service": "StartFineTune (this backend)",
        "mlx_lm.lora": "mlx_lm lora (the same weights, an MLX folder)",
        "trl": "LocalAI's trl path (torch, peft, trl)",
    }
    for side in SIDES:
        if not runs[side]:
            lines.append(f"| {names[side]} | missing: {why} | | | | |")
            continue
        memory = [run.get("peak_memory_gb") for run in runs[side]]
        lines.append(
            f"| {names[side]} | {_cell(rates[side], '.0f')} | {min(rates[side]):.0f} | "
            f"{_cell([run['seconds'] for run in runs[side]], '.1f')} | "
            + (_cell(memory, ".2f") if None not in memory else "n/a (torch)")
            + f" | {_cell([run['peak_rss_gb'] for run in runs[side]], '.2f')} |"
        )
    report = {"runs": runs, "trl_missing": why}
    for other, goal in (("mlx_lm.lora", "goal >= 0.95"), ("trl", "goal > 1")):
        if not runs[other]:
            continue
        ratios = [a / b for a, b in zip(rates["service"], rates[other])]
        report[f"service_over_{other}"] = ratios
        lines.append(
            f"service / {other} tokens/s per round: {_cell(ratios, '.2f')}; "
            f"worst {min(ratios):.2f} ({goal})"
        )
    return report, lines
