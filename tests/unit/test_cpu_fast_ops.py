"""MLX's fast operations on the CPU kernels (``mlx_backend/cpu/kernels/fused.cpp``,
``fast_ops.py``) against MLX's own on random inputs over the shapes mlx-lm's
families use, on each instruction set, within stated bounds; and their routing."""

import mlx.core as mx
import pytest
from mlx_lm.models import activations, llama

from mlx_backend.cpu.kernels import fast_ops
from tests.support import FUSED_ISAS, each_fused_isa

MLX = fast_ops._MLX
EPS = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


@pytest.fixture(params=FUSED_ISAS)
def isa(qmm, request):
    """Each test on every instruction set this CPU runs, down to the portable C++."""
    yield from each_fused_isa(qmm, request.param)


def normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def assert_close(y, expected, bound):
    """|y - expected| <= bound everywhere (bound broadcasts)."""
    assert y.shape == expected.shape and y.dtype == expected.dtype
    excess = mx.abs(y.astype(mx.float32) - expected.astype(mx.float32)) - bound
    worst = mx.max(excess).item()
    assert worst <= 0, f"exceeds its bound by {worst}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("dims", [64, 576, 2048, 33])
def test_rms_norm_matches_mlx(qmm, isa, dtype, dims):
    x = normal((3, 5, dims), 1, dtype) * 3
    w = normal((dims,), 2, dtype)
    for weight in (w, None):
        y = qmm.rms_norm(x, weight, 1e-5)
        expected = MLX["rms_norm"](x, weight, 1e-5)
        # Float32 throughout, rounded once: a few float32 steps, plus the two
        # roundings of MLX's half-precision result.
        scale = mx.abs(expected.astype(mx.float32))
        assert_close(y, expected, scale * (8 * 2.0**-23 + 2 * EPS[dtype]) + 1e-7)
    # A row-strided view (every other row) and a transposed one.
    for view in (x[:, ::2], x.swapaxes(0, 1)):
        assert_close(
            qmm.rms_norm(view, w, 1e-6),
            MLX["rms_norm"](view, w, 1e-6),
            mx.abs(MLX["rms_norm"](view, w, 1e-6)).astype(mx.float32)
            * (8 * 2.0**-23 + 2 * EPS[dtype])
            + 1e-7,
        )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_layer_norm_matches_mlx(qmm, isa, dtype):
    x = normal((4, 768), 3, dtype) * 2 + 1
    w, b = normal((768,), 4, dtype), normal((768,), 5, dtype)
    for weight, bias in ((w, b), (w, None), (None, b), (None, None)):
        y = qmm.layer_norm(x, weight, bias, 1e-5)
        expected = MLX["layer_norm"](x, weight, bias, 1e-5)
        bound = (mx.abs(expected.astype(mx.float32)) + 1) * (
            16 * 2.0**-23 + 3 * EPS[dtype]
        )
        assert_close(y, expected, bound)


ROPE_CASES = [
    # (heads, length, head dims, dims rotated, traditional)
    (4, 1, 64, 64, False),
    (9, 5, 64, 64, False),
    (2, 3, 128, 128, True),
    (2, 4, 256, 256, False),
    (3, 2, 128, 64, False),
    (3, 2, 96, 32, True),
]


def row_bound(x, steps):
    """``steps`` times each row's largest |x|: a rotated value mixes two of them."""
    return mx.max(mx.abs(x.astype(mx.float32)), axis=-1, keepdims=True) * steps


