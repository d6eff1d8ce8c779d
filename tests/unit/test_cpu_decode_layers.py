"""A decode step's layers as one kernel node each (decode_layers.py,
decode_layer.cpp): the same logits as mlx-lm's graph on the same kernels, the
cache written in place, and every other call on mlx-lm's own code."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_backend.cpu import kernels
from mlx_backend.cpu.kernels import decode_layers
from mlx_backend.cpu.kernels.fast_ops import route_fast_ops
from tests.tiny_models import TINY_LLAMA

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_llama(
    rope_scaling: dict | None = None, bits: int = 4, mlp_bits: int | None = None, **args
) -> llama.Model:
    """A random 2-layer llama on the kernels, its MLP ``mlp_bits`` where given."""
    config = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 96, **args}
    config.update(vocab_size=50, tie_word_embeddings=True, rope_scaling=rope_scaling)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Each parameter its own values (siblings of one shape differ).
    params = tree_flatten(model.parameters())
    model.update(
        tree_unflatten(
            [
                (name, mx.random.normal(p.shape, key=mx.random.key(i)) * 0.5)
                for i, (name, p) in enumerate(params)
            ]
        )
    )
    if mlp_bits is not None:
        nn.quantize(model, 32, mlp_bits, class_predicate=_in_mlp)
    nn.quantize(model, group_size=32, bits=bits)
    kernels.use_kernels(model)
    route_fast_ops()
    mx.eval(model.parameters())
    return model


def _in_mlp(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and ".mlp." in f".{path}"


def decode(model, steps: int, prompt: int = 20) -> list[mx.array]:
    """Greedy decode's logits after a prompt, evaluated a step ahead as
    generate_step does."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.arange(prompt)[None] % 50, cache=cache)[:, -1]
    out = []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)[None]
        logits = model(token, cache=cache)[:, -1]
        mx.async_eval(logits)
        out.append(logits)
    mx.eval(out)
    return out


@pytest.fixture
def calls(monkeypatch):
    """How many block calls ran as one node."""
    counted = []
    run = decode_layers._decode

    def counting(*args):
        counted.append(1)
        return run(*args)

    monkeypatch.setattr(decode_layers, "_decode", counting)
    return counted


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_decode_layers_give_the_graphs_logits_exactly(qmm, calls, activations, rope):
    model = tiny_llama(LLAMA3_ROPE if rope == "llama3" else None)
    qmm.set_activations(activations)
    # 20 + 240 tokens: the caches grow past 256 (that step on mlx-lm's code).
    graph = decode(model, 240)
    copies = qmm.decode_layer_cache_copies()
    assert decode_layers.route_decode_layers(model) == 2
    fused = decode(model, 240)
    decode_layers.unroute_decode_layers(model)
    assert all(mx.array_equal(a, b) for a, b in zip(fused, graph))
    # Every step but the cache's growth, in both layers; written in place (a
    # stream stalled past the wait, on a loaded machine, copies a few).
    assert len(calls) == 2 * 239
    assert qmm.decode_layer_cache_copies() - copies <= 2 * 239 // 20


@pytest.mark.parametrize(
    "variant",
    [
        {"rope_traditional": True},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"num_key_value_heads": 4},
        {"bits": 8},
        {"mlp_bits": 8},
    ],
    ids=["traditional-rope", "linear-rope", "mha", "8-bit", "8-bit-mlp"],
)
def test_the_blocks_variants_give_the_graphs_logits(qmm, calls, variant):
    model = tiny_llama(**variant)
    graph = decode(model, 12)
    assert decode_layers.route_decode_layers(model) == 2
    bits = variant.get("bits", 4), variant.get("mlp_bits", variant.get("bits", 4))
    assert model.layers[0].decode_plan.bits == (bits[0],) * 4 + (bits[1],) * 3
    fused = decode(model, 12)
    decode_layers.unroute_decode_layers(model)
    assert len(calls) == 2 * 12
    assert all(mx.array_equal(a, b) for a, b in zip(fused, graph))


def test_a_trimmed_cache_decodes_as_the_graph(qmm, calls):
    model = tiny_llama()

    def run():
        cache = [KVCache() for _ in model.layers]
        model(mx.arange(20)[None] % 50, cache=cache)
        first = [model(mx.array([[i]]), cache=cache) for i in range(5)]
        for c in cache:
            c.trim(3)
        # Positions 22-24 written again over what the trimmed tokens left.
        return first + [model(mx.array([[7 + i]]), cache=cache) for i in range(5)]

    graph = run()
    decode_layers.route_decode_layers(model)
    fused = run()
    decode_layers.unroute_decode_layers(model)
    assert len(calls) == 2 * 10
    assert all(mx.array_equal(a, b) for a, b in zip(fused, graph))


