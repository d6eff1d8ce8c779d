"""End to end: hybrid, sliding-window and recurrent families (tests/family_models.py)
over an MLX distributed group of 2 ranks on loopback. gpt-oss (sliding-window and
global attention) and Qwen3.5 (gated-delta and attention layers) run tensor
parallel, which ``distributed_mode:auto`` picks, and as a pipeline: a chat's two
turns stream mlx-lm's greedy text and the second reuses the first's prompt state
from snapshots (every rank reuses alike, though a pipeline rank's own layers may
all trim). Nemotron-H and Mamba 2 have neither mlx-lm's ``shard()`` nor layers in
``model.model.layers``: every mode fails the load with a message that says so,
and the group keeps serving."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as load_mlx_lm

import backend_pb2 as pb
from tests.family_models import WINDOW, make_family_folder
from tests.support import Server, Worker, write_hostfile

SYSTEM = "You answer questions about the trains from Lyon to Geneva and back. " * 2
TURNS = ("When does the first train leave on Sunday?", "And the last one back?")
# A lost group ends rank 0 after this many seconds instead of 20.
STEP_TIMEOUT = "distributed_step_timeout:5"


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

    def breakdown(self) -> dict[str, int]:
        status = self.server.stub.Status(pb.HealthMessage())
        return dict(status.memory.breakdown)

    def stop(self) -> None:
        self.server.stop()
        self.worker.stop()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    group = Group(tmp_path_factory.mktemp("hosts"))
    yield group
    group.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def streamed(server: Server, messages: list[dict]) -> str:
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role=m["role"], content=m["content"]) for m in messages],
        Tokens=10,
        Temperature=0.0,
    )
    replies = server.stub.PredictStream(request, timeout=60)
    return b"".join(r.message for r in replies).decode()


def check_chat(group: Group, folder) -> None:
    """Two turns of a chat: mlx-lm's greedy text, the second turn reusing the
    first's prompt."""
    model, tokenizer = load_mlx_lm(str(folder))

    def reference(messages: list[dict]) -> tuple[int, str]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tokens = []
        for token, _ in generate_step(
            mx.array(prompt), model, max_tokens=10, sampler=make_sampler(0.0)
        ):
            if token in tokenizer.eos_token_ids:
                break
            tokens.append(token)
        return len(prompt), tokenizer.decode(tokens)

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TURNS[0]},
    ]
    first, expected = reference(messages)
    assert first > 2 * WINDOW
    reply = streamed(group.server, messages)
    assert reply == expected
    before = group.breakdown()["prompt_cache_reused_tokens"]
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": TURNS[1]},
    ]
    assert streamed(group.server, messages) == reference(messages)[1]
    figures = group.breakdown()
    assert figures["distributed_ranks"] == 2
    # The whole model's reuse, on every rank.
    assert figures["prompt_reuse_by.snapshot"] == 1
    assert figures["prompt_cache_reused_tokens"] - before > 0.8 * first


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2"])
def test_a_family_with_no_split_is_refused(group, models, name):
    folder = make_family_folder(models / name, name)
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
def test_tensor_parallel_chat_as_mlx_lm(group, models, name):
    """auto picks tensor parallel; the group outlives the refusals above."""
    folder = make_family_folder(models / name, name)
    result = group.load(folder, "auto")
    assert result.success, result.message
    assert "tensor parallel, rank 0 of 2: 2 of 4 query heads, 1 of 2 KV" in (
        result.message
    )
    check_chat(group, folder)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_5"])
def test_pipeline_chat_as_mlx_lm(tmp_path, models, name):
    """A group of its own: a failed step loses the group."""
    folder = make_family_folder(models / name, name)
    group = Group(tmp_path)
    try:
        result = group.load(folder, "pipeline")
        assert result.success, result.message
        assert "pipeline parallel, rank 0 of 2: layers 1-1" in result.message
        check_chat(group, folder)
    finally:
        group.stop()
