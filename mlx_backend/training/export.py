"""``ExportModel``: a checkpoint written out as an adapter folder, or fused into its
base model as an MLX folder that ``LoadModel`` serves (16-bit, or quantized to 4
bits). The fusing runs in a process of its own (``python -m
mlx_backend.training.export``, the plan on stdin), never beside the engine."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_backend.errors import InvalidArgument, Unimplemented
from mlx_backend.refusals import describe_error, describe_path
from mlx_backend.training.jobs import ROOT
from mlx_backend.training.plan import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    OUTPUT_ROOT_ENV,
    inside_root,
)

EXPORT_FORMATS = ("lora", "merged_16bit", "merged_4bit")


@dataclass(frozen=True)
class ExportPlan:
    checkpoint: str
    output: str
    export_format: str
    # The base model the adapter was trained on ("default": the embedded one).
    base: str


def parse_export(request, environ=os.environ) -> ExportPlan:
    """The request checked: a known format, a checkpoint folder, an output path
    that is new or an empty folder, both inside the output root where one is set."""
    fmt = request.export_format or "lora"
    if fmt not in EXPORT_FORMATS:
        raise Unimplemented(
            f"export_format: {fmt} is not supported here "
            f"(one of {', '.join(EXPORT_FORMATS)})"
        )
    checkpoint, output = (
        inside_root(getattr(request, name), name, OUTPUT_ROOT_ENV, environ)
        for name in ("checkpoint_path", "output_path")
    )
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        raise InvalidArgument(
            f"checkpoint_path: {describe_path(checkpoint)}, not a checkpoint "
            f"(a folder with {ADAPTER_CONFIG})"
        )
    if output.exists() and not (output.is_dir() and not any(output.iterdir())):
        raise InvalidArgument(
            f"output_path: {describe_path(output)}; it must be new or an empty folder"
        )
    try:
        trained_on = json.loads((checkpoint / ADAPTER_CONFIG).read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        trained_on = ""
    base = request.model or trained_on
    if fmt != "lora" and not base:
        raise InvalidArgument("model: the checkpoint does not name its base model")
    return ExportPlan(str(checkpoint), str(output), fmt, base)


def export(plan: ExportPlan) -> str:
    """Run ``plan`` in a process of its own; what it wrote, in words."""
    if plan.export_format == "lora":
        output = Path(plan.output)
        output.mkdir(parents=True, exist_ok=True)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(Path(plan.checkpoint) / name, output / name)
        return f"the adapter in {output}"
    done = subprocess.run(
        [sys.executable, "-m", "mlx_backend.training.export"],
        input=json.dumps(asdict(plan)),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = done.stdout.strip().splitlines() or ["{}"]
    result = json.loads(lines[-1])
    if done.returncode or "error" in result:
        raise InvalidArgument(
            f"export_format: {plan.export_format} failed: "
            f"{result.get('error', f'the export process ended ({done.returncode})')}"
        )
    return result["wrote"]


def _fuse(plan: ExportPlan) -> str:
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load, quantize_model, save

    from mlx_backend.models.gguf import export_mlx_folder
    from mlx_backend.models.loading import default_model_path

    with tempfile.TemporaryDirectory() as scratch:
        base = plan.base
        if base == "default" or Path(base).is_file():
            # A GGUF base becomes an MLX folder first, as mlx-lm loads folders.
            gguf = default_model_path() if base == "default" else Path(base)
            base = str(export_mlx_folder(gguf, Path(scratch) / "base", dequantize=True))
        model, tokenizer, config = load(
            base, adapter_path=plan.checkpoint, return_config=True
        )
        fused = [
            (n, m.fuse(dequantize=True))
            for n, m in model.named_modules()
            if hasattr(m, "fuse")
        ]
        model.update_modules(tree_unflatten(fused))
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        model.set_dtype(mx.float16)
        config["torch_dtype"] = "float16"
        if plan.export_format == "merged_4bit":
            model, config = quantize_model(model, config, group_size=64, bits=4)
        save(plan.output, base, model, tokenizer, config, donate_model=False)
    return f"{plan.export_format} model folder {plan.output}"


def main() -> int:
    plan = ExportPlan(**json.loads(sys.stdin.read()))
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        wrote = _fuse(plan)
    except Exception as e:
        stdout.write(json.dumps({"error": describe_error(e)}) + "\n")
        return 1
    stdout.write(json.dumps({"wrote": wrote}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