def test_other_calls_run_mlx_lms_code(qmm, calls):
    model = tiny_llama()
    decode_layers.route_decode_layers(model)
    try:
        # A prompt, a batch of two and a rotating cache.
        cache = [KVCache() for _ in model.layers]
        model(mx.arange(8)[None], cache=cache)
        batch = [KVCache() for _ in model.layers]
        model(mx.zeros((2, 4), mx.int32), cache=batch)
        model(mx.zeros((2, 1), mx.int32), cache=batch)
        rotating = [RotatingKVCache(max_size=16) for _ in model.layers]
        model(mx.arange(4)[None], cache=rotating)
        model(mx.zeros((1, 1), mx.int32), cache=rotating)
        assert not calls
        model(mx.zeros((1, 1), mx.int32), cache=cache)
        assert len(calls) == 2
    finally:
        decode_layers.unroute_decode_layers(model)


def test_only_blocks_the_kernel_takes_get_a_plan(qmm):
    assert decode_layers.route_decode_layers(tiny_llama(bits=4)) == 2
    # 3-bit weights stay on MLX's kernels: no plan.
    assert decode_layers.route_decode_layers(tiny_llama(bits=3)) == 0
    model = tiny_llama()
    model.layers[0].self_attn.q_proj.bias = mx.zeros((64,))
    assert decode_layers.route_decode_layers(model) == 1


def test_decode_layer_names_what_does_not_fit(qmm):
    model = tiny_llama()
    block = model.layers[0]
    linears = []
    for part, name in decode_layers._PROJECTIONS:
        m = block[part][name]
        linears += [m["weight"], m["scales"], m["biases"]]
    plan = decode_layers.decode_plan(block)
    keys = mx.zeros((1, 2, 8, 16))
    args = (block.input_layernorm.weight, block.post_attention_layernorm.weight)
    with pytest.raises(ValueError, match="S > offset"):
        qmm.decode_layer(
            mx.zeros((1, 1, 64)), keys, keys, 8, *args, linears, None, **plan.arguments
        )
    with pytest.raises(ValueError, match="x must be float32 of shape"):
        qmm.decode_layer(
            mx.zeros((1, 2, 64)), keys, keys, 0, *args, linears, None, **plan.arguments
        )
    with pytest.raises(ValueError, match="one length"):
        qmm.decode_layer(
            mx.zeros((1, 1, 64)),
            keys,
            mx.zeros((1, 2, 9, 16)),
            0,
            *args,
            linears,
            None,
            **plan.arguments,
        )
    with pytest.raises(ValueError, match="o must be 4- or 8-bit affine codes"):
        wrong = linears[:9] + [linears[9].astype(mx.float32)] + linears[10:]
        qmm.decode_layer(
            mx.zeros((1, 1, 64)), keys, keys, 0, *args, wrong, None, **plan.arguments
        )
    with pytest.raises(ValueError, match="down's weight"):
        swapped = linears[:18] + linears[12:15]
        qmm.decode_layer(
            mx.zeros((1, 1, 64)), keys, keys, 0, *args, swapped, None, **plan.arguments
        )


def test_a_cache_held_elsewhere_is_copied_not_written(qmm):
    model = tiny_llama()
    decode_layers.route_decode_layers(model)
    try:
        cache = [KVCache() for _ in model.layers]
        model(mx.arange(8)[None], cache=cache)
        mx.eval([c.state for c in cache])
        # A prompt cache's copy of the state: the same arrays.
        kept = [(c.keys, c.values) for c in cache]
        before = [mx.array(k) + 0 for k, _ in kept]
        mx.eval(before)
        copies = qmm.decode_layer_cache_copies()
        mx.eval(model(mx.zeros((1, 1), mx.int32), cache=cache))
        assert qmm.decode_layer_cache_copies() == copies + 4
        assert all(mx.array_equal(k, b) for (k, _), b in zip(kept, before))
        assert not mx.array_equal(cache[0].keys, kept[0][0])
    finally:
        decode_layers.unroute_decode_layers(model)
