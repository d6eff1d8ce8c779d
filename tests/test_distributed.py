"""Serving over an MLX distributed group, on loopback.

A tiny llama whose head counts divide by 2 runs tensor parallel over 2 ranks (the
worker started with LocalAI's flags) and answers as one process does: greedy text
for concurrent prompts, seeded sampling, logprobs, a grammar, cancellation, Score
and Embedding. The default model runs pipeline parallel over 2 ranks under
``mlx.launch`` and tensor parallel over 3. A killed worker, a missing one and rank
0's shutdown end as the README says.
"""

import dataclasses
import json
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
from mlx_backend.cpu.path import blas_threads, set_blas_threads
from mlx_backend.distributed.group import (
    GroupSettings,
    check_in,
    gather_workers,
    group_environment,
    leader_settings,
    pipeline_size_fn,
    worker_settings,
)
from mlx_backend.distributed.sharding import ShardingError, choose_mode
from mlx_backend.errors import InvalidArgument, Unavailable
from python_utils import parse_options
from tests.support import (
    ANSWER,
    MODEL,
    Server,
    Worker,
    chat,
    error_of,
    make_tiny_draft,
    run_concurrently,
    write_hostfile,
)
from tests.test_logprobs_score_embedding import entries_of

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


def load(server: Server, model: str, *options: str) -> pb.Result:
    result = server.stub.LoadModel(
        pb.ModelOptions(Model=model, Options=list(options)), timeout=180
    )
    assert result.success, f"{result.message}\n{server.logs()}"
    return result


# -- settings and splits, no processes ----------------------------------------


def test_rank_0_joins_a_group_from_the_option_or_the_environment():
    assert leader_settings(parse_options([]), {}) is None
    by_option = leader_settings(parse_options(["hostfile:/x/Hosts.json"]), {})
    assert by_option == GroupSettings("ring", "/x/Hosts.json", timeout=60.0)
    by_env = leader_settings(
        parse_options(["distributed_timeout:5"]),
        {"MLX_DISTRIBUTED_HOSTFILE": "/h.json", "MLX_DISTRIBUTED_BACKEND": "jaccl"},
    )
    assert (by_env.backend, by_env.hostfile, by_env.timeout) == ("jaccl", "/h.json", 5)
    launched = leader_settings(
        parse_options([]), {"MLX_RANK": "0", "MLX_HOSTFILE": "/tmp/launch.json"}
    )
    assert (launched.backend, launched.hostfile) == ("ring", "/tmp/launch.json")
    assert group_environment(by_option) == {
        "MLX_HOSTFILE": "/x/Hosts.json",
        "MLX_RANK": "0",
    }


def test_worker_flags_are_checked():
    settings = worker_settings("/h.json", 2, "jaccl", "10.0.0.1:5000", {})
    assert group_environment(settings) == {
        "MLX_IBV_DEVICES": "/h.json",
        "MLX_RANK": "2",
        "MLX_JACCL_COORDINATOR": "10.0.0.1:5000",
    }
    for args, field in [
        (("/h.json", 0, "ring", ""), "--rank"),
        (("/h.json", None, "ring", ""), "--rank"),
        (("", 1, "ring", ""), "--hostfile"),
        (("/h.json", 1, "tcp", ""), "--backend"),
    ]:
        with pytest.raises(InvalidArgument, match=field):
            worker_settings(*args, {})


def test_bad_distributed_options_are_invalid_argument():
    for option, field in [
        ("distributed_backend:tcp", "distributed_backend"),
        ("distributed_mode:data", "distributed_mode"),
        ("distributed_timeout:0", "distributed_timeout"),
        ("distributed_step_timeout:-1", "distributed_step_timeout"),
    ]:
        with pytest.raises(InvalidArgument, match=field):
            parse_options([option])