@pytest.mark.parametrize("heads, length, head_dims, dims, traditional", ROPE_CASES)
@pytest.mark.parametrize("offset", [0, 17, 8191])
def test_rope_matches_mlx(
    qmm, isa, heads, length, head_dims, dims, traditional, offset
):
    # As attention lays it out: [B, L, H, D] projected, then transposed.
    x = normal((2, length, heads, head_dims), 6).swapaxes(1, 2)
    cases = [
        dict(base=10000.0, scale=1.0, freqs=None),
        dict(base=500000.0, scale=0.25, freqs=None),
        dict(base=None, scale=1.0, freqs=mx.exp(normal((dims // 2,), 7)) * 40),
    ]
    for case in cases:
        args = dict(traditional=traditional, offset=offset, **case)
        y = qmm.rope(x, dims, **args)
        expected = MLX["rope"](x, dims, **args)
        # The same angles as MLX's (its own sine and cosine): the rotation's
        # products and sums alone round differently (fused multiply-adds).
        assert_close(y, expected, row_bound(x, 4 * 2.0**-23))


def test_rope_per_row_offsets_and_half_precision(qmm, isa):
    x = normal((3, 4, 6, 64), 8)
    offsets = mx.array([0, 5, 900])
    y = qmm.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offsets)
    for b, offset in enumerate((0, 5, 900)):
        expected = MLX["rope"](
            x[b : b + 1], 64, traditional=False, base=10000.0, scale=1.0, offset=offset
        )
        assert_close(y[b : b + 1], expected, row_bound(x[b : b + 1], 4 * 2.0**-23))
    for dtype in (mx.float16, mx.bfloat16):
        h = x.astype(dtype)
        args = dict(traditional=True, base=10000.0, scale=1.0, offset=offsets)
        expected = MLX["rope"](h, 64, **args)
        bound = row_bound(h, 3 * EPS[dtype])
        assert_close(qmm.rope(h, 64, **args), expected, bound)


def attention_bound(values, dtype=mx.float32):
    """An output is a convex combination of the values: its error is a few
    steps of float32 (and one rounding of the output's type) of their largest."""
    top = mx.max(mx.abs(values.astype(mx.float32)))
    return top * (64 * 2.0**-23 + 2 * EPS[dtype])


ATTENTION_CASES = [
    # (batch, heads, kv heads, query rows, keys, head dims)
    (1, 9, 3, 1, 1, 64),
    (1, 9, 3, 1, 300, 64),
    (2, 8, 2, 1, 37, 128),
    (1, 4, 4, 3, 60, 64),
    (1, 8, 1, 16, 129, 256),
    (2, 8, 8, 5, 2048, 64),
    # Prefill chunks: blocks of keys, rows in pairs, threes and alone, value widths
    # not a multiple of 32 or 8.
    (1, 9, 3, 77, 300, 64),
    (2, 6, 2, 40, 40, 80),
    (1, 2, 1, 33, 97, 36),
    # A long chunk: its tasks take 64 positions each.
    (1, 4, 2, 260, 300, 64),
]


@pytest.mark.parametrize("batch, heads, kv_heads, rows, keys, dims", ATTENTION_CASES)
def test_attention_matches_mlx(qmm, isa, batch, heads, kv_heads, rows, keys, dims):
    q = normal((batch, heads, rows, dims), 10)
    # Keys and values where a KV cache keeps them: the first `keys` of a larger
    # buffer (strided along the key axis).
    k = normal((batch, kv_heads, keys + 19, dims), 11)[..., :keys, :]
    v = normal((batch, kv_heads, keys + 19, dims), 12)[..., :keys, :]
    scale = dims**-0.5
    keep = mx.random.uniform(shape=(batch, 1, rows, keys), key=mx.random.key(13)) > 0.3
    sinks = normal((heads,), 14)
    masks = [None, "causal", keep, mx.where(keep, 0.0, -mx.inf), keep[0, 0]]
    for mask in masks:
        for with_sinks in (None, sinks):
            y = qmm.scaled_dot_product_attention(
                q,
                k,
                v,
                scale=scale,
                mask_mode=mask if isinstance(mask, str) else "",
                mask=None if isinstance(mask, str) else mask,
                sinks=with_sinks,
            )
            expected = MLX["scaled_dot_product_attention"](
                q, k, v, scale=scale, mask=mask, sinks=with_sinks
            )
            assert_close(y, expected, attention_bound(v))


@pytest.mark.parametrize("rows", [1, 20])
def test_attention_with_values_narrower_than_keys(qmm, isa, rows):
    """MLA's shape (key dims 192, value dims 128), and an odd value width."""
    for dims, value_dims in ((192, 128), (64, 44)):
        q, k = normal((2, 4, rows, dims), 27), normal((2, 4, 70, dims), 28)
        v = normal((2, 4, 70, value_dims), 29)
        y = qmm.scaled_dot_product_attention(
            q, k, v, scale=dims**-0.5, mask_mode="causal"
        )
        expected = MLX["scaled_dot_product_attention"](
            q, k, v, scale=dims**-0.5, mask="causal"
        )
        assert y.shape == (2, 4, rows, value_dims)
        assert_close(y, expected, attention_bound(v))


def test_attention_rows_that_mask_every_key_average_them_as_mlx_does(qmm, isa):
    q, k, v = (
        normal((1, 2, 3, 64), 15),
        normal((1, 2, 9, 64), 16),
        normal((1, 2, 9, 64), 17),
    )
    keep = mx.array([[True] * 9, [False] * 9, [False, True] + [False] * 7])
    y = qmm.scaled_dot_product_attention(q, k, v, scale=0.125, mask_mode="", mask=keep)
    expected = MLX["scaled_dot_product_attention"](q, k, v, scale=0.125, mask=keep)
    assert_close(y, expected, attention_bound(v))
    assert mx.allclose(y[:, :, 1], v.mean(axis=2), atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_attention_in_half_precision(qmm, isa, dtype):
    q, k, v = (normal((1, 8, 2, 128), seed, dtype) for seed in (18, 19, 20))
    y = qmm.scaled_dot_product_attention(q, k, v, scale=0.09, mask_mode="causal")
    expected = MLX["scaled_dot_product_attention"](q, k, v, scale=0.09, mask="causal")
    assert y.dtype == dtype
    # MLX computes in the half type itself: its scores round to it too.
    assert_close(y, expected, attention_bound(v, dtype) * 8)


def test_threads_give_the_same_attention(qmm):
    q, k, v = (
        normal((1, 16, 4, 64), 21),
        normal((1, 4, 3000, 64), 22),
        normal((1, 4, 3000, 64), 23),
    )
    outputs = []
    for threads in (1, 2, 3):
        qmm.set_threads(threads)
        outputs.append(
            qmm.scaled_dot_product_attention(q, k, v, scale=0.125, mask_mode="causal")
        )
    qmm.set_threads(2)
    # Each row is one thread's work, summed in the same order.
    assert mx.array_equal(outputs[0], outputs[1])
    assert mx.array_equal(outputs[0], outputs[2])


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m: m.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), 1e-5),
            "weight must have shape",
        ),
        (
            lambda m: m.rope(
                mx.zeros((1, 2, 8)),
                6,
                traditional=False,
                base=None,
                scale=1.0,
                offset=0,
            ),
            "Exactly one of base or freqs",
        ),
        (
            lambda m: m.rope(
                mx.zeros((1, 2, 8)),
                10,
                traditional=False,
                base=1e4,
                scale=1.0,
                offset=0,
            ),
            "dims must be positive, even and at most 8",
        ),
        (
            lambda m: m.scaled_dot_product_attention(
                mx.zeros((1, 3, 1, 8)),
                mx.zeros((1, 2, 4, 8)),
                mx.zeros((1, 2, 4, 8)),
                scale=1.0,
                mask_mode="",
            ),
            "incompatible shapes",
        ),
        (
            lambda m: m.scaled_dot_product_attention(
                mx.zeros((1, 2, 1, 8)),
                mx.zeros((1, 2, 4, 8)),
                mx.zeros((1, 2, 4, 8)),
                scale=1.0,
                mask_mode="",
                mask=mx.zeros((3, 4), mx.bool_),
            ),
            "does not broadcast",
        ),
    ],
)
def test_bad_inputs_are_refused_as_mlx_refuses_them(qmm, call, message):
    with pytest.raises(ValueError, match=message):
        call(qmm)


