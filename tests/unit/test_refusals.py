"""Refusals describe a file and never quote it: model folders whose config,
tokenizer or chat template is some other file, GGUF files that are garbage after a
valid magic, adapters and prompt cache files that are not, and the error summaries
backend.py sends for anything else. Every file holds a marker that no message may
show, nor any 8 bytes of the file."""

import asyncio
import json
import logging
import os
import shutil
import struct
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import pytest

import backend_pb2 as pb
import mlx_backend.caches.prompt_files as pcf
from backend import BackendServicer
from mlx_backend.caches.prompt_files import confine, load_state
from mlx_backend.distributed.group import check_hostfile
from mlx_backend.errors import InvalidArgument
from mlx_backend.models.gguf import GGUFError, make_config, make_hf_tokenizer
from mlx_backend.models.loading import ModelLoadError, load_model
from mlx_backend.models.lora import Adapter, AdapterError, apply_adapters
from mlx_backend.refusals import Described, describe_error, describe_path
from mlx_backend.request_parsing import check_prompt_cache_dir
from tests.quoting import MARKER, assert_not_quoted, secret_text, write_secret
from tests.tiny_models import make_tiny_draft, tiny_model, write_adapter

SECRET = secret_text()
Q_PROJ = "model.layers.0.self_attn.q_proj"


def refusal(call) -> str:
    with pytest.raises(Exception) as error:
        call()
    return str(error.value)


# -- model folders ---------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny llama folder that loads, with the default model's tokenizer and chat
    template."""
    return make_tiny_draft(tmp_path_factory.mktemp("tiny") / "base")


def edit_json(name: str, **changes):
    """An edit that sets JSON fields of ``name``: it plants their values."""

    def edit(folder: Path) -> None:
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit, "".join(map(str, changes.values())).encode()


def replace(name: str, content: str | bytes):
    """An edit that replaces ``name``: it plants all of ``content``."""
    data = content if isinstance(content, bytes) else content.encode()

    def edit(folder: Path) -> None:
        (folder / name).write_bytes(data)

    return edit, data


BROKEN_TEMPLATE = "{{ messages }}\n{% " + MARKER + " %}\n" + SECRET
FOLDERS = {
    "config garbage": (
        replace("config.json", SECRET),
        "config.json is not valid JSON (at line 1, column 1)",
    ),
    "config not an object": (
        replace("config.json", json.dumps([MARKER])),
        "config.json is not a JSON object",
    ),
    "model_type": (
        edit_json("config.json", model_type=MARKER),
        "config.json's model_type is not one that mlx-lm",
    ),
    "model_file": (
        edit_json("config.json", model_file=MARKER),
        "(model_file); the option trust_remote_code:true allows that",
    ),
    "config value": (
        edit_json("config.json", eos_token_id=MARKER),
        "mlx-lm could not load: StrictDataclassFieldValidationError, details in",
    ),
    "weights": (
        replace("model.safetensors", SECRET),
        "model.safetensors is not a safetensors file",
    ),
    "tokenizer.json": (
        replace("tokenizer.json", SECRET),
        "tokenizer.json is not valid JSON (at line 1, column 1)",
    ),
    "tokenizer.json's model": (
        edit_json("tokenizer.json", model={"type": MARKER}),
        "mlx-lm could not load: Exception, details in the server log",
    ),
    "tokenizer_config.json": (
        replace("tokenizer_config.json", SECRET),
        "tokenizer_config.json is not valid JSON",
    ),
    "tokenizer_config.json not UTF-8": (
        replace("tokenizer_config.json", b"\xff\xfe" + SECRET.encode()),
        "tokenizer_config.json is not UTF-8 text",
    ),
    "special_tokens_map.json": (
        replace("special_tokens_map.json", SECRET),
        "special_tokens_map.json is not valid JSON",
    ),
    "template in tokenizer_config.json": (
        edit_json("tokenizer_config.json", chat_template=BROKEN_TEMPLATE),
        "the chat_template of tokenizer_config.json is not a valid Jinja template "
        "(at line 2)",
    ),
    "chat_template.jinja not Jinja": (
        replace("chat_template.jinja", BROKEN_TEMPLATE),
        "chat_template.jinja is not a valid Jinja template (at line 2)",
    ),
    "chat_template.jinja a copy": (
        replace("chat_template.jinja", SECRET),
        "chat_template.jinja is not a chat template: it never reads the messages",
    ),
}


@pytest.mark.parametrize("edit, why", FOLDERS.values(), ids=FOLDERS.keys())
def test_a_folder_whose_files_are_not_a_model_is_described(tmp_path, base, edit, why):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    change, planted = edit
    change(folder)
    message = refusal(lambda: load_model(str(folder)))
    assert message.startswith(f"Model: could not load {str(folder)!r} (Model {folder}")
    assert why in message, message
    assert_not_quoted(message, planted, allowed=(str(folder),))


def test_the_base_folder_loads(base):
    # The refusals above come from the edits, not from the folder.
    assert load_model(str(base)).config["model_type"] == "llama"


# -- GGUF files ------------------------------------------------------------------


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def gguf(metadata: dict, tensors: list) -> bytes:
    """A GGUF v3 file: string and uint32 metadata, (name, type, shape, bytes) tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        if isinstance(value, str):
            out += _string(key) + struct.pack("<I", 8) + _string(value)
        else:
            out += _string(key) + struct.pack("<II", 4, value)
    data = b""
    for name, kind, shape, raw in tensors:
        dims = b"".join(struct.pack("<Q", d) for d in shape)
        out += _string(name) + struct.pack("<I", len(shape)) + dims
        out += struct.pack("<IQ", kind, len(data))
        data += raw + bytes(-len(raw) % 32)
    return out + bytes(-len(out) % 32) + data


