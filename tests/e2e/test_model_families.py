"""Families with caches that can't be trimmed, over gRPC: one backend loads a
hybrid (Qwen3.5: gated-delta and attention layers), a sliding-window model
(gpt-oss) and a pure recurrent one (Mamba 2) in turn. Each LoadModel names the
cache layers and the reuse, Status reports them, and a chat's second turn, sent
as LocalAI sends it (Messages through the chat template), reuses the first turn's
prompt and streams mlx-lm's greedy text."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as load_mlx_lm

import backend_pb2 as pb
from tests.family_models import WINDOW, make_family_folder
from tests.support import Server

CASES = {
    "qwen3_5": ("ArraysCache", "KVCache"),
    "gpt_oss": ("RotatingKVCache", "KVCache"),
    "mamba2": ("ArraysCache",),
}
SYSTEM = "You answer questions about the trains from Lyon to Geneva and back. " * 2


@pytest.fixture(scope="module")
def server():
    srv = Server()
    yield srv
    srv.stop()


def breakdown(server: Server) -> dict[str, int]:
    return dict(server.stub.Status(pb.HealthMessage()).memory.breakdown)


def streamed(server: Server, messages: list[dict]) -> str:
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role=m["role"], content=m["content"]) for m in messages],
        Tokens=10,
        Temperature=0.0,
    )
    return b"".join(r.message for r in server.stub.PredictStream(request)).decode()


@pytest.mark.parametrize("name", CASES)
def test_a_second_turn_reuses_the_first_over_grpc(server, tmp_path, name):
    folder = make_family_folder(tmp_path / name, name)
    result = server.stub.LoadModel(
        pb.ModelOptions(Model=str(folder), Options=["tool_parser:none"])
    )
    assert result.success, result.message
    assert "prompt state reused from snapshots at token boundaries" in result.message
    figures = breakdown(server)
    assert {
        k.split(".", 1)[1] for k in figures if k.startswith("kv_cache_layers.")
    } == (set(CASES[name]))
    assert figures["prompt_reuse_by.snapshot"] == 1

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
        {"role": "user", "content": "When does the first train leave on Sunday?"},
    ]
    first, expected = reference(messages)
    assert first > 2 * WINDOW
    reply = streamed(server, messages)
    assert reply == expected
    before = breakdown(server)["prompt_cache_reused_tokens"]
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the last one back?"},
    ]
    _, expected = reference(messages)
    assert streamed(server, messages) == expected
    assert breakdown(server)["prompt_cache_reused_tokens"] - before > 0.8 * first