# The elementwise exp MLX's CPU build runs one scalar at a time.
MLX_SWIGLU = fast_ops._MLX_SWIGLU
MLX_LOGSUMEXP = fast_ops._MLX_LOGSUMEXP


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_swiglu_matches_mlx_lm(qmm, isa, dtype):
    gate = normal((3, 7, 1537), 30, dtype) * 8
    x = normal((3, 7, 1537), 31, dtype)
    expected = MLX_SWIGLU(gate, x)
    # exp to a few float32 steps (the polynomial's FMAs may differ), then MLX's
    # roundings of sigmoid, silu and the product in half precision (ours rounds
    # once), each within its dtype's step of |gate * x|.
    scale = mx.abs(gate.astype(mx.float32) * x.astype(mx.float32))
    assert_close(
        qmm.swiglu(gate, x), expected, scale * (16 * 2.0**-23 + 3 * EPS[dtype])
    )
    # Strided views: a transposed gate and every other row of x.
    g, u = normal((1537, 6), 32).T, normal((12, 1537), 33)[::2]
    expected = MLX_SWIGLU(g, u)
    assert_close(qmm.swiglu(g, u), expected, mx.abs(expected) * 16 * 2.0**-23)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_logsumexp_matches_mlx(qmm, isa, dtype):
    # A decode step's logits for 16 rows, and a short odd row.
    for shape in ((16, 49152), (2, 3, 37)):
        x = normal(shape, 34, dtype) * 6
        expected = MLX_LOGSUMEXP(x, axis=-1, keepdims=True)
        # Sums of up to 49152 terms in another order: K * eps of the total.
        bound = mx.abs(expected.astype(mx.float32)) * (
            shape[-1] * 2.0**-24 + 2 * EPS[dtype]
        )
        assert_close(qmm.logsumexp(x), expected, bound)
    edges = mx.array([[-float("inf")] * 3, [1.0, float("inf"), 0.0], [0.0, -1e30, 5]])
    assert qmm.logsumexp(edges)[:2, 0].tolist() == [-float("inf"), float("inf")]
    assert (
        abs(qmm.logsumexp(edges)[2, 0].item() - MLX_LOGSUMEXP(edges[2]).item()) < 1e-6
    )


