"""End to end: hybrid, sliding-window and recurrent families (tests/family_models.py)
over an MLX distributed group of 2 ranks on loopback. gpt-oss (sliding-window and
global attention) and Qwen3.5 (gated-delta and attention layers) run tensor
parallel, which ``distributed_mode:auto`` picks, and as a pipeline: a chat's two
turns stream mlx-lm's greedy text and the second reuses the first's prompt state
from snapshots (every rank reuses alike, though a pipeline rank's own layers may
all trim). Nemotron-H and Mamba 2 have neither mlx-lm's ``shard()`` nor layers in
``model.model.layers``: every mode fails the load with a message that says so,
and the group keeps serving."""

import pytest

import backend_pb2 as pb
from mlx_backend.gpu import on_cuda
from tests.support import (
    Server,
    Worker,
    check_a_chat_reuses_its_first_turn,
    write_hostfile,
)

# A lost group ends rank 0 after this many seconds instead of 20; on CUDA a rank
# compiling a family's kernels on first use stalls longer than 5 s.
STEP_TIMEOUT = f"distributed_step_timeout:{60 if on_cuda() else 5}"


class Group:
    """Rank 0 (a backend) and a worker, joined at rank 0's first load."""

    def __init__(self, folder):
        self.hostfile = write_hostfile(folder, 2)
        self.worker = Worker(self.hostfile, 1)
        try:
            self.server = Server()
        except BaseException:
            self.worker.stop()
            raise

    def load(self, folder, mode: str) -> pb.Result:
        options = [f"hostfile:{self.hostfile}", f"distributed_mode:{mode}"]
        options += ["tool_parser:none", STEP_TIMEOUT]
        request = pb.ModelOptions(Model=str(folder), Options=options)
        return self.server.stub.LoadModel(request, timeout=180)

    def stop(self) -> None:
        self.server.stop()
        self.worker.stop()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    group = Group(tmp_path_factory.mktemp("hosts"))
    yield group
    group.stop()


def check_chat(group: Group, folder) -> None:
    figures = check_a_chat_reuses_its_first_turn(group.server.stub, folder)
    assert figures["distributed_ranks"] == 2
    # The whole model's reuse, on every rank.
    assert figures["prompt_reuse_by.snapshot"] == 1


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2"])
def test_a_family_with_no_split_is_refused(group, family_folder, name):
    folder = family_folder(name)
    why = {
        "tensor": f"mlx-lm's mlx_lm.models.{name} has no tensor-parallel shard()",
        # auto falls back to the pipeline, which names its own reason.
        "pipeline": "pipeline parallel needs the layers in model.model.layers, "
        f"which mlx_lm.models.{name} does not have",
    }
    for mode in ("tensor", "pipeline", "auto"):
        result = group.load(folder, mode)
        assert not result.success
        assert why["pipeline" if mode == "auto" else mode] in result.message
    assert group.server.stub.Health(pb.HealthMessage()).message == b"OK"
    assert group.worker.process.poll() is None


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_5"])
def test_tensor_parallel_chat_as_mlx_lm(group, family_folder, name):
    """auto picks tensor parallel; the group outlives the refusals above."""
    folder = family_folder(name)
    result = group.load(folder, "auto")
    assert result.success, result.message
    assert "tensor parallel, rank 0 of 2: 2 of 4 query heads, 1 of 2 KV" in (
        result.message
    )
    check_chat(group, folder)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_5"])
def test_pipeline_chat_as_mlx_lm(tmp_path, family_folder, name):
    """A group of its own: a failed step loses the group."""
    folder = family_folder(name)
    group = Group(tmp_path)
    try:
        result = group.load(folder, "pipeline")
        assert result.success, result.message
        assert "pipeline parallel, rank 0 of 2: layers 1-1" in result.message
        check_chat(group, folder)
    finally:
        group.stop()
