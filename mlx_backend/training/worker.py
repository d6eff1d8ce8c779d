"""The training worker: a process of its own that trains one ``FineTunePlan`` with
mlx-lm's tuner, so that serving never waits for it and shares none of its MLX
objects.

It reads the plan as the first line of stdin, then commands (``stop``, ``stop
save``); stdin closing (the backend gone) stops it too. Progress goes out as JSON
lines on the file descriptor its argument names (mlx-lm's own progress display
writes to stdout). Checkpoints are mlx-lm adapter folders, written whole under a
temporary name and renamed, so a killed job leaves every finished one readable.
"""

import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, train
from mlx_lm.tuner.utils import linear_to_lora_layers

from mlx_backend.cpu.compute_path import (
    dequantize_budget,
    float32_bytes,
    is_quantized,
)
from mlx_backend.cpu.kernels.fast_ops import route_training_ops
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.loading import load_model
from mlx_backend.refusals import describe_error
from mlx_backend.training.footprint import check_fits, estimate
from mlx_backend.training.plan import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINT_PREFIX,
    STATE_FILE,
    FineTunePlan,
)
from mlx_backend.training.preference import (
    batch_width,
    encode_pair,
    iterate_pairs,
    make_preference_loss,
    with_reference,
)
from mlx_utils import dequantize_to_float32

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """One ``FineTuneProgressUpdate``'s fields, as the worker knows them."""

    status: str
    current_step: int = 0
    total_steps: int = 0
    current_epoch: float = 0.0
    total_epochs: float = 0.0
    loss: float = 0.0
    learning_rate: float = 0.0
    eval_loss: float = 0.0
    eta_seconds: float = 0.0
    progress_percent: float = 0.0
    message: str = ""
    checkpoint_path: str = ""
    extra_metrics: dict[str, float] = field(default_factory=dict)


class Stopped(Exception):
    """A stop command arrived."""


class Commands:
    """The backend's commands on stdin, read on a thread of their own."""

    def __init__(self, stream):
        self.stop = False
        self.save = False
        thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            words = line.split()
            if words[:1] == ["stop"]:
                self.save = self.save or words[1:] == ["save"]
                self.stop = True
        self.stop = True  # the backend is gone


class Reporter(TrainingCallback):
    """mlx-lm's callbacks turned into progress lines, checkpoints every
    ``save_steps`` and a stop between steps."""

    def __init__(
        self,
        plan: FineTunePlan,
        out,
        commands: Commands,
        model,
        start: int,
        memory: int,
    ):
        self._plan = plan
        self._out = out
        self._commands = commands
        self._model = model
        self._start = start
        # The job's memory by its estimate, which serving's budget counts.
        self._memory = memory
        self._began = time.monotonic()
        self.last = Progress("training", start, plan.iters, total_epochs=plan.epochs)

    def on_train_loss_report(self, info: dict) -> None:
        plan = self._plan
        step = self._start + info["iteration"]
        done = step - self._start
        left = plan.iters - step
        seconds = time.monotonic() - self._began
        self.last = Progress(
            "training",
            current_step=step,
            total_steps=plan.iters,
            current_epoch=step * plan.batch_size / plan.train_examples,
            total_epochs=plan.epochs,
            loss=info["train_loss"],
            learning_rate=info["learning_rate"],
            eval_loss=self.last.eval_loss,
            eta_seconds=seconds / done * left if done else 0.0,
            progress_percent=100.0 * step / plan.iters,
            extra_metrics={
                "tokens_per_second": info["tokens_per_second"],
                "trained_tokens": float(info["trained_tokens"]),
                "peak_memory_gb": info["peak_memory"],
                "peak_rss_gb": peak_rss_bytes() / 1e9,
                "estimated_memory_gb": self._memory / 1e9,
            },
        )
        send(self._out, self.last)
        if step % plan.save_steps == 0 and step < plan.iters:
            self.checkpoint(step)
        if self._commands.stop:
            if self._commands.save and step % plan.save_steps:
                self.checkpoint(step)
            raise Stopped

    def on_val_loss_report(self, info: dict) -> None:
        self.last.eval_loss = info["val_loss"]

    def checkpoint(self, step: int) -> Path:
        path = save_checkpoint(self._plan, self._model, step, self.last)
        send(
            self._out,
            Progress(
                "saving",
                current_step=step,
                total_steps=self._plan.iters,
                current_epoch=self.last.current_epoch,
                total_epochs=self._plan.epochs,
                loss=self.last.loss,
                progress_percent=self.last.progress_percent,
                checkpoint_path=str(path),
            ),
        )
        return path


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux counts it in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def send(out, progress: Progress) -> None:
    out.write(json.dumps(asdict(progress)) + "\n")
    out.flush()