def test_swiglu_and_logsumexp_have_mlx_gradients(qmm, isa):
    gate, x = normal((2, 33), 35) * 4, normal((2, 33), 36)

    def loss(gate, x):
        return (fast_ops.swiglu(gate, x) ** 2).sum() + fast_ops.logsumexp(
            gate * x, axis=-1
        ).sum()

    fast_ops.route_fast_ops()
    ours = mx.grad(loss, argnums=(0, 1))(gate, x)
    with fast_ops.mlx_fast_ops():
        expected = mx.grad(loss, argnums=(0, 1))(gate, x)
    for a, b in zip(ours, expected):
        assert_close(a, b, mx.abs(b) * 1e-5 + 1e-6)


def test_routed_logsumexp_keeps_mlx_shapes(qmm):
    fast_ops.route_fast_ops()
    x = normal((1, 100), 37)
    cases = [{}, {"keepdims": True}, {"axis": -1}, {"axis": [1], "keepdims": True}]
    cases += [{"axis": (-1,)}]
    for kw in cases + [{"axis": 0}]:
        y = mx.logsumexp(x, **kw)
        expected = MLX_LOGSUMEXP(x, **kw)
        assert_close(y, expected, mx.abs(expected) * 100 * 2.0**-24)
    # A scalar, and over all axes of a matrix: MLX's own.
    assert mx.logsumexp(mx.array(2.0)).item() == 2.0
    wide = normal((3, 5), 38)
    assert mx.logsumexp(wide).shape == () and mx.allclose(
        mx.logsumexp(wide), MLX_LOGSUMEXP(wide)
    )


def test_routing_puts_each_fast_op_on_one_primitive(qmm):
    assert fast_ops.route_fast_ops() == (qmm.fused_isa(), "")
    assert mx.fast.rms_norm is fast_ops.rms_norm
    # mlx-lm's swiglu, where model modules took it too, and mx.logsumexp.
    assert llama.swiglu is fast_ops.swiglu and activations.swiglu is fast_ops.swiglu
    assert mx.logsumexp is fast_ops.logsumexp
    x = normal((1, 9, 1, 64), 24)
    k = normal((1, 3, 40, 64), 25)
    y = mx.fast.scaled_dot_product_attention(x, k, k, scale=0.125, mask="causal")
    with fast_ops.mlx_fast_ops():
        expected = mx.fast.scaled_dot_product_attention(
            x, k, k, scale=0.125, mask="causal"
        )
    assert_close(y, expected, attention_bound(k))
    # Prefill chunks too.
    long = normal((1, 9, 33, 64), 26)
    y = mx.fast.scaled_dot_product_attention(long, k, k, scale=0.125, mask="causal")
    expected = MLX["scaled_dot_product_attention"](
        long, k, k, scale=0.125, mask="causal"
    )
    assert_close(y, expected, attention_bound(k))


def test_training_routes_only_the_ops_that_define_gradients(qmm, monkeypatch):
    monkeypatch.setenv(fast_ops.FAST_OPS_ENV, "off")
    fast_ops.route_fast_ops()
    assert fast_ops.route_training_ops() == ""
    monkeypatch.delenv(fast_ops.FAST_OPS_ENV)
    assert fast_ops.route_training_ops() == qmm.fused_isa()
    assert llama.swiglu is fast_ops.swiglu and mx.logsumexp is fast_ops.logsumexp
    # mx.fast's kernels have no gradients: those stay MLX's.
    assert mx.fast.rms_norm is MLX["rms_norm"] and mx.fast.rope is MLX["rope"]
    fast_ops.route_fast_ops()


def test_routing_is_off_by_switch(qmm, monkeypatch):
    fast_ops.route_fast_ops()
    monkeypatch.setenv(fast_ops.FAST_OPS_ENV, "off")
    assert fast_ops.route_fast_ops() == ("", f"off ({fast_ops.FAST_OPS_ENV})")
    assert mx.fast.rope is MLX["rope"]
    assert llama.swiglu is MLX_SWIGLU and mx.logsumexp is MLX_LOGSUMEXP
    monkeypatch.delenv(fast_ops.FAST_OPS_ENV)
    assert fast_ops.route_fast_ops() == (qmm.fused_isa(), "")
    assert mx.fast.rope is fast_ops.rope
