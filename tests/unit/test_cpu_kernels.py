"""The CPU quantized-matmul kernels (``mlx_backend/cpu/kernels``) against
``mx.dequantize`` followed by a float32 matmul, within bounds derived from their
arithmetic; their edge cases; and how the backend routes layers to them or, with the
extension missing, keeps its float32 path."""

import sys
from itertools import product

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_backend.cpu import compute_path, kernels
from mlx_backend.cpu.compute_path import prepare_for_cpu
from tests.tiny_models import tiny_quantized_llama

FLOAT32_EPS = 2.0**-24


def isas(qmm) -> list[str]:
    """The best instruction set and the portable kernels (the float kernels are
    AVX2's on every x86 set past it)."""
    best = qmm.settings()["isa"]
    return [best] if best.startswith("portable") else [best, "portable"]


def quantized(n: int, k: int, bits: int, group_size: int, dtype, seed: int):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, scales.astype(dtype), biases.astype(dtype)


def reference(x, wq, scales, biases, group_size, bits):
    """The float32 product, and each output's sum of |x| * |scale * q| (what
    rounding errors scale with)."""
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(wq, s32, b32, group_size=group_size, bits=bits)
    q = mx.dequantize(wq, s32, mx.zeros_like(b32), group_size=group_size, bits=bits)
    x = x.astype(mx.float32)
    return x @ w.T, mx.abs(x) @ mx.abs(q).T, mx.abs(x) @ mx.abs(w).T


def rounding_bound(x, wq, scales, group_size, bits, top):
    """The most that rounding x per group to integers up to ``top`` (127 for int8,
    32767 for int16) can move each output: half a step (the group's max |x| /
    top) times the group's sum of |scale * q|."""
    rows, k = x.shape
    groups = k // group_size
    step = mx.max(mx.abs(x).reshape(rows, groups, group_size), axis=-1) / top
    q = mx.dequantize(
        wq,
        scales.astype(mx.float32),
        mx.zeros_like(scales, dtype=mx.float32),
        group_size=group_size,
        bits=bits,
    )
    per_group = mx.abs(q).reshape(q.shape[0], groups, group_size).sum(axis=-1)
    return (step / 2) @ per_group.T


