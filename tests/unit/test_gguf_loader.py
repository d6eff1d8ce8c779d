"""Unit tests for GGUF checks and the seeded sampler: the embedded model file's
bytes, never the model loaded (tests/engine/test_gguf_model.py loads it)."""

import struct

import mlx.core as mx
import pytest

from mlx_backend.models.gguf import GGUFError, check_gguf, translate_name
from mlx_backend.models.loading import ModelLoadError, default_model_path, load_model
from mlx_backend.sampling import make_seeded_sampler


@pytest.mark.parametrize(
    "name, expected",
    [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.29.ffn_down.scales", "model.layers.29.mlp.down_proj.scales"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("token_embd.biases", "model.embed_tokens.biases"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ],
)
def test_translate_name(name, expected):
    assert translate_name(name) == expected


def test_translate_name_rejects_unknown_tensors():
    # The names are the file's bytes: the message does not quote them.
    with pytest.raises(GGUFError, match="^a tensor of a layer is not one") as error:
        translate_name("blk.0.attn_qkv.weight")
    assert "attn_qkv" not in str(error.value)
    with pytest.raises(GGUFError, match="^a tensor is not one a llama model has"):
        translate_name("rope_freqs.weight")


def test_check_gguf_accepts_the_real_file():
    check_gguf(default_model_path())


def corrupt_files() -> dict[str, bytes]:
    real = default_model_path().read_bytes()
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    return {
        # mx.load crashed the process on this one: a key of 2**63 - 1 bytes.
        "huge key": header + struct.pack("<Q", 2**63 - 1),
        "huge string array": header
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<IIQ", 9, 8, 2**62),
        "unknown value type": header
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<I", 99),
        "too many tensors": b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0),
        "version 1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
        "not gguf": b"PK\x03\x04" + bytes(40),
        "empty": b"",
        "truncated header": real[:100_000],
        "truncated weights": real[: len(real) // 2],
    }


@pytest.mark.parametrize("name", list(corrupt_files()))
def test_check_gguf_refuses_corrupt_files(tmp_path, name):
    path = tmp_path / "model.gguf"
    path.write_bytes(corrupt_files()[name])
    with pytest.raises(GGUFError):
        check_gguf(path)


def test_seeded_sampler_is_deterministic_and_leaves_global_rng_alone():
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 50), key=mx.random.key(0))))
    before = mx.array(mx.random.state[0])

    def draw(seed):
        sampler = make_seeded_sampler(1.0, 0.0, 0.0, 0, seed)
        return [sampler(logprobs).item() for _ in range(20)]

    assert draw(42) == draw(42)
    assert draw(42) != draw(43)
    assert mx.array_equal(mx.random.state[0], before).item()


def test_sampler_filters_and_greedy():
    logprobs = mx.log(mx.array([[0.05, 0.6, 0.3, 0.05]]))
    top1 = make_seeded_sampler(1.0, 0.0, 0.0, 1, seed=3)
    assert {top1(logprobs).item() for _ in range(10)} == {1}
    greedy = make_seeded_sampler(0.0, 0.9, 0.1, 5, seed=None)
    assert greedy(logprobs).item() == 1
    min_p = make_seeded_sampler(1.0, 0.0, 0.4, 0, seed=3)
    assert {min_p(logprobs).item() for _ in range(30)} <= {1, 2}


def test_what_is_not_a_model_is_named_in_the_error(tmp_path):
    text = tmp_path / "model.bin"
    text.write_text("<html>404 Not Found</html>")
    empty = tmp_path / "empty"
    empty.mkdir()
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).symlink_to(default_model_path())
    (two / "tokenizer").mkdir()
    accepted = (
        "accepted: a GGUF file (by its first bytes, whatever its name), a folder "
        "with config.json (MLX or Hugging Face) or a folder holding one .gguf file"
    )
    expected = {
        text: f"a file of 26 bytes, neither a GGUF file nor a folder; {accepted}",
        empty: f"an empty folder; {accepted}",
        two: f"a folder without config.json holding a.gguf, b.gguf, tokenizer/; "
        f"{accepted}",
    }
    for path, message in expected.items():
        with pytest.raises(ModelLoadError) as error:
            load_model(str(path))
        assert str(error.value) == f"Model: could not load {str(path)!r} " + (
            f"(Model {path}: {message})"
        )
