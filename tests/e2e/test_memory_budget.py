"""The memory budget over gRPC: Status reports its parts, and a request that can
never fit gets RESOURCE_EXHAUSTED while the server goes on serving."""

import grpc

import backend_pb2 as pb
from tests.support import ANSWER, chat, error_of


def breakdown(server) -> dict[str, int]:
    return dict(server.stub.Status(pb.HealthMessage()).memory.breakdown)


def test_a_request_beyond_the_budget_is_resource_exhausted(server):
    parts = breakdown(server)
    for key in ("memory_budget_bytes", "budget_kv_bytes", "step_token_budget"):
        assert key in parts, key
    fixed = parts["budget_weights_bytes"] + parts["budget_prefill_bytes"]
    # Room for about 650 tokens of the default model's float32 KV.
    budget = fixed + 30_000_000
    result = server.stub.LoadModel(pb.ModelOptions(Options=[f"memory_budget:{budget}"]))
    assert result.success, result.message
    try:
        assert breakdown(server)["memory_budget_bytes"] == budget
        error = error_of(server.stub.Predict, chat(Tokens=4000))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details().startswith("Tokens:")
        assert "30000000 bytes" in error.details()
        assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER
    finally:
        assert server.stub.LoadModel(pb.ModelOptions()).success
    too_small = server.stub.LoadModel(pb.ModelOptions(Options=["memory_budget:1000"]))
    assert not too_small.success and "memory_budget" in too_small.message
