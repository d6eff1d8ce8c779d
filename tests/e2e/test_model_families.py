"""Families with caches that can't be trimmed, over gRPC: one backend loads a
hybrid (Qwen3.5: gated-delta and attention layers), a sliding-window model
(gpt-oss) and a pure recurrent one (Mamba 2) in turn. Each LoadModel names the
cache layers and the reuse, Status reports them, and a chat's second turn, sent
as LocalAI sends it (Messages through the chat template), reuses the first turn's
prompt and streams mlx-lm's greedy text."""

import pytest

import backend_pb2 as pb
from tests.support import check_a_chat_reuses_its_first_turn

CASES = {
    "qwen3_5": ("ArraysCache", "KVCache"),
    "gpt_oss": ("RotatingKVCache", "KVCache"),
    "mamba2": ("ArraysCache",),
}


@pytest.mark.parametrize("name", CASES)
def test_a_second_turn_reuses_the_first_over_grpc(server, family_folder, name):
    folder = family_folder(name)
    result = server.stub.LoadModel(
        pb.ModelOptions(Model=str(folder), Options=["tool_parser:none"])
    )
    assert result.success, result.message
    assert "prompt state reused from snapshots at token boundaries" in result.message
    figures = check_a_chat_reuses_its_first_turn(server.stub, folder)
    assert {
        k.split(".", 1)[1] for k in figures if k.startswith("kv_cache_layers.")
    } == (set(CASES[name]))
    assert figures["prompt_reuse_by.snapshot"] == 1
