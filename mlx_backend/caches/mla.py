"""Multi-head latent attention (MLA: DeepSeek V3, GLM-4.7-Flash) in a paged pass.

mlx-lm's MLA attention scores the queries' rotary part against the keys' in a
matmul of its own, over the cache's whole keys, which a pass over pages does not
hand it. Over pages, its class's call is routed (``install_mla_ops``) to the
absorbed form mlx-lm runs for a decode token, for every token: a page's key is
the latent and the rotary key side by side, its value the latent; a query is the
head's query taken into the latent's space beside its rotary query; attention
over pages then gives each head's output in the latent's space, which the head
takes back out. Pages hold the latent once: the values are the keys' latent
dims, which attention reads through the key arenas (``value_dims``).
"""

from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn

from mlx_backend.caches.paged import PagedLayer, route_calls

# What an attention module of mlx-lm's MLA families has.
MLA_PARTS = ("embed_q", "unembed_out", "kv_a_proj_with_mqa", "kv_a_layernorm")


def is_mla(module: nn.Module) -> bool:
    return all(hasattr(module, part) for part in MLA_PARTS)


def _over_pages(self, x: mx.array, mask, cache: PagedLayer) -> mx.array:
    B, L, _ = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)
    q_pe = self.rope(q_pe, cache.offset)
    k_pe = self.rope(k_pe, cache.offset)
    keys, values = cache.update_and_fetch(
        mx.concatenate([latent, k_pe], axis=-1), latent
    )
    queries = mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1)
    out = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=self.scale, mask=mask
    )
    out = self.unembed_out(out)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def install_mla_ops(classes: Iterable[type]) -> None:
    """Route the calls of MLA attention ``classes`` over a ``PagedLayer``;
    calls over any other cache go on as they were."""
    route_calls(
        classes,
        PagedLayer,
        lambda module, call, x, mask, cache: _over_pages(module, x, mask, cache),
    )
