"""A ``FineTuneRequest`` parsed once into the training worker's plan, and the
dataset checked line by line before a job starts."""

import json
import math
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_backend.caches.prompt_files import confine
from mlx_backend.errors import InvalidArgument, Unimplemented
from mlx_backend.refusals import describe_path
from mlx_backend.switches import parse_bool
from mlx_backend.training.preference import DEFAULT_BETA, PREFERENCE_METHODS

# A job's output folder: checkpoint-<step> folders, each an mlx-lm adapter folder
# with the step's state, and the trained adapter itself at the end.
CHECKPOINT_PREFIX = "checkpoint-"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
STATE_FILE = "trainer_state.json"

# LocalAI's name for this backend: its fine-tuning service loads it by that name.
BACKEND_NAME = "mlx"

# What trains here: mlx-lm's tuner does LoRA, DoRA and full fine-tuning with SFT,
# and with the preference losses of ``preference.py``.
TRAINING_TYPES = ("lora", "full")
TRAINING_METHODS = ("sft", *PREFERENCE_METHODS)
# The dataset forms: each method's, and what the others train on.
PREFERENCE_FORM = "prompt, chosen and rejected"
SFT_FORMS = "text, messages, or prompt and completion"
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor", "muon")
# The roots LocalAI's trl backend reads: output folders and datasets must lie in them.
OUTPUT_ROOT_ENV = "LOCALAI_OUTPUT_DIR"
DATASET_ROOT_ENV = "LOCALAI_DATASET_DIR"
# mlx-lm's LoRA defaults, where the request leaves a field 0.
DEFAULT_RANK = 8
DEFAULT_SCALE = 20.0
DEFAULT_LEARNING_RATE = 1e-5
DEFAULT_BATCH_SIZE = 4
DEFAULT_SAVE_STEPS = 100


@dataclass(frozen=True)
class FineTunePlan:
    """What the training worker runs, every default resolved."""

    job_id: str
    output_dir: str
    train_file: str
    valid_file: str = ""
    model: str = ""  # "": the embedded default model
    fine_tune_type: str = "lora"  # lora, dora or full
    method: str = "sft"  # sft, dpo or orpo
    beta: float = DEFAULT_BETA  # DPO's beta, ORPO's lambda
    rank: int = DEFAULT_RANK
    scale: float = DEFAULT_SCALE
    dropout: float = 0.0
    keys: tuple[str, ...] = ()  # () : every linear layer
    learning_rate: float = DEFAULT_LEARNING_RATE
    iters: int = 0
    epochs: float = 1.0
    train_examples: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    grad_accumulation_steps: int = 1
    warmup_steps: int = 0
    save_steps: int = DEFAULT_SAVE_STEPS
    weight_decay: float = 0.0
    grad_checkpoint: bool = False
    optimizer: str = "adam"
    seed: int = 0
    max_seq_length: int = 2048
    mask_prompt: bool = False
    resume_from: str = ""
    # On the CPU, quantized weights train dequantized to float32 (None: when they
    # fit the dequantizing budget).
    dequantize: bool | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FineTunePlan":
        fields = json.loads(text)
        fields["keys"] = tuple(fields["keys"])
        return cls(**fields)


def parse_fine_tune(request, environ=os.environ) -> FineTunePlan:
    """The request checked and resolved: its type, method, numbers, dataset (read
    whole and checked line by line) and folders."""
    kind = (request.training_type or "lora").lower()
    options = {k.lower(): v for k, v in request.extra_options.items()}
    if kind not in TRAINING_TYPES:
        raise Unimplemented(
            f"training_type: {kind} is not supported here (one of "
            f"{', '.join(TRAINING_TYPES)}; DoRA is lora with extra_options dora=true)"
        )
    if kind == "lora" and _flag(options, "dora"):
        kind = "dora"
    method = (request.training_method or "sft").lower()
    if method not in TRAINING_METHODS:
        raise Unimplemented(
            f"training_method: {method} is not supported here "
            f"(one of {', '.join(TRAINING_METHODS)})"
        )
    optimizer = (request.optimizer or "adam").lower()
    if optimizer not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer: must be one of {', '.join(OPTIMIZERS)}")
    for name in (
        "adapter_rank",
        "adapter_alpha",
        "num_epochs",
        "batch_size",
        "gradient_accumulation_steps",
        "warmup_steps",
        "max_steps",
        "save_steps",
    ):
        if getattr(request, name) < 0:
            raise InvalidArgument(f"{name}: must not be negative")
    for name in ("learning_rate", "weight_decay", "adapter_dropout"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{name}: must be a finite number, 0 or more")
    if request.adapter_dropout >= 1:
        raise InvalidArgument("adapter_dropout: must be below 1")
    output_dir = _output_dir(request.output_dir, environ)
    train_file, valid_file = _dataset_files(
        request.dataset_source, request.dataset_split, environ
    )
    examples, form = check_dataset(train_file, "dataset_source", method)
    if valid_file:
        check_dataset(valid_file, "dataset_source", method)
    mask_prompt = _flag(options, "mask_prompt")
    if mask_prompt and form == "text":
        raise InvalidArgument(
            "extra_options: mask_prompt needs a dataset of messages, or prompt and "
            "completion; dataset_source is text"
        )
    beta = _number(options, "beta", DEFAULT_BETA)
    batch_size = request.batch_size or DEFAULT_BATCH_SIZE
    if examples < batch_size:
        raise InvalidArgument(
            f"dataset_source: {examples} examples, fewer than batch_size {batch_size}"
        )
    # max_steps, where set, decides; the epochs are then what those steps cover.
    epochs = float(request.num_epochs or 1)
    iters = request.max_steps or math.ceil(epochs * examples / batch_size)
    if request.max_steps:
        epochs = iters * batch_size / examples
    rank = request.adapter_rank or DEFAULT_RANK
    scale = request.adapter_alpha / rank if request.adapter_alpha else DEFAULT_SCALE
    resume = ""
    if request.resume_from_checkpoint:
        resume = str(
            confine(
                request.resume_from_checkpoint, [output_dir], "resume_from_checkpoint"
            )
        )
        if not Path(resume).is_dir():
            raise InvalidArgument(
                f"resume_from_checkpoint: {describe_path(Path(resume))}, not a checkpoint"
            )
    return FineTunePlan(
        job_id=request.job_id or uuid.uuid4().hex,
        output_dir=str(output_dir),
        train_file=str(train_file),
        valid_file=str(valid_file) if valid_file else "",
        model=request.model,
        fine_tune_type=kind,
        method=method,
        beta=beta,
        rank=rank,
        scale=scale,
        dropout=request.adapter_dropout,
        keys=tuple(request.target_modules),
        learning_rate=request.learning_rate or DEFAULT_LEARNING_RATE,
        iters=iters,
        epochs=epochs,
        train_examples=examples,
        batch_size=batch_size,
        grad_accumulation_steps=request.gradient_accumulation_steps or 1,
        warmup_steps=request.warmup_steps,
        save_steps=request.save_steps or DEFAULT_SAVE_STEPS,
        weight_decay=request.weight_decay,
        grad_checkpoint=request.gradient_checkpointing,
        optimizer=optimizer,
        seed=request.seed,
        mask_prompt=mask_prompt,
        resume_from=resume,
        dequantize=_flag(options, "dequantize") if "dequantize" in options else None,
    )


def is_backend_name(model: str, model_path: str = "") -> bool:
    """``LoadModel`` names the backend itself, not a model (no such file or
    folder under ``model_path``)."""
    return model == BACKEND_NAME and not (Path(model_path or ".") / model).exists()


def checkpoints_folder(output_dir: str, environ=os.environ) -> Path:
    """``ListCheckpoints``'s folder, inside the output root where one is set."""
    return _output_dir(output_dir, environ)


def _flag(options: dict[str, str], name: str) -> bool:
    try:
        return parse_bool(options.get(name, "false"))
    except ValueError:
        raise InvalidArgument(f"extra_options: {name} must be true or false") from None


def _number(options: dict[str, str], name: str, default: float) -> float:
    try:
        value = float(options.get(name, default))
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"extra_options: {name} must be a number above 0")
    return value