def test_workers_check_in_before_the_group_forms(tmp_path):
    """The check-in that precedes MLX's init, over loopback sockets alone."""
    ring = write_hostfile(tmp_path, 3)
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps([[None, "rdma_en2"], ["rdma_en2", None]]))
    # A free port for the JACCL coordinator (rank 0's, as mlx.launch sets it).
    (coordinator,) = json.loads(write_hostfile(tmp_path, 1).read_text())[0]
    for backend, hostfile, ranks in (("ring", ring, 3), ("jaccl", devices, 2)):
        settings = GroupSettings(backend, str(hostfile), coordinator=coordinator)
        workers = [
            threading.Thread(
                target=check_in, args=(dataclasses.replace(settings, rank=rank), 0.05)
            )
            for rank in range(1, ranks)
        ]
        for worker in workers:
            worker.start()
        gather_workers(dataclasses.replace(settings, timeout=10))
        for worker in workers:
            worker.join(10)
            assert not worker.is_alive()
    # No worker comes: the message names the ranks.
    with pytest.raises(Unavailable, match="ranks 1, 2 of the distributed group"):
        gather_workers(GroupSettings("ring", str(ring), timeout=1))


class _Args:
    num_attention_heads = 9
    num_key_value_heads = 3
    intermediate_size = 1536


class _Inner:
    layers = [object()] * 30


class _SmolLM2:
    """The default model's shape, as the split checks read it."""

    args = _Args()
    model = _Inner()

    def shard(self, group):
        pass


def test_the_split_follows_the_head_and_layer_counts():
    model = _SmolLM2()
    assert choose_mode(model, 3, "auto") == "tensor"
    assert choose_mode(model, 2, "auto") == "pipeline"
    with pytest.raises(ShardingError, match="9 query heads and 3 KV heads"):
        choose_mode(model, 2, "tensor")
    with pytest.raises(ShardingError, match="the model has 30"):
        choose_mode(model, 31, "pipeline")


def test_blas_threads_are_set_through_the_blas():
    before = blas_threads()
    if before is None:
        pytest.skip("no fast BLAS preloaded (make test preloads one on Linux CPU)")
    try:
        assert set_blas_threads(1)
        assert blas_threads() == 1
    finally:
        set_blas_threads(before)


def test_pipeline_ranks_count_an_entry_as_if_it_held_every_layer():
    class Layer:
        nbytes = 1000

    assert pipeline_size_fn([Layer()] * 15, 30) == 30000
    assert pipeline_size_fn([Layer()] * 10, 30) == 30000


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
    load(srv, tiny_model)
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
        )
    except BaseException:
        print(worker.logs())
        srv.stop()
        worker.stop()
        raise
    assert "tensor parallel, rank 0 of 2: 2 of 4 query heads" in result.message
    # Two ranks on one machine split its cores.
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
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
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
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-3)
    embed = pb.PredictOptions(Embeddings=PROMPTS[1])
    got = srv.stub.Embedding(embed).embeddings
    expected = reference.stub.Embedding(embed).embeddings
    assert got == pytest.approx(expected, abs=1e-4)


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


# -- the default model -----------------------------------------------------------


def test_default_model_pipeline_over_2_ranks_under_mlx_launch(server, tmp_path):
    launcher = [MLX_LAUNCH, "--backend", "ring", "-n", "2"]
    launcher += ["--starting-port", str(_free_port_block(2))]
    srv = Server(launcher=launcher)
    try:
        result = load(srv, MODEL, "distributed_mode:pipeline")
        assert "pipeline parallel, rank 0 of 2: layers 15-29" in result.message
        assert srv.stub.Predict(chat()).message.decode() == ANSWER
        assert text(srv.stub, PROMPTS[0], tokens=16) == text(
            server.stub, PROMPTS[0], tokens=16
        )
    finally:
        srv.stop()


def test_default_model_tensor_parallel_over_3_ranks(server, tmp_path):
    hostfile = write_hostfile(tmp_path, 3)
    workers = [Worker(hostfile, rank) for rank in (1, 2)]
    srv = Server()
    try:
        result = load(srv, MODEL, f"hostfile:{hostfile}")
        assert "tensor parallel, rank 0 of 3: 3 of 9 query heads, 1 of 3 KV" in (
            result.message
        )
        assert srv.stub.Predict(chat()).message.decode() == ANSWER
        assert text(srv.stub, PROMPTS[0], tokens=8) == text(
            server.stub, PROMPTS[0], tokens=8
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