def int8_bound(x, wq, scales, biases, group_size, bits, block=4):
    """The most that rounding x to int8 can move each output: each ``block``
    values in the kernels' order (a 4-bit block's even values, then its odd
    ones) share a step of their largest / 127 (4 on the row kernels and the
    GEMM below 8 rows, 8 on the GEMM from 8 rows), and the biases meet the rounded
    sums, so an output moves by at most half a step times each |dequantized
    weight|."""
    rows, k = x.shape
    blocks = mx.abs(x.astype(mx.float32)).reshape(rows, k // 32, 32)
    if bits == 4:
        blocks = mx.concatenate([blocks[..., ::2], blocks[..., 1::2]], axis=-1)
    per = blocks.reshape(rows, k // 32, 32 // block, block).max(axis=-1) / 127
    step = mx.repeat(per, block, -1)
    if bits == 4:
        step = mx.stack([step[..., :16], step[..., 16:]], axis=-1)
    w = mx.dequantize(
        wq,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=group_size,
        bits=bits,
    )
    return (step.reshape(rows, k) / 2) @ mx.abs(w).T


def assert_within(y, expected, bound):
    excess = mx.abs(y - expected) - bound
    assert mx.max(excess).item() <= 0, f"exceeds its bound by {mx.max(excess).item()}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_kernels_match_dequantize_then_matmul(qmm, bits, group_size, dtype):
    """Random shapes (odd output counts, several groups) at 1, 2, 3, 4, 7, 32,
    33 and 300 rows, on each instruction set, with float32, int16 and int8
    activations (the int8 kernels on each set's dot product: the row kernels
    below 4 rows, the GEMM from 4, with x rounded per 8 values from 8 rows).
    Float32 accumulation of K products stays within K *
    eps of the sum of their magnitudes (x2: the dequantized reference rounds
    too); int16 adds at most rounding_bound, int8 int8_bound."""
    seed = bits * 1000 + group_size + {mx.float16: 1, mx.bfloat16: 2}.get(dtype, 3)
    n, k = 37 + seed % 50, group_size * (2 + seed % 5)
    wq, scales, biases = quantized(n, k, bits, group_size, dtype, seed)
    for rows in (1, 2, 3, 4, 7, 32, 33, 300):
        x = mx.random.normal((rows, k), key=mx.random.key(seed + rows))
        expected, magnitude, total = reference(x, wq, scales, biases, group_size, bits)
        float_bound = 2 * k * FLOAT32_EPS * total + 1e-6
        # Under int8, 4 rows on go to the GEMM (x rounded per 8 values from 8
        # rows). Else the row kernels run up to the row limit, and more rows go to
        # sgemm tiles, or without a fast BLAS to the row kernels in blocks of the
        # limit.
        many = rows > qmm.settings()["rows_limit"]
        for isa, sgemm in product(qmm.isas(), (True, False) if many else (True,)):
            qmm.set_isa(isa)
            qmm.use_sgemm(sgemm)
            for activations in ("float32", "int16", "int8"):
                if activations != "int8" and isa not in isas(qmm):
                    continue
                qmm.set_activations(activations)
                y = qmm.quantized_matmul(x, wq, scales, biases, group_size, bits)
                assert y.shape == (rows, n) and y.dtype == mx.float32
                bound = float_bound
                used = qmm.settings()["activations"]
                rounded = not many or not qmm.settings()["sgemm"]
                if used == "int8" or (used == "int16" and rounded):
                    if used == "int8":
                        block = 8 if rows >= 8 else 4
                        extra = int8_bound(
                            x, wq, scales, biases, group_size, bits, block
                        )
                    else:
                        extra = rounding_bound(x, wq, scales, group_size, bits, 32767)
                    bound = bound + extra
                assert_within(y, expected, bound)
    qmm.set_isa("auto")
    qmm.use_sgemm(True)
    qmm.set_activations("float32")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [5, 13, 41])
def test_int8_gemm_matches_the_portable_arithmetic(qmm, bits, rows):
    """From 4 rows on, int8 products take the GEMM: on each instruction set it
    gives the portable kernel's sums on the same rounded x (a scale per 4 values
    at 5 rows, a small batch's; per 8 at 13, a batch's, and 41, a prompt's)
    within float32
    rounding, over weight rows that leave a part panel (not a multiple of 16),
    rows of x that leave a part tile, several groups of f16 scales, and an x
    whose blocks' scales differ by 10^4 (a wrong block scale or a dropped bias
    term moves outputs by far more)."""
    n, k, group_size = 53, 64 * 5, 64
    wq, scales, biases = quantized(n, k, bits, group_size, mx.float16, 21)
    x = mx.random.normal((rows, k), key=mx.random.key(22))
    x = x * mx.repeat(mx.array([1e-2, 1.0, 1e2, 0.5, 3.0] * 2), 32)
    _, _, total = reference(x, wq, scales, biases, group_size, bits)
    qmm.set_activations("int8")
    products = {}
    for isa in qmm.isas():
        qmm.set_isa(isa)
        products[isa] = qmm.quantized_matmul(x, wq, scales, biases, group_size, bits)
        mx.eval(products[isa])
    qmm.set_isa("auto")
    qmm.set_activations("float32")
    portable = products.pop("portable")
    assert not mx.array_equal(portable, reference(x, wq, scales, biases, 64, bits)[0])
    for isa, y in products.items():
        if bits == 8 and isa == "avx2":
            continue  # 8-bit codes stay on float32 there (maddubs saturates).
        assert_within(y, portable, 2 * k * FLOAT32_EPS * total + 1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_wide_tiles_over_long_rows_and_chunks(qmm, bits):
    """Batches of 8 rows or more take the wide tiles, which go over weight rows in
    chunks and over K in spans: rows longer than a span with an odd number of 32s,
    outputs not a multiple of the chunk, and leftover rows after the wide tiles
    all stay within the float32 bound, on each instruction set."""
    n, k = 45, 32 * 33
    wq, scales, biases = quantized(n, k, bits, 32, mx.float16, 17)
    for rows in (8, 13, 16, 27):
        x = mx.random.normal((rows, k), key=mx.random.key(rows))
        expected, _, total = reference(x, wq, scales, biases, 32, bits)
        for isa in isas(qmm):
            qmm.set_isa(isa)
            y = qmm.quantized_matmul(x, wq, scales, biases, 32, bits)
            assert_within(y, expected, 2 * k * FLOAT32_EPS * total + 1e-6)
    qmm.set_isa("auto")


def test_threads_give_the_same_products(qmm):
    wq, scales, biases = quantized(1000, 512, 4, 32, mx.float16, 7)
    x = mx.random.normal((3, 512), key=mx.random.key(8))
    products = []
    for threads in (1, 2, 3):
        qmm.set_threads(threads)
        products.append(qmm.quantized_matmul(x, wq, scales, biases, 32, 4))
        # Evaluated under the setting (MLX is lazy).
        mx.eval(products[-1])
    assert qmm.settings()["threads"] == 3
    qmm.set_threads(2)
    # Each output is one thread's work, summed in the same order.
    assert mx.array_equal(products[0], products[1])
    assert mx.array_equal(products[0], products[2])


def test_the_pool_runs_each_task_once_whatever_the_last_run_left(qmm):
    """Runs of many tasks and of few back to back, on more threads than cores,
    so that workers come late for runs: each task runs once, and none still runs
    when its run returns. A worker's stale claim could take a task of the next
    run before it was published (with that run's task count): the count of tasks
    done ran ahead, and a server crashed in a task reading a returned frame."""
    threads = qmm.settings()["threads"]
    qmm.set_threads(4)
    try:
        assert qmm.check_pool(20000) == 0
    finally:
        qmm.set_threads(threads)


def test_leading_axes_dtypes_and_views(qmm):
    wq, scales, biases = quantized(64, 256, 4, 64, mx.bfloat16, 11)
    x = mx.random.normal((2, 3, 256), key=mx.random.key(12))
    expected = reference(x.reshape(6, 256), wq, scales, biases, 64, 4)[0]
    y = qmm.quantized_matmul(x, wq, scales, biases, 64, 4)
    assert y.shape == (2, 3, 64)
    assert mx.allclose(y.reshape(6, 64), expected, atol=1e-3)
    half = qmm.quantized_matmul(x.astype(mx.float16), wq, scales, biases, 64, 4)
    assert half.dtype == mx.float16
    # A weight that is not contiguous (every other row), and x transposed twice.
    rows = wq[::2]
    picked = (rows, scales[::2], biases[::2], 64, 4)
    y = qmm.quantized_matmul(x.swapaxes(0, 1), *picked)
    expected = reference(x.swapaxes(0, 1).reshape(6, 256), *picked)[0]
    assert mx.allclose(y.reshape(6, 32), expected, atol=1e-3)


def test_nan_and_inf_scales_reach_only_their_rows(qmm):
    wq, scales, biases = quantized(16, 128, 4, 32, mx.float16, 13)
    scales[3, 1] = mx.nan
    scales[5, 0] = mx.inf
    x = mx.random.normal((4, 128), key=mx.random.key(14))
    y = qmm.quantized_matmul(x, wq, scales, biases, 32, 4)
    finite = mx.isfinite(y)
    assert not finite[:, 3].any().item() and not finite[:, 5].any().item()
    assert finite[:, [0, 1, 2, 4, 6]].all().item()


def test_two_bit_weights_under_int8_take_the_float32_kernel(qmm):
    """The int8 kernels take 4- and 8-bit codes; 2-bit ones (the portable
    kernel's) stay on float32 x, within its bound."""
    wq, scales, biases = quantized(24, 128, 2, 32, mx.float16, 19)
    x = mx.random.normal((3, 128), key=mx.random.key(20))
    expected, _, total = reference(x, wq, scales, biases, 32, 2)
    qmm.set_activations("int8")
    y = qmm.quantized_matmul(x, wq, scales, biases, 32, 2)
    mx.eval(y)
    qmm.set_activations("float32")
    assert_within(y, expected, 2 * 128 * FLOAT32_EPS * total + 1e-6)


def test_unknown_activations_are_refused(qmm):
    with pytest.raises(ValueError, match="activations must be float32, int16 or int8"):
        qmm.set_activations("int4")


@pytest.mark.parametrize(
    "args, message",
    [
        ((mx.zeros((2, 100)), 4, 32), "last axis must be 128"),
        ((mx.zeros((2, 128)), 3, 32), "bits must be 2, 4 or 8"),
        ((mx.zeros((2, 128)), 4, 48), "group_size must be a multiple of 32"),
    ],
)
def test_bad_shapes_are_refused(qmm, args, message):
    wq, scales, biases = quantized(8, 128, 4, 32, mx.float16, 15)
    x, bits, group_size = args
    with pytest.raises(ValueError, match=message):
        qmm.quantized_matmul(x, wq, scales, biases, group_size, bits)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_quantized_rows_match_the_dequantized_lookup(qmm, bits, dtype):
    """An embedding's lookup as one node: each instruction set's rows equal
    mx.dequantize's (up to the fused multiply-add), for any index shape, int32 or
    uint32 or a strided view; rows outside the table are zeros."""
    wq, scales, biases = quantized(40, 192, bits, 64, dtype, bits)
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    table = mx.dequantize(wq, s32, b32, group_size=64, bits=bits)
    picks = mx.array([[3, 39, 0], [7, 7, 12]])
    for isa in isas(qmm):
        qmm.set_isa(isa)
        for indices in (picks, picks.astype(mx.uint32), picks.T, picks[:, ::2]):
            rows = qmm.quantized_rows(indices, wq, scales, biases, 64, bits)
            assert rows.shape == (*indices.shape, 192) and rows.dtype == mx.float32
            assert mx.allclose(rows, table[indices], rtol=1e-6, atol=1e-6)
        outside = qmm.quantized_rows(
            mx.array([40, -1, 2]), wq, scales, biases, 64, bits
        )
        assert not outside[:2].any().item() and outside[2].any().item()
    qmm.set_isa("auto")
    with pytest.raises(ValueError, match="indices must be int32 or uint32"):
        qmm.quantized_rows(mx.array([1.0]), wq, scales, biases, 64, bits)


def tiny_quantized_model(bits: int = 4, group_size: int = 32) -> nn.Module:
    model = nn.Sequential(nn.Embedding(50, 64), nn.Linear(64, 96), nn.Linear(96, 64))
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_sibling_products_in_one_call_match_each_alone(qmm, rows, activations):
    # q, k and v of the default model's shapes; 5 rows go to the int8 GEMM under
    # int8, 40 to sgemm tiles or (int8) the GEMM.
    weights = [quantized(n, 576, 4, 32, mx.float16, 30 + n) for n in (576, 192, 192)]
    x = mx.random.normal((rows, 576), key=mx.random.key(31))
    qmm.set_activations(activations)
    together = qmm.quantized_matmuls(x, *zip(*weights), 32, 4)
    alone = [qmm.quantized_matmul(x, *w, 32, 4) for w in weights]
    # Evaluated under the setting (MLX is lazy).
    mx.eval(together, alone)
    qmm.set_activations("float32")
    # int8 moved them (the setting was in effect).
    float32 = qmm.quantized_matmul(x, *weights[0], 32, 4)
    assert mx.array_equal(together[0], float32) == (activations == "float32")
    assert [y.shape for y in together] == [(rows, 576), (rows, 192), (rows, 192)]
    # The same kernels over the same rows, summed in the same order.
    assert all(mx.array_equal(a, b) for a, b in zip(together, alone))


def test_siblings_share_one_call_and_stop_when_a_family_calls_them_apart(qmm):
    model = tiny_quantized_llama()
    tokens = mx.array([[1, 2, 3, 4]])
    kernels.use_kernels(model)
    attention = model.layers[0].self_attn
    assert type(attention.k_proj) is kernels.KernelSiblingLinear
    assert type(model.layers[1].mlp.up_proj) is kernels.KernelSiblingLinear
    shared = model(tokens)
    for layer in model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            layer.self_attn[name].__class__ = kernels.KernelQuantizedLinear
        for name in ("gate_proj", "up_proj"):
            layer.mlp[name].__class__ = kernels.KernelQuantizedLinear
    assert mx.array_equal(model(tokens), shared)
    # Called on different inputs, the siblings compute their own from then on.
    kernels.share_inputs(model)
    x, other = mx.ones((1, 64)), mx.zeros((1, 64))
    alone = kernels.KernelQuantizedLinear.__call__
    k = attention.k_proj(x)
    assert mx.array_equal(attention.q_proj(other), alone(attention.q_proj, other))
    assert not attention.q_proj.shared_input.on
    assert mx.array_equal(k, alone(attention.k_proj, x))


def test_use_kernels_routes_the_formats_they_take(qmm):
    model = tiny_quantized_model()
    before = model.layers[1](mx.ones((1, 64)))
    assert kernels.use_kernels(model) == 3
    assert type(model.layers[1]) is kernels.KernelQuantizedLinear
    assert isinstance(model.layers[1], nn.QuantizedLinear)
    assert mx.allclose(model.layers[1](mx.ones((1, 64))), before, atol=0.05)
    # Embeddings come out in float32, as on the dequantized path.
    assert model.layers[0](mx.array([1, 2])).dtype == mx.float32
    # 3-bit weights stay on MLX's kernels.
    assert kernels.use_kernels(tiny_quantized_model(bits=3)) == 0


def test_prepare_for_cpu_picks_the_kernels_then_explains_the_fallbacks(
    qmm, monkeypatch
):
    model, path = prepare_for_cpu(tiny_quantized_model(), None, None)
    assert "quantized weights on SIMD kernels" in path.description
    assert path.kernel_isa == qmm.settings()["isa"]
    assert path.breakdown()["cpu_kernels"] == 1
    assert path.breakdown()[f"cpu_kernel_isa_{path.kernel_isa.split()[0]}"] == 1
    assert "float32 activations" in path.description
    # A prompt's rows go to sgemm tiles on a fast BLAS only.
    assert qmm.settings()["sgemm"] == path.fast_blas
    with monkeypatch.context() as patch:
        patch.setattr(compute_path, "fast_blas_in_use", lambda environ: None)
        _, path = prepare_for_cpu(tiny_quantized_model(), None, None)
        assert "reference BLAS" in path.description and not qmm.settings()["sgemm"]
    qmm.use_sgemm(True)
    _, path = prepare_for_cpu(tiny_quantized_model(), None, None, activations="int8")
    assert "int8 activations" in path.description
    assert qmm.settings()["activations"] == "int8"
    prepare_for_cpu(tiny_quantized_model(), None, None)
    assert qmm.settings()["activations"] == "float32"
    _, path = prepare_for_cpu(tiny_quantized_model(), True, None)
    assert "dequantized to float32" in path.description and not path.kernel_isa
    _, path = prepare_for_cpu(tiny_quantized_model(bits=3), None, None)
    assert "SIMD kernels: no layer in a format they take" in path.description
    monkeypatch.setenv(kernels.KERNELS_ENV, "off")
    _, path = prepare_for_cpu(tiny_quantized_model(), None, None)
    assert f"SIMD kernels: off ({kernels.KERNELS_ENV})" in path.description


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="elsewhere: not on the CPU")
def test_a_missing_extension_is_named_and_the_float32_path_taken(monkeypatch):
    # As when the build failed: the import finds no module.
    monkeypatch.setitem(sys.modules, "mlx_backend.cpu.kernels._qmm", None)
    module, why = kernels.load_kernels()
    assert (
        module is None
        and why == "the kernel extension is not built (make install builds it)"
    )
    model, path = prepare_for_cpu(tiny_quantized_model(), None, None)
    assert not path.kernel_isa and path.breakdown()["cpu_kernels"] == 0
    assert "SIMD kernels: the kernel extension is not built" in path.description
    assert kernels.kernel_settings() is None
