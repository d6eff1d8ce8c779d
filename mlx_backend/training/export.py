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
from mlx_backend.models.loading import default_model_path
from mlx_backend.refusals import describe_error, describe_path
from mlx_backend.training.jobs import ROOT
from mlx_backend.training.plan import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    OUTPUT_ROOT_ENV,
    inside_root,
)

EXPORT_FORMATS = ("lora", "merged_16bit", "merged_4bit", "gguf")
GGUF_FILE = "model-f16.gguf"
# The families mlx-lm's GGUF converter writes (with a SentencePiece vocabulary).
MLX_LM_GGUF_TYPES = ("llama", "mistral", "mixtral")


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
    if fmt == "gguf":
        if request.quantization_method.lower() not in ("", "f16"):
            raise Unimplemented(
                "quantization_method: gguf is written in f16 here (quantize it with "
                "llama.cpp's llama-quantize)"
            )
        why = gguf_refusal(base)
        if why:
            raise Unimplemented(f"export_format: gguf {why}")
    return ExportPlan(str(checkpoint), str(output), fmt, base)


def _gguf_base(base: str) -> Path | None:
    """The GGUF file ``base`` names (``default``: the embedded model), if any."""
    if base == "default":
        return default_model_path()
    return Path(base) if Path(base).is_file() else None


def gguf_refusal(base: str) -> str | None:
    """Why a model fused onto ``base`` cannot be written as GGUF here, or None.

    A GGUF base is written back with its own metadata and tokenizer. An MLX folder
    goes through mlx-lm's converter, which writes llama-family weights with a
    SentencePiece vocabulary, so a byte-level BPE tokenizer would come out wrong.
    """
    if _gguf_base(base) is not None:
        return None
    folder = Path(base)
    try:
        config = json.loads((folder / "config.json").read_text())
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        config = tokenizer = None
    if not isinstance(config, dict) or not isinstance(tokenizer, dict):
        return "needs a GGUF base, or an MLX folder with config.json and tokenizer.json"
    if config.get("model_type") not in MLX_LM_GGUF_TYPES:
        return (
            "is written from a GGUF base, or from an MLX folder of a "
            f"{', '.join(MLX_LM_GGUF_TYPES)} model (mlx-lm's converter)"
        )
    if config.get("rope_traditional"):
        return "from this folder: its weights are in GGUF's layout already (export from its GGUF file)"
    if "ByteLevel" in json.dumps(tokenizer.get("pre_tokenizer")):
        return (
            "from this folder: mlx-lm's converter writes a SentencePiece vocabulary, "
            "and this model's tokenizer is byte-level BPE (export from a GGUF base)"
        )
    return None


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
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.gguf import convert_to_gguf
    from mlx_lm.utils import dequantize_model, load, quantize_model, save

    from mlx_backend.models.gguf import export_mlx_folder, save_gguf_f16

    with tempfile.TemporaryDirectory() as scratch:
        base = plan.base
        gguf = _gguf_base(base)
        if gguf is not None:
            # A GGUF base becomes an MLX folder first, as mlx-lm loads folders.
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
        if plan.export_format == "gguf":
            output = Path(plan.output)
            output.mkdir(parents=True, exist_ok=True)
            weights = dict(tree_flatten(model.parameters()))
            if gguf is not None:
                save_gguf_f16(weights, gguf, output / GGUF_FILE)
            else:
                convert_to_gguf(Path(base), weights, config, str(output / GGUF_FILE))
            return f"the F16 GGUF file {output / GGUF_FILE}"
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