LLAMA = {
    "general.architecture": "llama",
    "llama.attention.head_count": 1,
    "llama.embedding_length": 4,
    "llama.block_count": 1,
    "llama.feed_forward_length": 4,
    "llama.vocab_size": 4,
}
GGUFS = {
    "garbage after the magic": (
        b"GGUF" + SECRET.encode(),
        "not a GGUF file of version 2 or 3",
    ),
    "garbage after the version": (
        b"GGUF" + struct.pack("<I", 3) + SECRET.encode(),
        "the file is truncated or corrupt at byte",
    ),
    "architecture": (
        gguf({"general.architecture": MARKER}, [("x", 0, [4], bytes(16))]),
        "the GGUF architecture is not supported (only 'llama' is)",
    ),
    "tensor type": (
        gguf(LLAMA, [(MARKER, 12, [256], bytes(144))]),
        "tensor 0 is of type Q4_K; MLX reads F32, F16, Q4_0, Q4_1, Q8_0",
    ),
    "tensor name": (
        gguf(LLAMA, [(f"{MARKER}.weight", 0, [4], bytes(16))]),
        "a tensor is not one a llama model has",
    ),
}


@pytest.mark.parametrize("content, why", GGUFS.values(), ids=GGUFS.keys())
def test_a_gguf_that_is_garbage_is_described(tmp_path, content, why):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    message = refusal(lambda: load_model(str(path)))
    assert f"Model {path}: a GGUF file that can't be loaded: {why}" in message
    # The structure is ours, its words (architecture, ...) too: what was planted is
    # the marker and the secret text.
    assert_not_quoted(message, SECRET.encode(), allowed=(str(path),))


def test_gguf_names_only_what_it_knows():
    assert "'qwen2'" in refusal(
        lambda: make_config({"general.architecture": "qwen2"}, {})
    )
    message = refusal(lambda: make_hf_tokenizer({"tokenizer.ggml.model": MARKER}))
    assert (
        message
        == "the GGUF tokenizer model is not supported (only byte-level BPE 'gpt2')"
    )
    assert "'llama'" in refusal(
        lambda: make_hf_tokenizer({"tokenizer.ggml.model": "llama"})
    )
    assert issubclass(GGUFError, Described)


# -- LoRA adapters ---------------------------------------------------------------

ADAPTERS = {
    "config garbage": (
        {"adapter_config.json": SECRET},
        "adapter_config.json is not valid JSON (at line 1, column 1)",
    ),
    "config not UTF-8": (
        {"adapter_config.json": b"\xff" + SECRET.encode()},
        "adapter_config.json is not UTF-8 text",
    ),
    "fine_tune_type": (
        {"adapter_config.json": json.dumps({"fine_tune_type": SECRET})},
        "fine_tune_type is not supported; only lora adapters can be combined",
    ),
    "weights garbage": (
        {"adapters.safetensors": SECRET},
        "adapters.safetensors is not a safetensors file MLX reads (",
    ),
    "a module the model lacks": (
        {f"{SECRET}.lora_a": mx.ones((32, 4)), f"{SECRET}.lora_b": mx.ones((4, 32))},
        "adapters.safetensors adapts a module the model does not have",
    ),
    "not a LoRA tensor": (
        {f"{Q_PROJ}.{MARKER}": mx.ones((4, 4))},
        f"holds a tensor for {Q_PROJ} that is not a LoRA tensor (lora_a or lora_b)",
    ),
}


@pytest.mark.parametrize("spoil, why", ADAPTERS.values(), ids=ADAPTERS.keys())
def test_an_adapter_that_is_garbage_is_described(tmp_path, spoil, why):
    folder = write_adapter(tmp_path / "adapter", seed=0)
    tensors = {k: v for k, v in spoil.items() if isinstance(v, mx.array)}
    if tensors:
        mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
    for name, content in spoil.items():
        if not isinstance(content, mx.array):
            data = content if isinstance(content, bytes) else content.encode()
            (folder / name).write_bytes(data)
    adapter = Adapter(folder, named_by="LoraAdapters[0]")
    with pytest.raises(AdapterError) as error:
        apply_adapters(tiny_model(), [adapter])
    message = str(error.value)
    assert message.startswith(f"LoraAdapters[0]: adapter {folder}")
    assert why in message, message
    # What was planted: the secret text (a tensor named by the model's own module
    # may be named, the rest of it not).
    assert_not_quoted(message, SECRET.encode(), allowed=(str(folder),))


