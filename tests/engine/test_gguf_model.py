"""GGUF loading on the real embedded model file: its config, quantized weights
and tokenizer, the MLX folders it exports, and a GGUF found by its content."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.utils import load as load_mlx_folder

from mlx_backend.models.gguf import GGUFError, export_mlx_folder, load_gguf, make_config
from mlx_backend.models.loading import default_model_path, load_model


@pytest.fixture(scope="module")
def gguf():
    return mx.load(str(default_model_path()), return_metadata=True)


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(default_model_path())


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
