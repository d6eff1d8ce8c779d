"""Unit tests for GGUF loading and the MLX helpers, on the real embedded model file."""

import json
import shutil
import struct

import mlx.core as mx
import pytest
from mlx_lm.utils import load as load_mlx_folder

from mlx_backend.models.gguf import (
    GGUFError,
    check_gguf,
    export_mlx_folder,
    load_gguf,
    make_config,
    translate_name,
)
from mlx_backend.models.loading import ModelLoadError, default_model_path, load_model
from mlx_backend.sampling import make_seeded_sampler


@pytest.fixture(scope="module")
def gguf():
    return mx.load(str(default_model_path()), return_metadata=True)


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(default_model_path())


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


def test_make_config(gguf):
    weights, metadata = gguf
    config = make_config(metadata, weights)
    assert config == {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": pytest.approx(1e-5),
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "rope_traditional": True,
        "tie_word_embeddings": True,
    }
    with pytest.raises(GGUFError, match="'qwen2'"):
        make_config({**metadata, "general.architecture": "qwen2"}, weights)


def test_weights_stay_quantized(loaded):
    model, _, _ = loaded
    q_proj = model.model.layers[0].self_attn.q_proj
    assert (q_proj.bits, q_proj.group_size) == (4, 32)
    assert q_proj.weight.dtype == mx.uint32


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [19556, 905]),
        ("12345", [33, 34, 35, 36, 37]),  # digits are split one by one
        ("<|im_start|>user", [1, 4093]),
    ],
)
def test_tokenizer_matches_smollm2(loaded, text, ids):
    _, tokenizer, _ = loaded
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_template(loaded):
    _, tokenizer, _ = loaded
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.bos_token == "<|im_start|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_export_folder_loads_with_mlx_lm_and_matches(loaded, tmp_path):
    model, tokenizer, _ = loaded
    export_mlx_folder(default_model_path(), tmp_path)
    folder_model, folder_tokenizer = load_mlx_folder(str(tmp_path))
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert (
        folder_tokenizer.encode("The capital of France is", add_special_tokens=False)
        == ids
    )
    expected = model(mx.array([ids]))
    actual = folder_model(mx.array([ids]))
    assert mx.array_equal(expected, actual).item()


def test_dequantized_export_holds_float32_weights_that_agree(loaded, tmp_path):
    model, tokenizer, _ = loaded
    export_mlx_folder(default_model_path(), tmp_path, dequantize=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization" not in config
    folder_model, _ = load_mlx_folder(str(tmp_path))
    weight = folder_model.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == mx.float32 and weight.shape == (576, 576)
    ids = mx.array([tokenizer.encode("The capital of France is")])
    expected, actual = model(ids)[0, -1], folder_model(ids)[0, -1]
    assert mx.argmax(expected).item() == mx.argmax(actual).item()
    assert mx.abs(expected - actual).max().item() < 0.25


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


def test_a_gguf_is_recognized_by_content_whatever_its_name(tmp_path, loaded):
    """LocalAI's e2e suite downloads as model.bin; a folder may hold the file."""
    bin_file = tmp_path / "model.bin"
    shutil.copyfile(default_model_path(), bin_file)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "README.txt").write_text("one GGUF beside other files")
    (folder / "weights.gguf").symlink_to(default_model_path())
    for path in (bin_file, folder):
        result = load_model(str(path))
        assert result.config == loaded[2]
        assert result.tokenizer.encode("Paris") == loaded[1].encode("Paris")


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