def test_an_adapter_that_is_a_file_is_described(tmp_path):
    path = write_secret(tmp_path / "adapter")
    message = refusal(lambda: apply_adapters(tiny_model(), [Adapter(path)]))
    size = path.stat().st_size
    assert f"adapter {path}: a file of {size} bytes, not a folder; accepted:" in message
    assert_not_quoted(message, path.read_bytes(), allowed=(str(path),))


# -- prompt cache files ----------------------------------------------------------


def test_a_planted_prompt_cache_file_is_never_read_nor_quoted(tmp_path, caplog):
    planted = write_secret(tmp_path / "planted.cache")
    # A safetensors file, but not one save_state wrote.
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"x": mx.ones(2)}, {"note": SECRET})
    with caplog.at_level(logging.DEBUG, logger=pcf.__name__):
        assert load_state(planted, "fingerprint", 4) is None
        assert load_state(foreign, "fingerprint", 4) is None
    assert f"{planted}: unreadable, not a prompt cache file (a file of" in caplog.text
    assert f"{foreign}: unreadable, not a prompt cache file" in caplog.text
    assert MARKER not in caplog.text


def test_prompt_cache_paths_are_refused_by_field(tmp_path):
    for path in ("/etc/passwd", "/proc/self/environ", "../secret"):
        message = refusal(lambda: confine(path, [tmp_path]))
        assert message.startswith(f"PromptCachePath: {path!r} is not inside")
    secret = write_secret(tmp_path / "secret")
    message = refusal(lambda: check_prompt_cache_dir(str(secret)))
    assert message == (
        f"Options: prompt_cache_dir: {secret} is a file of "
        f"{secret.stat().st_size} bytes, not a folder"
    )
    check_prompt_cache_dir(str(tmp_path))
    check_prompt_cache_dir(str(tmp_path / "not yet"))


def test_a_hostfile_that_is_not_one_is_described(tmp_path):
    secret = write_secret(tmp_path / "hosts.json")
    message = refusal(lambda: check_hostfile(secret))
    assert message == (
        f"Options: hostfile: {secret}: hosts.json is not valid JSON (at line 1, "
        "column 1); MLX's hostfile is a JSON list of the ranks' hosts"
    )
    os.mkfifo(tmp_path / "fifo")
    assert ": a named pipe;" in refusal(lambda: check_hostfile(tmp_path / "fifo"))
    hosts = tmp_path / "ok.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    check_hostfile(hosts)


# -- describing paths and errors -------------------------------------------------


def test_paths_are_described_by_kind_and_size(tmp_path):
    secret = write_secret(tmp_path / "secret")
    (tmp_path / "empty").write_bytes(b"")
    os.mkfifo(tmp_path / "fifo")  # never opened: a read would block
    environ = Path("/proc/self/environ")
    read = len(environ.read_bytes())
    assert describe_path(secret) == f"a file of {secret.stat().st_size} bytes"
    assert describe_path(tmp_path / "empty") == "an empty file"
    assert describe_path(tmp_path) == "a folder"
    assert describe_path(tmp_path / "fifo") == "a named pipe"
    assert describe_path(Path("/dev/null")) == "a character device"
    # /proc reports 0 bytes: the bytes a read gives are counted (the environment
    # may change by a few bytes between the two reads).
    described = describe_path(environ)
    assert described.startswith("a file that reports 0 bytes but reads ")
    assert abs(int(described.split()[-2]) - read) < 64
    assert describe_path(tmp_path / "missing").startswith("no such file or directory")
    assert describe_path(tmp_path / "nul\0byte") == "not a valid path"


def test_errors_are_summarized_without_their_text():
    try:
        json.loads(SECRET)
    except json.JSONDecodeError as e:
        assert describe_error(e) == "not valid JSON (at line 1, column 1)"
    try:
        (b"\xff" + SECRET.encode()).decode()
    except UnicodeDecodeError as e:
        assert describe_error(e) == "not UTF-8 text"
    assert describe_error(ValueError(SECRET)) == "ValueError, details in the server log"
    assert describe_error(KeyError(MARKER)) == "KeyError, details in the server log"
    assert describe_error(ModelLoadError("Model: said")) == "Model: said"
    assert describe_error(InvalidArgument("Options: said")) == "Options: said"
    error = FileNotFoundError(2, "No such file or directory", "/x")
    assert describe_error(error) == "no such file or directory: /x"


def test_load_model_replies_describe_any_error():
    class Engine:
        info = None

        def count_beside(self, lent):
            pass

        def load(self, plan):
            future = Future()
            future.set_exception(
                RuntimeError(f"[json.exception] last read: '{SECRET}'")
            )
            return future

    result = asyncio.run(BackendServicer(Engine()).load(pb.ModelOptions(Model="x")))
    assert not result.success
    assert result.message == (
        "LoadModel failed: RuntimeError, details in the server log; "
        "no model is loaded"
    )
