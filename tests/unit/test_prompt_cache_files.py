"""prompt_cache_files: KV states on disk, built without a model: fingerprints,
round trips, refused and damaged files, confined paths, the prompt_cache_dir
folder, and the model signature that keys them (on a tiny llama)."""

import logging
import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

import mlx_backend.caches.prompt_files as pcf
from mlx_backend.caches.prompt_files import (
    PromptCacheDir,
    confine,
    load_state,
    make_fingerprint,
    save_state,
)
from mlx_backend.errors import InvalidArgument
from mlx_utils import model_signature
from tests.tiny_models import TINY_LLAMA

FP = make_fingerprint("org/model", {"a": 0, "b": 1}, "kv_bits=8,group=32")
OTHER_FP = make_fingerprint("org/model", {"a": 0, "b": 2}, "kv_bits=8,group=32")


class MyQuantized(QuantizedKVCache):
    """A project-style subclass: same state, a name mlx-lm does not know."""


def kv(t, seed=0):
    mx.random.seed(seed)
    return mx.random.normal((1, 2, t, 32)), mx.random.normal((1, 2, t, 32))


def state(t, seed=0):
    """Four layers of different classes holding ``t`` tokens, and those tokens."""
    layers = [
        KVCache(),
        QuantizedKVCache(32, 8),
        MyQuantized(32, 8),
        RotatingKVCache(8),
    ]
    for i, layer in enumerate(layers):
        layer.update_and_fetch(*kv(t, seed + i))
    return layers, list(range(100 + seed, 100 + seed + t))


def arrays(layer):
    return [x for _, x in tree_flatten(layer.keys_and_values())]


def assert_same(loaded, cache):
    assert [type(c) for c in loaded] == [
        KVCache,
        QuantizedKVCache,
        QuantizedKVCache,
        RotatingKVCache,
    ]
    for got, want in zip(loaded, cache):
        assert got.offset == want.offset
        assert all(mx.array_equal(a, b) for a, b in zip(arrays(got), arrays(want)))


def test_fingerprint_covers_each_part():
    fps = {
        FP,
        OTHER_FP,
        make_fingerprint("org/other", {"a": 0, "b": 1}, "kv_bits=8,group=32"),
        make_fingerprint("org/model", {"a": 0, "b": 1}, "kv_bits=4,group=32"),
    }
    assert len(fps) == 4
    assert FP == make_fingerprint("org/model", {"b": 1, "a": 0}, "kv_bits=8,group=32")


def test_round_trip(tmp_path):
    cache, tokens = state(20)
    path = tmp_path / "sub" / "prompt.bin"  # no .safetensors suffix; folder is new
    save_state(path, cache, tokens, FP)
    assert os.listdir(tmp_path / "sub") == ["prompt.bin"]
    loaded, got_tokens = load_state(path, FP, 4)
    assert got_tokens == tokens
    assert_same(loaded, cache)
    # Only the 20 used rows of the 256-row buffers are written.
    assert loaded[0].keys.shape[2] == 20
    # The loaded layers go on decoding.
    k, v = loaded[0].update_and_fetch(*kv(1, 9))
    assert k.shape[2] == 21 and loaded[0].offset == 21
    k, v = loaded[1].update_and_fetch(*kv(1, 9))
    assert k[0].shape[2] == 21


def test_save_replaces_and_rejects_wrong_offset(tmp_path):
    path = tmp_path / "p.safetensors"
    save_state(path, *state(5), FP)
    cache, tokens = state(7, seed=1)
    save_state(path, cache, tokens, FP)
    loaded, got = load_state(path, FP, 4)
    assert got == tokens
    assert_same(loaded, cache)
    with pytest.raises(ValueError, match="layer 0 holds 7 tokens"):
        save_state(path, cache, tokens[:-1], FP)
    assert os.listdir(tmp_path) == ["p.safetensors"]


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "p.safetensors"
    cache, tokens = state(5)
    save_state(path, cache, tokens, FP)
    before = path.read_bytes()

    def crash(file, *args, **kwargs):
        assert os.path.basename(file).startswith(".")  # hidden from entries()
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", crash)
    with pytest.raises(OSError, match="disk full"):
        save_state(path, *state(6, seed=3), FP)
    assert os.listdir(tmp_path) == ["p.safetensors"]
    assert path.read_bytes() == before
    assert load_state(path, FP, 4)[1] == tokens


def good_file(tmp_path):
    path = tmp_path / "p.safetensors"
    save_state(path, *state(12), FP)
    return path


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_bytes(os.urandom(3000))


def empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize(
    "spoil, fingerprint, layers, why",
    [
        (truncate, FP, 4, "unreadable"),
        (garbage, FP, 4, "unreadable"),
        (empty, FP, 4, "unreadable"),
        (None, OTHER_FP, 4, "another model"),
        (None, FP, 3, "4 layers where the model has 3"),
    ],
    ids=["truncated", "garbage", "empty", "fingerprint", "layers"],
)
def test_bad_file_is_none_with_warning(
    tmp_path, caplog, spoil, fingerprint, layers, why
):
    path = good_file(tmp_path)
    if spoil:
        spoil(path)
    with caplog.at_level(logging.WARNING, logger=pcf.__name__):
        assert load_state(path, fingerprint, layers) is None
    [record] = caplog.records
    assert str(path) in record.getMessage() and why in record.getMessage()


