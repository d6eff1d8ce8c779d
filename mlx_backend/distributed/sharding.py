"""Splitting a loaded model over an MLX distributed group.

Tensor parallel goes through the model's own ``shard(group)`` (mlx-lm has it for
llama, qwen2, qwen3 and others): every rank holds a slice of every layer. Pipeline
parallel gives each rank a contiguous range of layers, as mlx-lm's
``PipelineMixin`` does, for any model whose layers sit in ``model.model.layers``.
Either way every rank ends up with the same logits, and every forward pass takes
rank 0's token ids, so the ranks agree on each token whatever they sample.
"""

import inspect
import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from mlx_backend.refusals import Described

logger = logging.getLogger(__name__)


class ShardingError(Described):
    """The model cannot be split the way it was asked."""


def _text_args(model: nn.Module):
    """The text model's arguments: a multimodal checkpoint's (Qwen3.5) are its
    language model's, not the wrapper's (which holds text_config as a dict)."""
    language = getattr(model, "language_model", None)
    return getattr(language, "args", None) or model.args


def _head_counts(model: nn.Module) -> tuple[int, int]:
    args = _text_args(model)
    heads = args.num_attention_heads
    return heads, getattr(args, "num_key_value_heads", None) or heads


def _layers(model: nn.Module) -> list:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list):
        raise ShardingError(
            f"pipeline parallel needs the layers in model.model.layers, which "
            f"{type(model).__module__} does not have"
        )
    return layers


def tensor_problem(model: nn.Module, size: int) -> str | None:
    """Why the model can't be split tensor-parallel over ``size`` ranks, or None."""
    if not hasattr(model, "shard"):
        return f"mlx-lm's {type(model).__module__} has no tensor-parallel shard()"
    heads, kv_heads = _head_counts(model)
    if heads % size or kv_heads % size:
        return (
            f"tensor parallel over {size} ranks needs head counts divisible by "
            f"{size}: the model has {heads} query heads and {kv_heads} KV heads"
        )
    intermediate = getattr(_text_args(model), "intermediate_size", 0) or 0
    if intermediate % size:
        return (
            f"tensor parallel over {size} ranks needs an MLP width divisible by "
            f"{size}: the model's is {intermediate}"
        )
    return None


def pipeline_problem(model: nn.Module, size: int) -> str | None:
    """Why the model can't be split into ``size`` pipeline stages, or None."""
    try:
        layers = _layers(model)
    except ShardingError as e:
        return str(e)
    if len(layers) < size:
        return (
            f"pipeline parallel over {size} ranks needs at least {size} layers: "
            f"the model has {len(layers)}"
        )
    return _positions_problem(model, size)


