"""End to end: serving over an MLX distributed group of processes, on loopback.

A tiny llama whose head counts divide by 2 runs tensor parallel over 2 ranks (the
worker started with LocalAI's flags) and answers as one process does: greedy text
for concurrent prompts, seeded sampling, logprobs, a grammar, cancellation, Score,
Rerank (a cancelled one dropped on both ranks) and Embedding. The default model's
first layers (its shapes and 4-bit weights) run pipeline parallel over 2 ranks under
``mlx.launch`` and tensor parallel over 3; the default model itself, loaded on each
rank from its GGUF, runs a pipeline whose stage hangs. A killed worker, a missing
one and rank 0's shutdown end as the README says. (tests/unit/test_distributed.py
checks the settings and splits without processes.)
"""

import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

import backend_pb2 as pb
from tests.support import (
    MODEL,
    Server,
    Worker,
    chat,
    device_tolerance,
    entries_of,
    error_of,
    run_concurrently,
    write_hostfile,
)
from tests.tiny_models import make_tiny_draft

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colors:",
    "1, 2, 3, 4,",
]
MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


def predict(stub, prompt: str, tokens: int = 12, **fields):
    request = pb.PredictOptions(Prompt=prompt, Tokens=tokens, Temperature=0, **fields)
    return stub.Predict(request, timeout=120)


def text(stub, prompt: str, **fields) -> str:
    return predict(stub, prompt, **fields).message.decode()


def load(server: Server, model: str | Path, *options: str) -> pb.Result:
    result = server.stub.LoadModel(
        pb.ModelOptions(Model=str(model), Options=list(options)), timeout=180
    )
    assert result.success, f"{result.message}\n{server.logs()}"
    return result


# -- a tiny llama, tensor parallel over 2 ranks --------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = make_tiny_draft(tmp_path_factory.mktemp("tiny") / "llama", layers=2)
    # Wider logits: a random tiny model's are close enough that the float noise of
    # another summation order (a split, fewer BLAS threads) could swap the best two.
    path = str(folder / "model.safetensors")
    weights = mx.load(path)
    weights["model.embed_tokens.weight"] *= 16
    mx.save_safetensors(path, weights, {"format": "mlx"})
    return str(folder)


@pytest.fixture(scope="module")
def reference(tiny_model):
    srv = Server()
    load(srv, tiny_model, "reranker:yes_no")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    hostfile = write_hostfile(tmp_path_factory.mktemp("hosts"), 2)
    worker = Worker(hostfile, 1)
    srv = Server()
    try:
        result = load(
            srv,
            tiny_model,
            f"hostfile:{hostfile}",
            "distributed_mode:tensor",
            "distributed_step_timeout:8",
            "reranker:yes_no",
        )
    except BaseException:
        print(worker.logs())
        srv.stop()
        worker.stop()
        raise
    assert "tensor parallel, rank 0 of 2: 2 of 4 query heads" in result.message
    if mx.default_device() == mx.cpu:
        # Two ranks on one machine split its cores (a GPU's ranks use no BLAS).
        assert "2 ranks share 127.0.0.1: BLAS threads capped at" in srv.logs()
        assert "2 ranks share 127.0.0.1: BLAS threads capped at" in worker.logs()
    yield srv, worker
    srv.stop()
    worker.stop()


def test_concurrent_greedy_requests_match_one_process(group, reference):
    srv, _ = group
    expected = [text(reference.stub, p) for p in PROMPTS]
    got = run_concurrently([lambda p=p: text(srv.stub, p) for p in PROMPTS])
    assert got == expected
    # Again, from the prompt cache of every rank.
    assert [text(srv.stub, p) for p in PROMPTS] == expected
    status = srv.stub.Status(pb.HealthMessage())
    assert status.state == pb.StatusResponse.READY
    assert status.memory.breakdown["distributed_ranks"] == 2
    assert status.memory.breakdown["prompt_cache_reused_tokens"] > 0


