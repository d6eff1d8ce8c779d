"""Tokenizers kept across loads (mlx_backend/models/tokenizers.py): a reload takes
a copy that shares the built tokenizer but owns its end-of-sequence set; a changed
file builds afresh; the kept ones are bounded and Free forgets them."""

import os
import shutil

import pytest

from mlx_backend.models.tokenizers import (
    KEPT_TOKENIZERS,
    file_key,
    folder_key,
    forget_tokenizers,
    reuse_tokenizer,
)


@pytest.fixture(autouse=True)
def nothing_kept():
    forget_tokenizers()
    yield
    forget_tokenizers()


def counting(tokenizer):
    builds = []

    def build():
        builds.append(1)
        return tokenizer

    return build, builds


def test_a_reload_takes_a_copy_whose_end_tokens_are_its_own(chat_tokenizer):
    build, builds = counting(chat_tokenizer)
    first = reuse_tokenizer(("k",), build)
    second = reuse_tokenizer(("k",), build)
    assert len(builds) == 1
    assert first is not second and first is not chat_tokenizer
    assert first.eos_token_ids == second.eos_token_ids == chat_tokenizer.eos_token_ids
    # A chat format adds its end tokens to one load's tokenizer only.
    first.add_eos_token("<think>")
    think = chat_tokenizer.convert_tokens_to_ids("<think>")
    assert think in first.eos_token_ids
    assert think not in second.eos_token_ids | chat_tokenizer.eos_token_ids
    assert think not in reuse_tokenizer(("k",), build).eos_token_ids
    assert first.encode("Hello there") == chat_tokenizer.encode("Hello there")


def test_the_kept_tokenizers_are_bounded_and_free_forgets_them(chat_tokenizer):
    build, builds = counting(chat_tokenizer)
    for key in range(KEPT_TOKENIZERS + 1):
        reuse_tokenizer((key,), build)
    reuse_tokenizer((KEPT_TOKENIZERS,), build)
    assert len(builds) == KEPT_TOKENIZERS + 1
    reuse_tokenizer((0,), build)  # the oldest was dropped
    assert len(builds) == KEPT_TOKENIZERS + 2
    forget_tokenizers()
    reuse_tokenizer((0,), build)
    assert len(builds) == KEPT_TOKENIZERS + 3


def test_a_folder_is_known_by_its_tokenizer_files(folders, tmp_path):
    folder = shutil.copytree(folders["json"], tmp_path / "model")
    key = folder_key(folder, "eos")
    assert folder_key(folder, "other eos") != key
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert folder_key(folder, "eos") == key
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    assert folder_key(folder, "eos") != key


def test_a_file_is_known_by_its_identity(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    key = file_key(path)
    assert file_key(path) == key
    os.utime(path, ns=(1, 1))
    assert file_key(path) != key
