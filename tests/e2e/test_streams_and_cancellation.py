"""End-to-end tests of streams on a serving backend: a stream whose client stops
reading is ended while the others go on, a finished batch keeps only its own KV
state, Health and Status answer during a generation, and a cancelled stream or a
deadline stops its generation while the next request is served."""

import time

import grpc
import pytest

import backend_pb2 as pb
import backend_pb2_grpc
from tests.support import (
    ANSWER,
    chat,
    error_of,
    run_concurrently,
    server_rss_mib,
    stream_texts,
)


def test_an_unread_stream_is_ended_and_the_others_go_on(server):
    # No BDP probing: the client's window stays 64 KiB, as a stuck client's would.
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.http2.bdp_probe", 0)]
    )
    stub = backend_pb2_grpc.BackendStub(channel)
    assert stub.LoadModel(pb.ModelOptions(Options=["max_stream_backlog:16"])).success
    try:
        rss = server_rss_mib(server)
        unread = stub.PredictStream(
            pb.PredictOptions(
                Prompt="Once upon a time",
                Tokens=2000,
                IgnoreEOS=True,
                Logprobs=1,
                TopLogprobs=20,
            )
        )
        # Another stream, read as it comes, is not held back.
        texts, final = stream_texts(stub, chat(Tokens=40))
        assert "".join(texts) == ANSWER
        deadline = time.monotonic() + 120
        while "its client left" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.2)
        received = 0
        with pytest.raises(grpc.RpcError) as error:
            for _ in unread:
                received += 1
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_stream_backlog" in error.value.details()
        # Bounded: what the client's window holds (about 20 replies) and 16 more.
        assert 16 < received < 200
        assert server_rss_mib(server) - rss < 200
    finally:
        assert stub.LoadModel(pb.ModelOptions(Model="default")).success
        channel.close()


def test_finished_generations_keep_only_their_own_kv_state(server):
    def held() -> int:
        # MLX memory beyond the prompt cache's own count and the paged store's
        # pages kept for the next sequences, once the batch is done.
        server.wait_for(pb.StatusResponse.READY)
        memory = server.stub.Status(pb.HealthMessage()).memory.breakdown
        return (
            memory["active"]
            - memory["prompt_cache_bytes"]
            - memory["kv_pool_free_bytes"]
        )

    before = held()
    run_concurrently(
        [
            lambda i=i: server.stub.Predict(
                pb.PredictOptions(Prompt=f"Tale {i}:", Tokens=48, IgnoreEOS=True)
            )
            for i in range(8)
        ]
    )
    # A cache entry left lazy would pin the whole batch's KV buffers.
    assert held() - before < 16 << 20


def test_health_and_status_answer_during_generation(server):
    stream = server.stub.PredictStream(
        chat("Tell me a long story.", Tokens=200, IgnoreEOS=True)
    )
    next(stream)
    latencies = []
    for _ in range(10):
        start = time.perf_counter()
        server.stub.Health(pb.HealthMessage())
        assert server.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.BUSY
        latencies.append(time.perf_counter() - start)
    stream.cancel()
    # Generous: a blocked event loop would take a whole generation (seconds).
    assert max(latencies) < 1.0
    server.wait_for(pb.StatusResponse.READY, timeout=10)


# -- cancellation ---------------------------------------------------------------


def test_cancelled_stream_stops_and_next_request_is_served(server):
    stream = server.stub.PredictStream(
        chat("Tell me a long story.", Tokens=0, IgnoreEOS=True)
    )
    for _ in range(3):
        next(stream)
    stream.cancel()
    server.wait_for(pb.StatusResponse.READY, timeout=5)
    start = time.perf_counter()
    assert server.stub.Predict(chat(Tokens=40)).message.decode() == ANSWER
    assert time.perf_counter() - start < 30


def test_deadline_stops_generation(server):
    error = error_of(
        server.stub.Predict,
        chat("Tell me a long story.", Tokens=0, IgnoreEOS=True),
        timeout=1.5,
    )
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_for(pb.StatusResponse.READY, timeout=5)
    assert "generation cancelled" in server.logs()