def _ranges(layers: int, size: int) -> list[tuple[int, int]]:
    """Each rank's (start, end) of the layers; the last rank runs the first."""
    base, extra = divmod(layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    return [(sum(split[r + 1 :]), sum(split[r:])) for r in range(size)]


def _positions_problem(model: nn.Module, size: int) -> str | None:
    """Why the model's forward pass can't run on a range of its layers (it keeps
    what _reindex can't point at the range), or None."""
    inner = model.model
    cannot = f"pipeline parallel can't split {type(model).__module__}"
    if hasattr(inner, "previous_kvs"):
        return f"{cannot}: its later layers reuse the KV caches of earlier ones"
    if hasattr(inner, "sliding_window_pattern"):
        return f"{cannot}: it picks each layer's mask by the layer's position"
    flags = _attention_flags(inner.layers)
    if hasattr(inner, "conv_idx") and flags is not None:
        # LFM2 makes both kinds of mask from this rank's caches, unguarded.
        for start, end in _ranges(len(flags), size):
            if len(set(flags[start:end])) < 2:
                return (
                    f"{cannot} over {size} ranks: every rank needs attention and "
                    f"convolution layers, and layers {start}-{end - 1} are of one kind"
                )
    return None


def choose_mode(model: nn.Module, size: int, mode: str) -> str:
    """``tensor`` or ``pipeline`` for ``mode`` (``auto`` prefers tensor).

    Raises:
        ShardingError: The model can't be split as asked; the message names the
          head counts or the layer count.
    """
    if mode in ("auto", "tensor"):
        why = tensor_problem(model, size)
        if why is None:
            return "tensor"
        if mode == "tensor":
            raise ShardingError(why)
        logger.info("not tensor parallel: %s", why)
    why = pipeline_problem(model, size)
    if why is not None:
        raise ShardingError(why)
    return "pipeline"


@dataclass(frozen=True)
class Sharding:
    """How this rank's copy of the model is split."""

    group: mx.distributed.Group
    mode: str

    @property
    def early(self) -> bool:
        """Split before the weights load, so a rank never holds the whole model.

        On a CPU, tensor slices are cut after quantized weights are dequantized:
        mlx's sharded quantized layers would otherwise stay quantized.
        """
        return self.mode == "pipeline" or mx.default_device() != mx.cpu

    def apply(self, model: nn.Module) -> str:
        """Split ``model`` in place; a line that says what this rank holds."""
        rank, size = self.group.rank(), self.group.size()
        if self.mode == "tensor":
            heads, kv_heads = _head_counts(model)
            model.shard(self.group)
            return (
                f"tensor parallel, rank {rank} of {size}: {heads // size} of {heads} "
                f"query heads, {kv_heads // size} of {kv_heads} KV heads"
            )
        start, end = _pipeline(model, self.group)
        return f"pipeline parallel, rank {rank} of {size}: layers {start}-{end - 1}"

    def share_inputs(self, model: nn.Module) -> None:
        """Make every forward pass embed rank 0's token ids."""
        inner = getattr(model, "model", model)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            raise ShardingError(
                f"{type(model).__module__} has no model.embed_tokens to share inputs at"
            )
        _share_inputs(embed, self.group)


def _share_inputs(embed: nn.Module, group: mx.distributed.Group) -> None:
    base = type(embed)
    leader = group.rank() == 0

    def __call__(self, x: mx.array) -> mx.array:
        # Workers add zeros, so the sum is rank 0's ids on every rank.
        x = mx.distributed.all_sum(x if leader else mx.zeros_like(x), group=group)
        return base.__call__(self, x)

    embed.__class__ = type(f"Shared{base.__name__}", (base,), {"__call__": __call__})


def _pipeline(model: nn.Module, group: mx.distributed.Group) -> tuple[int, int]:
    """Keep this rank's layers; the last rank runs the first layers and rank 0
    the last ones, whose output every rank then takes (as ``PipelineMixin``)."""
    layers = _layers(model)
    rank, size = group.rank(), group.size()
    start, end = _ranges(len(layers), size)[rank]
    local = layers[start:end]
    _make_stage(
        local[0],
        group,
        receive_from=rank + 1 if rank < size - 1 else None,
        last=len(local) == 1,
    )
    if len(local) > 1:
        _make_stage(local[-1], group, receive_from=None, last=True)
    # Dropped before the weights load: this rank never holds the other layers.
    model.model.layers = local
    _reindex(model.model, start, end, len(layers))
    return start, end


def _attention_flags(layers: list) -> list[bool] | None:
    """Whether each layer is an attention layer, as hybrid models' layers say
    (Qwen3.5 and Qwen3-Next, LFM2, Granite 4.0 H); None when they don't."""
    flags = []
    for layer in layers:
        if hasattr(layer, "is_linear"):
            flags.append(not layer.is_linear)
        elif hasattr(layer, "is_attention_layer"):
            flags.append(bool(layer.is_attention_layer))
        elif hasattr(layer, "layer_type"):
            flags.append(layer.layer_type == "attention")
        else:
            return None
    return flags


def _reindex(inner: nn.Module, start: int, end: int, total: int) -> None:
    """Point what hybrid and sliding-window models keep by layer position at this
    rank's layers: gpt-oss's layer kinds, and the cache positions that masks are
    made from (the first layer of each kind): 0 for gpt-oss's kinds this rank
    lacks (a mask made and never used), None for the hybrids' (as mlx-lm's
    ``pipeline()`` sets them for Qwen3.5: no mask is made)."""
    kinds = getattr(inner, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) == total:
        inner.layer_types = kinds = kinds[start:end]
        for name, kind in (
            ("swa_idx", "sliding_attention"),
            ("ga_idx", "full_attention"),
        ):
            if hasattr(inner, name):
                setattr(inner, name, kinds.index(kind) if kind in kinds else 0)
    flags = _attention_flags(inner.layers)
    if flags is None:
        return
    attention = next((i for i, f in enumerate(flags) if f), None)
    other = next((i for i, f in enumerate(flags) if not f), None)
    for name, position in (
        ("fa_idx", attention),
        ("ssm_idx", other),
        ("conv_idx", other),
    ):
        if hasattr(inner, name):
            setattr(inner, name, position)


def _make_stage(
    layer: nn.Module,
    group: mx.distributed.Group,
    receive_from: int | None,
    last: bool,
) -> None:
    base = type(layer)
    rank = group.rank()
    wire: dict = {}
    # A probe passes no mask: gpt-oss's layers take one without a default.
    mask = inspect.signature(base.__call__).parameters.get("mask")
    probe_args = (
        {"mask": None} if mask is not None and mask.default is mask.empty else {}
    )

    def wire_dtype(self, h: mx.array) -> mx.Dtype:
        # Stages pass hidden states in the dtype layers settle on (float16
        # embeddings meet float32 norms, say): found from a graph never evaluated.
        key = (h.dtype, h.shape[-1])
        if key not in wire:
            probe = mx.zeros((1, 1, h.shape[-1]), h.dtype)
            for _ in range(2):
                probe = base.__call__(self, probe, **probe_args)
            wire[key] = probe.dtype
        return wire[key]

    def __call__(self, h: mx.array, *args, **kwargs) -> mx.array:
        if receive_from is not None:
            # Zero times the local embedding, added first, so that its input
            # sharing (a collective every rank runs) is evaluated before the recv.
            template = mx.zeros(h.shape, wire_dtype(self, h))
            received = mx.distributed.recv_like(template, receive_from, group=group)
            h = (h * 0).astype(received.dtype) + received
        h = base.__call__(self, h, *args, **kwargs)
        if last:
            h = h.astype(wire_dtype(self, h))
            if rank > 0:
                h = mx.distributed.send(h, rank - 1, group=group)
                # Prefill evaluates only the KV cache: it must carry the send.
                cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
                if isinstance(cache, ArraysCache):
                    # A recurrent layer's state (Qwen3.5's linear attention).
                    cache[0] = mx.depends(cache[0], h)
                elif cache is not None:
                    cache.keys = mx.depends(cache.keys, h)
            h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
        return h

    layer.__class__ = type(f"Stage{base.__name__}", (base,), {"__call__": __call__})
