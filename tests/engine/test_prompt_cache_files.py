"""Prompt cache files on a tiny llama (conftest's ``tiny_llama``), in-process: PromptCachePath restores
a prompt's KV state after a restart and refuses another model's file or a path
outside the model folder; prompt_cache_dir keeps the prompt cache across restarts.
"""

import logging
from pathlib import Path

import pytest

import backend_pb2 as pb
import mlx_backend.caches.prompt_files as pcf
from mlx_backend.caches.prompt_files import load_state
from mlx_backend.engine.engine import Engine
from mlx_backend.errors import InvalidArgument
from mlx_backend.request_parsing import parse_generation
from tests.engine_helpers import (
    load_engine,
    on_engine_thread,
    run,
    stats_after,
    text_of,
)
from tests.support import QUESTION, QUESTIONS

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, politely and in plain English." for i in range(30)
)


@pytest.fixture(params=[(), ("paged:true",)], ids=["batched", "paged"])
def files_engine(request, tiny_llama):
    """``files_engine(model_path, *options)``: an engine serving the tiny llama
    whose model folder (LocalAI's ModelPath) is ``model_path``, on the batch
    decoder and on the one-pass decoder, whose kept states hold pages."""

    def load(model_path: Path, *options: str) -> Engine:
        options = (*request.param, *options)
        return load_engine(*options, model=str(tiny_llama), model_path=str(model_path))

    return load


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
    files = engine.served.store.files
    # The fingerprint is made on first use, with MLX: on the engine thread.
    fingerprint = on_engine_thread(engine, lambda model, options: files.fingerprint)
    return fingerprint, files.layers


def test_a_restart_restores_the_prompt_from_its_file(files_engine, tmp_path, caplog):
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


def test_another_models_file_is_ignored(files_engine, tmp_path, caplog):
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


def test_paths_stay_inside_the_model_folder(files_engine, tmp_path):
    engine = files_engine(tmp_path / "models")
    try:
        for path in ("../outside.cache", "/etc/outside.cache", "a/../../x.cache"):
            with pytest.raises(InvalidArgument, match="PromptCachePath"):
                ask(engine, path)
    finally:
        engine.shutdown()


def test_prompt_cache_dir_keeps_the_cache_across_restarts(files_engine, tmp_path):
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
            lambda *_: [engine.served.store.cached_length(p) for p in prompts],
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


def test_a_file_the_cache_cannot_keep_is_read_once(
    files_engine, tmp_path, caplog, monkeypatch
):
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
