"""End-to-end: every path a LoadModel or a Predict can name is refused with what the
file is, never with its bytes. /etc/passwd, the backend's own /proc/self/environ
(which holds a marker) and a file of secret text go in as Model, ModelFile,
ModelPath/Model, DraftModel, LoraAdapter, LoraAdapters, the options hostfile and
prompt_cache_dir, and PromptCachePath; no reply holds the marker or any 8 bytes of the file.
"""

from pathlib import Path

import grpc
import pytest

import backend_pb2 as pb
from tests.quoting import MARKER, assert_not_quoted, secret_text, write_secret
from tests.support import ANSWER, MODEL, Server, chat, error_of

STILL_SERVING = "still serving default model"


@pytest.fixture(scope="module")
def srv():
    # The marker in the backend's environment makes /proc/self/environ a secret.
    server = Server("--model", "default", env={"REFUSAL_TEST_SECRET": MARKER})
    try:
        server.wait_for(pb.StatusResponse.READY)
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A ModelPath with a secret file, a planted file that is no prompt cache, and a
    folder whose config.json and tokenizer.json are secret text."""
    folder = tmp_path_factory.mktemp("models")
    write_secret(folder / "secret.txt")
    write_secret(folder / "planted.cache", seed=1)
    garbage = folder / "garbage-model"
    garbage.mkdir()
    write_secret(garbage / "config.json", seed=2)
    write_secret(garbage / "tokenizer.json", seed=3)
    return folder


TARGETS = ["/etc/passwd", "/proc/self/environ", "secret"]


def target(srv: Server, models: Path, name: str) -> tuple[str, bytes]:
    """The path a request names and the bytes the backend would read there."""
    if name == "secret":
        path = models / "secret.txt"
        return str(path), path.read_bytes()
    if name == "/proc/self/environ":
        return name, Path(f"/proc/{srv.process.pid}/environ").read_bytes()
    return name, Path(name).read_bytes()


FIELDS = {
    "Model": (lambda path: {"Model": path}, "Model: could not load", True),
    "ModelFile": (lambda path: {"ModelFile": path}, "ModelFile: could not load", True),
    "DraftModel": (
        lambda path: {"Model": "default", "DraftModel": path},
        "DraftModel: could not load",
        True,
    ),
    "LoraAdapter": (
        lambda path: {"Model": "default", "LoraAdapter": path},
        "LoraAdapter: adapter ",
        True,
    ),
    "LoraAdapters": (
        lambda path: {"Model": "default", "LoraAdapters": [path]},
        "LoraAdapters[0]: adapter ",
        True,
    ),
    # MLX's own hostfile parse error quotes the file.
    "hostfile": (
        lambda path: {"Model": "default", "Options": [f"hostfile:{path}"]},
        "Options: hostfile: ",
        True,
    ),
    # Refused before the engine sees it: nothing was tried, so no "still serving".
    "prompt_cache_dir": (
        lambda path: {"Model": "default", "Options": [f"prompt_cache_dir:{path}"]},
        "Options: prompt_cache_dir: ",
        False,
    ),
}


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("fields, field, tried", FIELDS.values(), ids=FIELDS.keys())
def test_load_fields_describe_a_file_without_quoting_it(
    srv, models, name, fields, field, tried
):
    path, content = target(srv, models, name)
    result = srv.stub.LoadModel(pb.ModelOptions(**fields(path)))
    assert not result.success
    assert field in result.message and path in result.message, result.message
    assert (STILL_SERVING in result.message) == tried, result.message
    assert_not_quoted(result.message, content, allowed=(path, MODEL))
    assert srv.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER


def test_a_file_under_model_path_is_described_without_quoting_it(srv, models):
    path, content = target(srv, models, "secret")
    result = srv.stub.LoadModel(
        pb.ModelOptions(Model="secret.txt", ModelPath=str(models))
    )
    assert not result.success
    assert f"ModelPath/Model {path}: a file of {len(content)} bytes" in result.message
    assert_not_quoted(result.message, content, allowed=(str(models), MODEL))


def test_a_folder_of_other_files_is_described_without_quoting_them(srv, models):
    folder = models / "garbage-model"
    result = srv.stub.LoadModel(pb.ModelOptions(Model=str(folder)))
    assert not result.success
    assert "config.json is not valid JSON (at line 1, column 1)" in result.message
    for seed in (2, 3):
        content = secret_text(seed).encode()
        assert_not_quoted(result.message, content, allowed=(str(folder), MODEL))


def test_prompt_cache_path_reads_only_prompt_cache_files(srv, models):
    loaded = srv.stub.LoadModel(pb.ModelOptions(Model="default", ModelPath=str(models)))
    assert loaded.success, loaded.message
    try:
        for name in TARGETS:
            path, content = target(srv, models, name)
            if name == "secret":
                # A ModelPath file, named from outside it.
                path = f"{models}/../{models.name}/../outside/{Path(path).name}"
            for call in (srv.stub.Predict, srv.stub.PredictStream):
                error = error_of(call, chat(Tokens=5, PromptCachePath=path))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details().startswith(f"PromptCachePath: {path!r}")
                assert_not_quoted(error.details(), content, allowed=(path, str(models)))

        # A file inside ModelPath that is no prompt cache is neither read past its
        # first bytes nor replaced, and the reply is the model's.
        planted = models / "planted.cache"
        before = planted.read_bytes()
        reply = srv.stub.Predict(chat(Tokens=40, PromptCachePath="planted.cache"))
        assert reply.message.decode() == ANSWER
        assert planted.read_bytes() == before
        lines = [line for line in srv.logs().splitlines() if str(planted) in line]
        assert any("not a prompt cache file" in line for line in lines), lines
        assert not any(MARKER in line for line in lines)
    finally:
        assert srv.stub.LoadModel(pb.ModelOptions(Model="default")).success