def adapter_config(plan: FineTunePlan, layers: int) -> dict:
    """The adapter_config.json that mlx_lm.lora writes, which LoraAdapters reads."""
    return {
        "fine_tune_type": plan.fine_tune_type,
        "num_layers": layers,
        "lora_parameters": {
            "rank": plan.rank,
            "scale": plan.scale,
            "dropout": plan.dropout,
            "keys": list(plan.keys) or None,
        },
        "model": plan.model or "default",
    }


def save_checkpoint(plan: FineTunePlan, model, step: int, last: Progress) -> Path:
    """``checkpoint-<step>``: the trainable weights, their config and the step's
    state, written under a temporary name and renamed whole."""
    final = Path(plan.output_dir) / f"{CHECKPOINT_PREFIX}{step}"
    partial = final.with_name(f".{final.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(partial / ADAPTER_WEIGHTS), weights)
    config = adapter_config(plan, len(model.layers))
    (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    state = {
        "step": step,
        "epoch": last.current_epoch,
        "loss": last.loss,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (partial / STATE_FILE).write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def _optimizer(plan: FineTunePlan) -> optim.Optimizer:
    rate = plan.learning_rate
    if plan.warmup_steps:
        warmup = optim.linear_schedule(
            rate / plan.warmup_steps, rate, plan.warmup_steps
        )
        rate = optim.join_schedules(
            [warmup, lambda _: plan.learning_rate], [plan.warmup_steps]
        )
    match plan.optimizer:
        case "adamw":
            return optim.AdamW(learning_rate=rate, weight_decay=plan.weight_decay)
        case "sgd":
            return optim.SGD(learning_rate=rate, weight_decay=plan.weight_decay)
        case "adafactor":
            return optim.Adafactor(learning_rate=rate)
        case "muon":
            return optim.Muon(learning_rate=rate, weight_decay=plan.weight_decay)
    return optim.Adam(learning_rate=rate)


def _dataset(path: str, tokenizer, plan: FineTunePlan):
    """The examples as mlx-lm's trainer takes them: tokenized texts for SFT, token
    pairs for the preference methods (each with answer tokens to train on)."""
    with open(path, encoding="utf-8") as lines:
        examples = [json.loads(line) for line in lines if line.strip()]
    if plan.method == "sft":
        config = SimpleNamespace(mask_prompt=plan.mask_prompt)
        return CacheDataset(create_dataset(examples, tokenizer, config))
    pairs = [encode_pair(example, tokenizer) for example in examples]
    cut = sum(p.prompt >= plan.max_seq_length - 1 for p in pairs)
    if cut:
        raise InvalidArgument(
            f"dataset_source: {cut} pairs' prompts fill the {plan.max_seq_length} "
            "tokens a sequence may have, leaving no answer to train on"
        )
    return pairs


def batch_tokens(dataset, plan: FineTunePlan) -> int:
    """The longest batch's padded width, as mlx-lm's batches (and the pairs') pad."""
    if plan.method == "sft":
        # Tokenized (and cached) here as training would.
        longest = max(len(dataset[i][0]) for i in range(len(dataset)))
    else:
        longest = max(max(len(p.chosen), len(p.rejected)) for p in dataset)
    return batch_width(longest, plan.max_seq_length)


def training_weights(model, dequantize: bool | None) -> tuple[object, str]:
    """The model to train and how its weights were laid out, in words.

    On a GPU the weights train as loaded (quantized ones as QLoRA). On the CPU
    everything trains in float32, and quantized weights are dequantized where they
    fit the budget: the gradient through MLX's quantized CPU matmul is the slow
    part (5 LoRA steps of the embedded model: 135 s quantized, 15 s dequantized).
    SwiGLU and the loss's LogSumExp run on the fused CPU kernels, which define their
    gradients: MLX's CPU exp is scalar (a training step of the embedded model: 7.4 s
    on MLX's, 6.3 s on the kernels).
    """
    if mx.default_device() != mx.cpu:
        return model, "weights as loaded"
    isa = route_training_ops()
    fused = (
        f"; SwiGLU and the loss's LogSumExp on the fused kernels ({isa})" if isa else ""
    )
    quantized = is_quantized(model)
    needed = float32_bytes(model)
    if dequantize is None:
        dequantize = needed <= dequantize_budget()
    if quantized and dequantize:
        model = dequantize_to_float32(model)
        return model, f"CPU, weights dequantized to float32 ({needed >> 20} MiB){fused}"
    model.set_dtype(mx.float32)
    kept = "quantized weights kept" if quantized else "float32 weights"
    return model, f"CPU, {kept}{fused}"


def run(plan: FineTunePlan, out, commands: Commands) -> None:
    """Train ``plan``; every outcome is reported on ``out``."""
    total = dict(total_steps=plan.iters, total_epochs=plan.epochs)
    Path(plan.output_dir).mkdir(parents=True, exist_ok=True)
    send(out, Progress("loading_model", **total))
    # This process runs one job: the global RNGs are the job's own (mlx-lm shuffles
    # batches with numpy's).
    mx.random.seed(plan.seed)
    np.random.seed(plan.seed)
    loaded = load_model(plan.model)
    model, layout = training_weights(loaded.model, plan.dequantize)
    tokenizer = loaded.tokenizer
    mx.eval(model.parameters())
    logger.info("fine-tuning job %s: %s", plan.job_id, layout)
    model.freeze()
    if plan.fine_tune_type == "full":
        model.unfreeze()
    else:
        parameters = adapter_config(plan, len(model.layers))["lora_parameters"]
        linear_to_lora_layers(
            model, len(model.layers), parameters, use_dora=plan.fine_tune_type == "dora"
        )
    send(out, Progress("loading_dataset", message=layout, **total))
    train_set = _dataset(plan.train_file, tokenizer, plan)
    valid_set = _dataset(plan.valid_file, tokenizer, plan) if plan.valid_file else None
    rows = plan.batch_size * (1 if plan.method == "sft" else 2)
    footprint = estimate(
        model, rows, batch_tokens(train_set, plan), plan.grad_checkpoint
    )
    logger.info("fine-tuning job %s needs about %s", plan.job_id, footprint.describe())
    check_fits(footprint, held=footprint.weights)
    # From here serving's memory budget counts the job.
    memory = {"estimated_memory_gb": footprint.total / 1e9}
    send(
        out,
        Progress("loading_dataset", message=layout, extra_metrics=memory, **total),
    )
    if plan.method == "dpo":
        # Before a checkpoint's weights load: the reference is the untrained model.
        train_set = with_reference(
            model, train_set, plan.batch_size, plan.max_seq_length
        )
        if valid_set is not None:
            valid_set = with_reference(
                model, valid_set, plan.batch_size, plan.max_seq_length
            )
    start = 0
    if plan.resume_from:
        resume = Path(plan.resume_from)
        model.load_weights(str(resume / ADAPTER_WEIGHTS), strict=False)
        start = json.loads((resume / STATE_FILE).read_text())["step"]
    if commands.stop:
        send(out, Progress("stopped", current_step=start, **total))
        return
    reporter = Reporter(plan, out, commands, model, start, footprint.total)
    args = TrainingArgs(
        batch_size=plan.batch_size,
        iters=max(plan.iters - start, 0),
        val_batches=-1,
        steps_per_report=1,
        steps_per_eval=plan.save_steps,
        # Checkpoints are the reporter's.
        steps_per_save=plan.iters + 1,
        max_seq_length=plan.max_seq_length,
        adapter_file=str(Path(plan.output_dir) / ADAPTER_WEIGHTS),
        grad_checkpoint=plan.grad_checkpoint,
        grad_accumulation_steps=plan.grad_accumulation_steps,
    )
    preference = {}
    if plan.method != "sft":
        preference = dict(
            loss=make_preference_loss(plan.method, plan.beta),
            iterate_batches=iterate_pairs,
        )
    try:
        if args.iters:
            train(
                model,
                _optimizer(plan),
                train_set,
                valid_set,
                args,
                training_callback=reporter,
                **preference,
            )
    except Stopped:
        send(out, Progress("stopped", current_step=reporter.last.current_step, **total))
        return
    path = reporter.checkpoint(plan.iters)
    # The output folder itself is the trained adapter, as mlx_lm.lora leaves it.
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copyfile(path / name, Path(plan.output_dir) / name)
    done = reporter.last
    send(
        out,
        Progress(
            "completed",
            current_step=plan.iters,
            loss=done.loss,
            eval_loss=done.eval_loss,
            current_epoch=done.current_epoch,
            progress_percent=100.0,
            checkpoint_path=str(path),
            message=f"trained {plan.iters} steps",
            **total,
        ),
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    out = os.fdopen(int(argv[1]), "w", buffering=1)
    plan = FineTunePlan.from_json(sys.stdin.readline())
    commands = Commands(sys.stdin)
    # mlx-lm's progress display writes to stdout; the backend reads only ``out``.
    sys.stdout = open(os.devnull, "w")
    try:
        run(plan, out, commands)
    except Exception as e:
        logger.exception("fine-tuning job %s failed", plan.job_id)
        send(out, Progress("failed", message=describe_error(e)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
