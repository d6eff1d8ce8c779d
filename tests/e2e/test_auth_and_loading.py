"""End-to-end tests on a backend started with no model and bearer auth on
(``bare_server``): calls without the token are refused, requests before LoadModel
fail, a failed load names what was tried, and an MLX folder loads, serves and is
freed."""

import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

import backend_pb2 as pb
from mlx_backend.models.loading import default_model_path
from tests.support import ANSWER, AUTH, ROOT, chat, error_of


def test_auth_is_required(bare_server):
    for metadata in (
        None,
        (("authorization", "Bearer wrong"),),
        (("authorization", "s3cret"),),
    ):
        for call, request in (
            (bare_server.stub.Health, pb.HealthMessage()),
            (bare_server.stub.PredictStream, chat()),
        ):
            error = error_of(call, request, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert bare_server.stub.Health(pb.HealthMessage(), metadata=AUTH).message == b"OK"


def test_predict_before_load_model(bare_server):
    assert (
        bare_server.stub.Status(pb.HealthMessage(), metadata=AUTH).state
        == pb.StatusResponse.UNINITIALIZED
    )
    for call in (
        bare_server.stub.Predict,
        bare_server.stub.PredictStream,
        bare_server.stub.TokenizeString,
    ):
        error = error_of(call, chat(), metadata=AUTH)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_load_failure_names_what_was_tried(bare_server):
    result = bare_server.stub.LoadModel(
        pb.ModelOptions(
            Model="missing.gguf",
            ModelPath="/nonexistent/models",
            ModelFile="/nonexistent/models/missing.gguf",
        ),
        metadata=AUTH,
    )
    assert not result.success
    assert (
        "missing.gguf" in result.message
        and "/nonexistent/models/missing.gguf" in result.message
    )
    with tempfile.TemporaryDirectory() as folder:
        broken = Path(folder) / "broken.gguf"
        broken.write_bytes(b"not a gguf file")
        result = bare_server.stub.LoadModel(
            pb.ModelOptions(Model=str(broken)), metadata=AUTH
        )
        assert not result.success and "broken.gguf" in result.message
    assert bare_server.stub.Health(pb.HealthMessage(), metadata=AUTH).message == b"OK"


def test_load_folder_and_free_releases_memory(bare_server):
    # An MLX-format folder: the exported GGUF model in mlx-lm's layout.
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_backend.models.export",
                str(default_model_path()),
                folder,
            ],
            check=True,
            cwd=ROOT,
        )
        result = bare_server.stub.LoadModel(
            pb.ModelOptions(
                Model=Path(folder).name, ModelPath=str(Path(folder).parent)
            ),
            metadata=AUTH,
        )
        assert result.success, result.message
        assert folder in result.message
    loaded = bare_server.wait_for(pb.StatusResponse.READY, metadata=AUTH)
    reply = bare_server.stub.Predict(chat(Tokens=40), metadata=AUTH)
    assert reply.message.decode() == ANSWER
    assert bare_server.stub.Free(pb.HealthMessage(), metadata=AUTH).success
    freed = bare_server.stub.Status(pb.HealthMessage(), metadata=AUTH)
    assert freed.state == pb.StatusResponse.UNINITIALIZED
    assert (
        freed.memory.breakdown["active"]
        < loaded.memory.breakdown["active"] - 50_000_000
    )
    error = error_of(bare_server.stub.Predict, chat(), metadata=AUTH)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert bare_server.stub.LoadModel(pb.ModelOptions(), metadata=AUTH).success
    assert (
        bare_server.stub.Predict(chat(Tokens=40), metadata=AUTH).message.decode()
        == ANSWER
    )
