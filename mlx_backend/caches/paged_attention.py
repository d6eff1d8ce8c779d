"""RoPE and attention over pages, as ``mx.fast`` sees them in a paged pass.

``install_paged_ops`` puts a function in ``mx.fast`` for ``rope`` and
``scaled_dot_product_attention`` that handles what a ``PagedLayer`` hands the
model's attention (``TokenPositions`` as the offset, ``PagedKeys`` as keys and
values) and passes anything else to what was there before (MLX's own, or the CPU
kernels' routing). Every family's attention code reaches them unchanged.

RoPE rotates each token at its own position: the tokens become rows of a batch,
one offset per row, which ``mx.fast.rope`` takes on every device. Attention runs
per sequence over its pages: on the CPU kernels one primitive reads the pages
directly; elsewhere each sequence's pages are gathered and the inner
``scaled_dot_product_attention`` runs on them (causal within a chunk).
"""

import mlx.core as mx

from mlx_backend.caches.paged import (
    PAGE_TOKENS,
    PagedKeys,
    PagedKV,
    PagedWindow,
    TokenPositions,
)
from mlx_backend.cpu.kernels import fast_ops

_inner: dict = {}


def _rope(a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
    def rotate(x, at):
        return _inner["rope"](
            x,
            dims,
            traditional=traditional,
            base=base,
            scale=scale,
            offset=at,
            freqs=freqs,
            stream=stream,
        )

    if isinstance(offset, TokenPositions):
        layout = offset.layout
        if len(layout.segments) == 1:
            # One sequence's tokens: consecutive positions from its first.
            (segment,) = layout.segments
            return rotate(a, segment.context - segment.tokens)
        positions = layout.positions
    elif _per_token(a, offset):
        # TokenPositions made an array by the model (Gemma 4).
        positions = offset
    else:
        return rotate(a, offset)
    if fast_ops.routed_kernels() is not None and stream is None:
        # The CPU kernel takes a position per token (a batch of one).
        return rotate(a, positions)
    # [1, heads, tokens, dims] -> one batch row a token.
    _, heads, tokens, width = a.shape
    rows = rotate(a[0].swapaxes(0, 1)[:, :, None, :], positions)
    return rows.reshape(tokens, heads, width).swapaxes(0, 1)[None]


def _per_token(a: mx.array, offset) -> bool:
    """Whether ``offset`` gives each of a batch of one's tokens its position: an
    array offset is otherwise one per batch row, so this shape is never one."""
    return (
        isinstance(offset, mx.array)
        and offset.ndim == 1
        and a.shape[0] == 1
        and offset.size == a.shape[-2] > 1
    )


def _attention(q, k, v, *, scale, mask=None, sinks=None, stream=None, **kwargs):
    if not isinstance(k, PagedKeys):
        return _inner["scaled_dot_product_attention"](
            q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs
        )
    # A sliding-window layer's mask says how far back its tokens see.
    window = mask.size if isinstance(mask, PagedWindow) else 0
    kernels = fast_ops.routed_kernels()
    shape = k.kv.shapes[k.layer]
    # The kernel reads float32, float16 and quantized arenas as they are;
    # bfloat16 ones would be converted whole, every layer, and half-precision
    # queries want their model's own attention: gathered pages cost less.
    if (
        kernels is not None
        and stream is None
        and q.dtype == mx.float32
        and (shape.bits is not None or shape.stored in (mx.float32, mx.float16))
    ):
        layout = k.layout
        return kernels.paged_attention(
            q,
            k.kv.keys[k.layer],
            k.kv.values[k.layer],
            layout.segment_array,
            layout.tables,
            scale=scale,
            arena_pages=k.kv.arena_pages,
            window=window,
            sinks=sinks,
            # MLA: the values are the keys' latent dims.
            value_dims=shape.latent,
            **quantized_arenas(k.kv, k.layer),
        )
    return gathered_attention(q, k, scale, sinks, stream, window)


def quantized_arenas(kv: PagedKV, layer: int) -> dict:
    """The kernel's arguments for a quantized layer's scales and biases (none for
    a float layer, whose keys and values arenas are all it reads)."""
    shape, planes = kv.shapes[layer], kv.planes[layer]
    if shape.bits is None:
        return {}
    return dict(
        key_scales=planes[1],
        key_biases=planes[2],
        value_scales=planes[4],
        value_biases=planes[5],
        bits=shape.bits,
        group_size=shape.group_size,
    )


def gathered_attention(
    q, k: PagedKeys, scale, sinks=None, stream=None, window: int = 0
) -> mx.array:
    """Attention per sequence over its gathered pages (the portable path), each
    token over the last ``window`` keys only where that is set."""
    inner = _inner["scaled_dot_product_attention"]
    outputs = []
    for s in k.layout.segments:
        # From the page its first token's window starts in: those before may be
        # holes (``caches/page_tables.py``).
        first = max(s.context - s.tokens - window + 1, 0) if window else 0
        first -= first % PAGE_TOKENS
        keys, values = k.kv.read_float(k.layer, s.pages, s.context, first)
        mask = "causal" if s.tokens > 1 else None
        if window and s.context > window:
            at = mx.arange(s.context - s.tokens, s.context)[:, None]
            seen = mx.arange(first, s.context)[None]
            mask = (seen <= at) & (seen > at - window)
        outputs.append(
            inner(
                q[:, :, s.start : s.start + s.tokens, :],
                keys.astype(q.dtype),
                values.astype(q.dtype),
                scale=scale,
                mask=mask,
                sinks=sinks,
                stream=stream,
            )
        )
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


_PAGED = {"rope": _rope, "scaled_dot_product_attention": _attention}


def install_paged_ops() -> None:
    """Route ``mx.fast``'s RoPE and attention through the paged forms in this
    process (idempotent; again after anything else replaced them)."""
    for name, fn in _PAGED.items():
        current = getattr(mx.fast, name)
        if current is not fn:
            _inner[name] = current
            setattr(mx.fast, name, fn)