def test_inconsistent_tokens_is_none(tmp_path, caplog, monkeypatch):
    path = tmp_path / "p.safetensors"
    cache, tokens = state(5)
    monkeypatch.setattr(pcf, "_offset_mismatch", lambda *args: None)
    save_state(path, cache, tokens + [1], FP)  # a file a buggy writer could leave
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger=pcf.__name__):
        assert load_state(path, FP, 4) is None
    assert "holds 5 tokens but 6" in caplog.text and str(path) in caplog.text


def test_missing_file_is_none_quietly(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger=pcf.__name__):
        assert load_state(tmp_path / "nope.safetensors", FP, 4) is None
    assert caplog.records == []


def test_confine(tmp_path):
    root, other, outside = tmp_path / "root", tmp_path / "other", tmp_path / "out"
    for d in (root, other, outside):
        d.mkdir()
    assert confine("a/b.bin", [root]) == root.resolve() / "a" / "b.bin"
    assert confine(str(other / "c"), [root, other]) == other.resolve() / "c"
    (root / "link").symlink_to(outside)
    for bad in ["../x", str(outside / "x"), "link/x", "a/../../x", ".", ""]:
        with pytest.raises(InvalidArgument, match="PromptCachePath"):
            confine(bad, [root])
    with pytest.raises(InvalidArgument, match=str(root.resolve())):
        confine("../x", [root])
    with pytest.raises(InvalidArgument, match="prompt_cache_dir"):
        confine("x", [])
    with pytest.raises(InvalidArgument, match="^prompt_cache_dir"):
        confine("/x", [root], field="prompt_cache_dir")


def test_prompt_cache_dir(tmp_path, caplog):
    folder = tmp_path / "entries"
    pcd = PromptCacheDir(folder, FP, 4)
    assert list(pcd.entries(10)) == []  # no folder yet
    states = [state(t, seed=t) for t in (3, 5, 4)]
    for (cache, tokens), mtime in zip(states, (3000, 1000, 2000)):
        pcd.write(tokens, cache)
        os.utime(pcd._path(tokens), (mtime, mtime))
    # Another model's entry and a corrupt file share the folder.
    other_cache, other_tokens = state(6)
    PromptCacheDir(folder, OTHER_FP, 4).write(other_tokens, other_cache)
    (folder / "junk.safetensors").write_bytes(b"junk" * 10)
    (folder / "notes.txt").write_text("not an entry")
    # A renamed copy (remove() could not find it) and a hidden temp file.
    entry = pcd._path(states[0][1]).read_bytes()
    (folder / "copy.safetensors").write_bytes(entry)
    (folder / ".prompt-cache-x.safetensors").write_bytes(entry)

    with caplog.at_level(logging.WARNING, logger=pcf.__name__):
        got = list(pcd.entries(10))
    assert [tokens for _, tokens in got] == [states[i][1] for i in (1, 2, 0)]
    assert_same(got[0][0], states[1][0])
    assert len(caplog.records) == 3
    assert (
        "junk.safetensors" in caplog.text
        and "copy.safetensors: misnamed" in caplog.text
    )
    assert len(os.listdir(folder)) == 8  # skipped files are left alone

    pcd.remove(states[1][1])
    pcd.remove(states[1][1])  # already gone: no error
    assert [tokens for _, tokens in pcd.entries(10)] == [states[i][1] for i in (2, 0)]
    assert not (folder / pcd._path(states[1][1]).name).exists()


def test_prompt_cache_dir_reads_the_newest_entries(tmp_path):
    pcd = PromptCacheDir(tmp_path, FP, 4)
    states = [state(t, seed=t) for t in (3, 5, 4)]
    for (cache, tokens), mtime in zip(states, (3000, 1000, 2000)):
        pcd.write(tokens, cache)
        os.utime(pcd._path(tokens), (mtime, mtime))
    assert [t for _, t in pcd.entries(2)] == [states[i][1] for i in (2, 0)]
    assert list(pcd.entries(0)) == []


def test_files_that_are_not_prompt_caches_are_never_replaced(tmp_path, caplog):
    config = tmp_path / "phi.yaml"
    config.write_text("name: phi\n")
    with pytest.raises(ValueError, match="is not a prompt cache file"):
        save_state(config, *state(5), FP)
    assert config.read_text() == "name: phi\n"
    folder = tmp_path / "folder.cache"
    folder.mkdir()
    with pytest.raises(ValueError, match="is not a prompt cache file"):
        save_state(folder, *state(5), FP)
    with caplog.at_level(logging.WARNING):
        assert load_state(folder, FP, 4) is None
    assert "not a regular file" in caplog.text


def test_a_short_write_keeps_the_old_file(tmp_path, monkeypatch):
    """MLX reports no error when the disk fills: the written length is checked."""
    path = good_file(tmp_path)
    before = path.read_bytes()
    real = pcf.save_prompt_cache

    def short(file, *args):
        real(file, *args)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)

    monkeypatch.setattr(pcf, "save_prompt_cache", short)
    with pytest.raises(OSError, match="cut short"):
        save_state(path, *state(6, seed=3), FP)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_the_model_signature_follows_config_and_weights():
    """A model replaced at the same path must not take the old one's files."""
    config = {**TINY_LLAMA, "vocab_size": 64}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    first = model_signature(model, config)
    assert model_signature(model, config) == first
    assert model_signature(model, {**config, "num_key_value_heads": 4}) != first
    model.update(tree_map(lambda x: x * 1.5, model.parameters()))
    assert model_signature(model, config) != first