def cpu_seconds(pid: int) -> float:
    """A process's user and system time so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_an_idle_worker_sleeps(group):
    """MLX's ring backend polls its sockets while a receive is pending: a worker
    waiting in a collective for rank 0's next step kept a core busy (75% of one
    here, idle). It waits on the doorbell instead."""
    srv, worker = group
    assert text(srv.stub, PROMPTS[0])
    before = cpu_seconds(worker.process.pid)
    time.sleep(1.0)
    assert cpu_seconds(worker.process.pid) - before < 0.2


def test_seeded_sampling_is_reproducible(group, reference):
    srv, _ = group
    fields = dict(Temperature=0.9, TopK=50, Seed=11)
    request = pb.PredictOptions(Prompt=PROMPTS[1], Tokens=12, **fields)
    first = srv.stub.Predict(request).message
    assert srv.stub.Predict(request).message == first
    assert reference.stub.Predict(request).message == first


def test_logprobs_match_one_process(group, reference):
    srv, _ = group
    got = entries_of(predict(srv.stub, PROMPTS[0], Logprobs=3, TopLogprobs=3))
    expected = entries_of(
        predict(reference.stub, PROMPTS[0], Logprobs=3, TopLogprobs=3)
    )
    assert [e["token"] for e in got] == [e["token"] for e in expected]
    for a, b in zip(got, expected):
        assert a["logprob"] == pytest.approx(
            b["logprob"], abs=device_tolerance(1e-3, 10)
        )
        assert [t["token"] for t in a["top_logprobs"]] == [
            t["token"] for t in b["top_logprobs"]
        ]


def test_a_grammar_request(group, reference):
    srv, _ = group
    grammar = 'root ::= "Buy " [1-9] " " ("apples" | "pears" | "plums") "."'
    got = text(srv.stub, PROMPTS[2], tokens=40, Grammar=grammar)
    assert re.fullmatch(r"Buy [1-9] (apples|pears|plums)\.", got), got
    assert got == text(reference.stub, PROMPTS[2], tokens=40, Grammar=grammar)


def test_score_and_embedding_match_one_process(group, reference):
    srv, _ = group
    score = pb.ScoreRequest(
        prompt=PROMPTS[0], candidates=[" Paris", " a city"], include_token_logprobs=True
    )
    got, expected = srv.stub.Score(score), reference.stub.Score(score)
    for a, b in zip(got.candidates, expected.candidates):
        assert a.log_prob == pytest.approx(b.log_prob, abs=device_tolerance(1e-3, 10))
    embed = pb.PredictOptions(Embeddings=PROMPTS[1])
    got = srv.stub.Embedding(embed).embeddings
    expected = reference.stub.Embedding(embed).embeddings
    assert got == pytest.approx(expected, abs=device_tolerance(1e-4))


def test_rerank_matches_one_process_and_a_cancelled_one_ends_on_every_rank(
    group, reference
):
    srv, _ = group
    request = pb.RerankRequest(query=PROMPTS[0], documents=PROMPTS[1:] + PROMPTS[1:2])

    def scores(stub) -> dict[int, float]:
        return {r.index: r.relevance_score for r in stub.Rerank(request).results}

    expected = scores(reference.stub)
    got = scores(srv.stub)
    assert got == pytest.approx(expected, abs=device_tolerance(1e-4))
    # A Rerank cancelled while it runs is dropped on the worker too: the next one
    # runs the same collectives on both ranks.
    long = "The lamp was lit at dusk and kept burning until the dawn. " * 30
    many = pb.RerankRequest(query=PROMPTS[0], documents=[long] * 256)
    dropped = srv.logs().count("a cancelled job is dropped")
    call = srv.stub.Rerank.future(many)
    srv.wait_for_log("judging 256 documents")
    call.cancel()
    srv.wait_for_log("a cancelled job is dropped", 30, times=dropped + 1)
    assert scores(srv.stub) == pytest.approx(got, abs=device_tolerance(1e-5))


def reused_tokens(stub) -> int:
    breakdown = stub.Status(pb.HealthMessage()).memory.breakdown
    return breakdown["prompt_cache_reused_tokens"]


def test_a_scored_prompt_serves_generation_on_every_rank(group, reference):
    # Score jobs put their prompt's KV state in the prompt cache of every rank.
    srv, _ = group
    prompt = "A scored prompt, then a generation from its KV state:"
    srv.stub.Score(pb.ScoreRequest(prompt=prompt, candidates=[" yes"]))
    before = reused_tokens(srv.stub)
    assert text(srv.stub, prompt) == text(reference.stub, prompt)
    assert reused_tokens(srv.stub) > before


def test_a_burst_sharing_a_long_prefix_prefills_it_once(group, reference):
    srv, _ = group
    prefix = "Here is a long shared system prompt about lighthouses. " * 12
    prompts = [f"{prefix}Question {i}: what is a lamp?" for i in range(3)]
    expected = [text(reference.stub, p) for p in prompts]
    before = reused_tokens(srv.stub)
    got = run_concurrently([lambda p=p: text(srv.stub, p) for p in prompts])
    assert got == expected
    # The two followers started from the leader's prefix snapshot.
    assert reused_tokens(srv.stub) - before >= 2 * 100


def test_cancelling_a_stream_keeps_the_group_serving(group, reference):
    srv, worker = group
    stream = srv.stub.PredictStream(
        pb.PredictOptions(Prompt=PROMPTS[3], Tokens=2000, Temperature=0, IgnoreEOS=True)
    )
    for _ in range(3):
        next(stream)
    stream.cancel()
    assert text(srv.stub, PROMPTS[0]) == text(reference.stub, PROMPTS[0])
    assert worker.process.poll() is None


def test_a_killed_worker_ends_requests_with_unavailable(group):
    """Rank 0 reports the lost group, or, when MLX cannot interrupt a collective
    (or aborts), exits (here after distributed_step_timeout, 8 s); either way
    within 30 s, and nothing hangs."""
    srv, worker = group
    replies: list = []
    error: list = []

    def read():
        request = pb.PredictOptions(
            Prompt=PROMPTS[3], Tokens=5000, Temperature=0, IgnoreEOS=True
        )
        try:
            for reply in srv.stub.PredictStream(request, timeout=60):
                replies.append(reply)
        except grpc.RpcError as e:
            error.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    while not replies:
        time.sleep(0.05)
    worker.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    reader.join(30)
    assert not reader.is_alive()
    assert error and error[0].code() == grpc.StatusCode.UNAVAILABLE
    if srv.process.poll() is None:
        try:
            srv.stub.Health(pb.HealthMessage(), timeout=2)
        except grpc.RpcError:
            pass
    lost = "distributed group of 2 ranks is lost" in error[0].details()
    if not lost or srv.process.poll() is not None or "hung for" in srv.logs():
        # Its stream ended with the process ("Socket closed"): it must be gone.
        srv.process.wait(max(1, 30 - (time.monotonic() - killed)))
        return
    assert srv.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.ERROR
    started = time.monotonic()
    failed = error_of(srv.stub.Predict, chat(), timeout=10)
    assert failed.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 5
    assert "this backend must be restarted" in srv.logs()


def test_rank_0_exits_when_a_pipeline_stage_hangs(tmp_path):
    """A pipeline's recv from a killed rank is never interrupted: the watchdog
    ends rank 0, with its log line, so that it is restarted."""
    hostfile = write_hostfile(tmp_path, 2)
    worker = Worker(hostfile, 1)
    srv = Server()
    try:
        load(
            srv,
            MODEL,
            f"hostfile:{hostfile}",
            "distributed_mode:pipeline",
            "distributed_step_timeout:5",
        )
        stream = srv.stub.PredictStream(
            pb.PredictOptions(Prompt=PROMPTS[3], Tokens=5000, IgnoreEOS=True),
            timeout=60,
        )
        next(stream)
        worker.process.kill()
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        srv.process.wait(15 - (time.monotonic() - killed))
        assert srv.process.returncode != 0
    finally:
        srv.stop()
        worker.stop()


# -- the default model's shapes --------------------------------------------------


@pytest.fixture(scope="module")
def short_reference(server, short_default):
    """One process serving the default model's first layers."""
    load(server, short_default)
    return server


