"""Unit tests for prompt_cache_files: KV states on disk, built without a model."""

import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

import backend_pb2 as pb
import mlx_backend.caches.prompt_files as pcf
from mlx_backend.caches.prompt_files import (
    PromptCacheDir,
    confine,
    load_state,
    make_fingerprint,
    save_state,
)
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import InvalidArgument
from mlx_backend.request_parsing import parse_generation
from mlx_utils import model_signature
from python_utils import parse_options
from tests.support import (
    QUESTION,
    TINY_LLAMA,
    on_engine_thread,
    run,
    stats_after,
    text_of,
)
from tests.test_engine import QUESTIONS

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


# -- the engine: PromptCachePath and prompt_cache_dir on the embedded model ------

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, politely and in plain English." for i in range(30)
)


def files_engine(model_path: Path, *options: str) -> Engine:
    engine = Engine()
    engine.load(
        "",
        parse_options(list(options)),
        0,
        identity="default",
        model_path=str(model_path),
    ).result()
    return engine


def chat_request(engine: Engine, path: str = "", **fields):
    """A chat with a long system prompt, whose KV state file ``path`` restores
    and keeps."""
    request = pb.PredictOptions(
        Messages=[
            pb.Message(role="system", content=SYSTEM),
            pb.Message(role="user", content=fields.pop("question", QUESTION)),
        ],
        UseTokenizerTemplate=True,
        Tokens=16,
        PromptCachePath=path,
        **fields,
    )
    return parse_generation(request, engine.info)


def ask(engine: Engine, path: str = "", **fields) -> tuple[str, int, tuple]:
    """Greedy text, prompt tokens served from the prompt cache, and the prompt."""
    parsed = chat_request(engine, path, **fields)
    before = stats_after(engine)["prompt_cache_reused_tokens"]
    text = text_of(run(engine, parsed)[0])
    reused = stats_after(engine)["prompt_cache_reused_tokens"] - before
    return text, reused, parsed.prompt


def file_key(engine: Engine) -> tuple[str, int]:
    return engine._files.fingerprint, engine._files.layers


def test_a_restart_restores_the_prompt_from_its_file(tmp_path, caplog):
    engine = files_engine(tmp_path)
    try:
        text, reused, prompt = ask(engine, "prompts/system.cache")
        key = file_key(engine)
    finally:
        engine.shutdown()
    assert reused == 0 and len(prompt) > 300
    path = tmp_path / "prompts/system.cache"
    assert tuple(load_state(path, *key)[1]) == prompt
    stamp = path.stat().st_mtime_ns

    engine = files_engine(tmp_path)
    try:
        # Without the file nothing is reused; with it, all but the last token.
        assert ask(engine)[1] == 0
        assert ask(engine, "prompts/system.cache") == (text, len(prompt) - 1, prompt)
        # The file already held that prompt: it was not written again.
        assert path.stat().st_mtime_ns == stamp

        # A corrupt file is ignored with a warning, and never replaced; nor is a
        # file of LocalAI's that a request names.
        bad = tmp_path / "bad.cache"
        bad.write_bytes(b"\x00garbage" * 100)
        (tmp_path / "phi.yaml").write_text("name: phi\n")
        with caplog.at_level(logging.WARNING):
            assert ask(engine, "bad.cache")[0] == text
            assert ask(engine, "phi.yaml")[0] == text
        assert f"Ignoring the prompt cache file {bad}" in caplog.text
        assert f"{tmp_path / 'phi.yaml'} exists and is not a prompt cache" in (
            caplog.text
        )
        assert bad.read_bytes() == b"\x00garbage" * 100
        assert (tmp_path / "phi.yaml").read_text() == "name: phi\n"
        # PromptCacheAll keeps the generated tokens' state too.
        ask(engine, "all.cache", PromptCacheAll=True)
        assert len(load_state(tmp_path / "all.cache", *key)[1]) > len(prompt)
        # Read-only with no file writes none.
        ask(engine, "none.cache", PromptCacheRO=True)
        assert not (tmp_path / "none.cache").exists()
    finally:
        engine.shutdown()


def test_another_models_file_is_ignored(tmp_path, caplog):
    """A file of the same model with another KV layout (q8_0) is refused, and a
    restart with that layout restores it into quantized caches."""
    engine = files_engine(tmp_path, "kv_bits:8", "kv_group_size:32")
    try:
        text, _, prompt = ask(engine, "q8.cache")
    finally:
        engine.shutdown()
    engine = files_engine(tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            _, reused, _ = ask(engine, "q8.cache", PromptCacheRO=True)
        assert reused == 0
        assert "written for another model, tokenizer or KV cache layout" in caplog.text
    finally:
        engine.shutdown()
    engine = files_engine(tmp_path, "kv_bits:8", "kv_group_size:32")
    try:
        assert ask(engine, "q8.cache") == (text, len(prompt) - 1, prompt)
    finally:
        engine.shutdown()


def test_paths_stay_inside_the_model_folder(tmp_path):
    engine = files_engine(tmp_path / "models")
    try:
        for path in ("../outside.cache", "/etc/outside.cache", "a/../../x.cache"):
            with pytest.raises(InvalidArgument, match="PromptCachePath"):
                ask(engine, path)
    finally:
        engine.shutdown()


def test_prompt_cache_dir_keeps_the_cache_across_restarts(tmp_path):
    folder = tmp_path / "kept"
    options = (f"prompt_cache_dir:{folder}", "max_cache_entries:2")
    engine = files_engine(tmp_path, *options)
    try:
        answers = [ask(engine, question=q)[0] for q in QUESTIONS]
    finally:
        engine.shutdown()
    # Two entries at most: the oldest was evicted, and its file removed.
    assert len(list(folder.glob("*/*.safetensors"))) == 2
    engine = files_engine(tmp_path, *options)
    try:
        assert stats_after(engine)["prompt_cache_entries"] == 2
        prompts = [chat_request(engine, question=q).prompt for q in QUESTIONS]
        cached = on_engine_thread(
            engine,
            lambda *_: [
                engine._prompt_cache.cached_length(engine.info.load_id, p)
                for p in prompts
            ],
        )
        # Two whole conversations; the evicted one shares the system prompt.
        kept = [i for i, p in enumerate(prompts) if cached[i] == len(p)]
        assert len(kept) == 2
        (evicted,) = set(range(3)) - set(kept)
        assert 300 < cached[evicted] < len(prompts[evicted]) - 1
        for i in kept:
            assert ask(engine, question=QUESTIONS[i])[:2] == (
                answers[i],
                len(prompts[i]) - 1,
            )
    finally:
        engine.shutdown()


def test_a_file_the_cache_cannot_keep_is_read_once(tmp_path, caplog, monkeypatch):
    engine = files_engine(tmp_path)
    try:
        ask(engine, "system.cache")
    finally:
        engine.shutdown()
    reads = []
    real = pcf.load_state
    monkeypatch.setattr(pcf, "load_state", lambda *a: reads.append(a) or real(*a))
    engine = files_engine(tmp_path, "max_cache_entries:0")
    try:
        with caplog.at_level(logging.WARNING):
            assert ask(engine, "system.cache")[1] == 0
            assert ask(engine, "system.cache")[1] == 0
        assert len(reads) == 1
        assert "the prompt cache can't keep the" in caplog.text
    finally:
        engine.shutdown()


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