def inside_root(path: str, field: str, root_env: str, environ=os.environ) -> Path:
    """``path`` resolved, and inside the folder environment variable ``root_env``
    names where it is set."""
    if not path:
        raise InvalidArgument(f"{field}: is empty")
    root = environ.get(root_env, "")
    return confine(path, [Path(root)], field) if root else Path(path).resolve()


def _output_dir(path: str, environ) -> Path:
    resolved = inside_root(path, "output_dir", OUTPUT_ROOT_ENV, environ)
    if resolved.exists() and not resolved.is_dir():
        raise InvalidArgument(f"output_dir: {describe_path(resolved)}, not a folder")
    return resolved


def _dataset_files(source: str, split: str, environ) -> tuple[Path, Path | None]:
    """The training file, and the validation file where the dataset has one: a
    JSONL file, or a folder of ``<split>.jsonl`` (``train`` by default) and
    ``valid.jsonl``."""
    path = inside_root(source, "dataset_source", DATASET_ROOT_ENV, environ)
    if path.is_dir():
        train = path / f"{split or 'train'}.jsonl"
        if not train.is_file():
            raise InvalidArgument(
                f"dataset_source: the folder has no {train.name} "
                f"(a JSONL file, or a folder of train.jsonl and valid.jsonl)"
            )
        valid = path / "valid.jsonl"
        return train, valid if valid.is_file() and valid != train else None
    if path.is_file():
        return path, None
    raise InvalidArgument(
        f"dataset_source: {describe_path(path)} (a JSONL file, or a folder of "
        "train.jsonl and valid.jsonl; Hugging Face datasets are not downloaded here)"
    )


def check_dataset(path: Path, field: str, method: str = "sft") -> tuple[int, str]:
    """The number of examples in a JSONL file and their one form: for SFT, one
    that mlx-lm trains on (``text``, chat ``messages``, ``prompt`` and
    ``completion``); for DPO and ORPO, ``prompt``, ``chosen`` and ``rejected``. A
    line that isn't is named, never quoted."""
    preference = method in PREFERENCE_METHODS
    wanted = PREFERENCE_FORM if preference else SFT_FORMS
    form, count = None, 0
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{field}: line {number} of {path.name}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError:
                raise InvalidArgument(f"{where} is not JSON") from None
            this = _form(example)
            if this is None:
                raise InvalidArgument(f"{where} has none of {wanted}")
            if (this == PREFERENCE_FORM) != preference:
                raise InvalidArgument(
                    f"{where} is {this}; training_method {method} trains on {wanted}"
                )
            if form is not None and this != form:
                raise InvalidArgument(f"{where} is {this}, the lines before it {form}")
            form, count = this, count + 1
    if not count:
        raise InvalidArgument(f"{field}: {path.name} has no examples")
    return count, form


def _form(example) -> str | None:
    if not isinstance(example, dict):
        return None
    if all(isinstance(example.get(k), str) for k in ("prompt", "chosen", "rejected")):
        return PREFERENCE_FORM
    if isinstance(example.get("prompt"), str) and isinstance(
        example.get("completion"), str
    ):
        return "prompt and completion"
    messages = example.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        )
    ):
        return "messages"
    if isinstance(example.get("text"), str):
        return "text"
    return None