def test_default_model_shapes_pipeline_over_2_ranks_under_mlx_launch(
    short_reference, short_default
):
    launcher = [MLX_LAUNCH, "--backend", "ring", "-n", "2"]
    launcher += ["--starting-port", str(_free_port_block(2))]
    srv = Server(launcher=launcher)
    try:
        result = load(srv, short_default, "distributed_mode:pipeline")
        assert "pipeline parallel, rank 0 of 2: layers 2-3" in result.message
        # Its first layers alone never end a reply: a token limit does.
        expected = short_reference.stub.Predict(chat(Tokens=12)).message
        assert srv.stub.Predict(chat(Tokens=12)).message == expected
        assert text(srv.stub, PROMPTS[0], tokens=16) == text(
            short_reference.stub, PROMPTS[0], tokens=16
        )
    finally:
        srv.stop()


def test_default_model_shapes_tensor_parallel_over_3_ranks(
    short_reference, short_default, tmp_path
):
    hostfile = write_hostfile(tmp_path, 3)
    workers = [Worker(hostfile, rank) for rank in (1, 2)]
    srv = Server()
    try:
        result = load(srv, short_default, f"hostfile:{hostfile}")
        assert "tensor parallel, rank 0 of 3: 3 of 9 query heads, 1 of 3 KV" in (
            result.message
        )
        # Its first layers alone never end a reply: a token limit does.
        expected = short_reference.stub.Predict(chat(Tokens=12)).message
        assert srv.stub.Predict(chat(Tokens=12)).message == expected
        assert text(srv.stub, PROMPTS[0], tokens=8) == text(
            short_reference.stub, PROMPTS[0], tokens=8
        )
        # Rank 0's shutdown ends the workers too.
        srv.stop()
        for worker in workers:
            assert worker.process.wait(20) == 0
            assert "rank 0 is shutting down" in worker.logs()
    finally:
        srv.stop() if srv.process.poll() is None else None
        for worker in workers:
            worker.stop()


def test_a_missing_worker_fails_the_load_within_the_timeout(tmp_path):
    hostfile = write_hostfile(tmp_path, 3)
    worker = Worker(hostfile, 1)
    srv = Server(env={"MLX_DISTRIBUTED_HOSTFILE": str(hostfile)})
    try:
        started = time.monotonic()
        result = srv.stub.LoadModel(
            pb.ModelOptions(Model=MODEL, Options=["distributed_timeout:3"]), timeout=30
        )
        assert time.monotonic() - started < 10
        assert not result.success
        assert "rank 2 of the distributed group" in result.message
        assert "did not join within 3 s" in result.message
        # The backend still answers, and the worker waits on.
        assert srv.stub.Health(pb.HealthMessage()).message == b"OK"
        assert worker.process.poll() is None
    finally:
        srv.stop()
        worker.stop()


def _free_port_block(count: int) -> int:
    """A port from which ``count`` consecutive ports are free (for mlx.launch)."""
    for base in range(40000, 60000, 97):
        opened = []
        try:
            for port in range(base, base + count):
                opened.append(socket.create_server(("127.0.0.1", port)))
            return base
        except OSError:
            continue
        finally:
            for s in opened:
                s.close()
    raise RuntimeError("no free ports")
