"""Test helpers for a real backend process on a real port: the reference question
and its greedy answer, the backend and worker processes (``Server``, ``Worker``,
hostfiles), gRPC request builders and checks, the person schema that grammar tests
use, and forced tokens (``ForcingServicer``). Tests, ``conftest.py`` and bench/
import them from here; no test module imports another. The in-process engine's
helpers are in ``engine_helpers.py``, the tiny llamas in ``tiny_models.py`` and the
chat models in ``chat_models.py``."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as load_mlx_lm

import backend_pb2 as pb
import backend_pb2_grpc
from backend import BackendServicer
from mlx_backend.cpu.blas import blas_choice_environment, fast_blas_in_use
from mlx_backend.decoders.proposers import NgramProposer
from mlx_backend.gpu import on_cuda
from mlx_backend.models.loading import ModelInfo, default_model_path
from mlx_backend.request_parsing import GenerationRequest
from tests.family_models import WINDOW

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
QUESTIONS = (QUESTION, "Name three colors.", "Write a short poem about the sea.")
ANSWER = "The capital of France is Paris."
ANSWER_TOKENS = 7
# The tokens of ANSWER, as logprob entries name them.
ANSWER_PIECES = ["The", " capital", " of", " France", " is", " Paris", "."]
PROMPT_TOKENS = 37
# A GPU's first start compiles MLX's kernels (tens of seconds on CUDA, more with
# every worker compiling at once).
STARTUP_TIMEOUT = 240.0 if on_cuda() else 120.0
# MLX's CUDA backend runs float32 matmuls in TF32 (MLX_ENABLE_TF32, on by default):
# a 10-bit mantissa, a unit roundoff of 2^-11 against float32's 2^-24.
TF32_UNIT_ROUNDOFF = 2.0**-11
# The default model by path, so it has a name for ModelIdentity checks.
MODEL = str(default_model_path())
AUTH = (("authorization", "Bearer s3cret"),)
# The system message of the family chats over gRPC.
TRAINS = "You answer questions about the trains from Lyon to Geneva and back. " * 2


def backend_environment(fresh_blas: bool = True) -> dict:
    """A backend process's environment. ``fresh_blas``: it picks its BLAS afresh
    (and restarts to preload it), as when LocalAI starts it, even though pytest
    runs with one preloaded (make test); else it starts on pytest's, without the
    restart (a second or two of each start)."""
    # Not the test that happened to start it: a process reading its own environment
    # (/proc/self/environ) would find that test's id, whatever text it holds.
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if fresh_blas and fast_blas_in_use(environ):
        return blas_choice_environment(environ, "auto")
    return environ


def write_hostfile(folder: Path, ranks: int) -> Path:
    """MLX's ring hostfile for ``ranks`` processes on loopback, on free ports."""
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(ranks)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    path = folder / f"hosts-{ranks}-{ports[0]}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    return path


class Worker:
    """A distributed worker process: ``backend.py --worker --rank N``, on
    pytest's BLAS unless ``fresh_blas`` (``backend_environment``)."""

    def __init__(self, hostfile: Path, rank: int, fresh_blas: bool = False):
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"worker{rank}-", suffix=".log", delete=False
        )
        command = [sys.executable, str(ROOT / "backend.py"), "--worker"]
        command += ["--hostfile", str(hostfile), "--rank", str(rank)]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=backend_environment(fresh_blas),
            cwd=ROOT,
        )

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


class Server:
    """A backend process started with ``backend.py --addr 127.0.0.1:0``, on
    pytest's BLAS unless ``fresh_blas`` (``backend_environment``)."""

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        launcher: list | None = None,
        forcing: bool = False,
        fresh_blas: bool = False,
    ):
        self.log = tempfile.NamedTemporaryFile(
            prefix="backend-", suffix=".log", delete=False
        )
        # The forcing backend runs as a module of the tests package, from the root.
        script = (
            ["-m", "tests.forcing_backend"] if forcing else [str(ROOT / "backend.py")]
        )
        command = [sys.executable, *script, "--addr", "127.0.0.1:0"]
        self.process = subprocess.Popen(
            (launcher or []) + command + list(args),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**backend_environment(fresh_blas), **(env or {})},
            cwd=ROOT,
        )
        try:
            self.port = self._wait_for_port()
        except BaseException:
            # A backend that never listened must not outlive the caller.
            self.process.kill()
            self.process.wait()
            self.log.close()
            os.unlink(self.log.name)
            raise
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = backend_pb2_grpc.BackendStub(self.channel)

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            match = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.logs())
            if match:
                return int(match.group(1))
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"backend did not start:\n{self.logs()}")

    def wait_for(self, state, metadata=None, timeout=STARTUP_TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.stub.Status(pb.HealthMessage(), metadata=metadata)
            if status.state == state:
                return status
            time.sleep(0.05)
        raise AssertionError(f"state {state} not reached:\n{self.logs()}")

    def wait_for_log(
        self, text: str, timeout: float = STARTUP_TIMEOUT, times: int = 1
    ) -> None:
        """Wait until ``text`` is in the log ``times`` times; RuntimeError if the
        process exits."""
        deadline = time.monotonic() + timeout
        while self.logs().count(text) < times:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"backend did not log {text!r}:\n{self.logs()}")
            time.sleep(0.1)

    def stop(self):
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        os.unlink(self.log.name)


def start_default_server(model: str = "default", forcing: bool = False) -> Server:
    """A backend serving the default model (named ``model``), once it is READY; it
    picks its BLAS afresh, as when LocalAI starts it."""
    srv = Server("--model", model, forcing=forcing, fresh_blas=True)
    try:
        srv.wait_for(pb.StatusResponse.READY)
    except BaseException:
        srv.stop()
        raise
    return srv


def chat(text=QUESTION, **fields):
    return pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content=text)],
        **fields,
    )


class EagerLookup(NgramProposer):
    """Prompt lookup verified from the first decoded token on, as a draft model's
    proposals are, rather than after its guesses have held."""

    cheap = False


# Places in qmm.fused_isas() (best first, portable last) that the fused kernels'
# tests run on: every set an AVX-512 CPU runs; a CPU with fewer skips "next".
FUSED_ISAS = ("best", "next", "portable")


def each_fused_isa(qmm, which: str):
    """The fused kernels on the set at ``which`` (FUSED_ISAS) for a test, then
    the best again."""
    names = qmm.fused_isas()
    if which == "next" and len(names) < 3:
        pytest.skip(f"this CPU runs no set between {names[0]} and {names[-1]}")
    qmm.set_fused_isa({"best": names[0], "next": names[1]}.get(which, names[-1]))
    yield qmm.fused_isa()
    qmm.set_fused_isa("auto")


def device_tolerance(cpu: float, magnitude: float = 1.0) -> float:
    """A float32 comparison's tolerance ``cpu`` (two evaluations of one model whose
    matmuls differ in shape: batched or alone, chunked or whole, ours or mlx-lm's),
    or on CUDA the larger of it and four TF32 roundoffs of values of ``magnitude``:
    0.02 for the test models' logits and logprobs (magnitude 10), 0.002 for unit
    vectors. An H200 gave up to 0.0043 in a logprob, 0.0003 in an embedding."""
    if not on_cuda():
        return cpu
    return max(cpu, 4 * TF32_UNIT_ROUNDOFF * magnitude)


# Where two greedy decodes of one prompt may part on CUDA: the reference's best two
# logprobs closer than this. An H200 parted the tiny random Gemma models' decodes
# at margins of 0.042 to 0.068 (their drift grows over the decoded tokens); a
# masking or padding mistake moves logprobs by whole units.
CUDA_NEAR_TIE = 2.0**-3


def near_tie() -> float:
    """How close the best two logprobs are where two greedy decodes of one prompt
    may part: never on the CPU, where the tests' decodes agree token for token."""
    return CUDA_NEAR_TIE if on_cuda() else 0.0


def greedy_steps(
    model, prompt, max_tokens: int, ends, cache=None
) -> list[tuple[int, float]]:
    """mlx-lm's greedy tokens for ``prompt``, each with its logprob's margin over
    the next best, up to and with an end token (one of ``ends``)."""
    steps = []
    for token, logprobs in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=make_sampler(0.0),
        prompt_cache=cache,
    ):
        second, first = mx.sort(logprobs)[-2:].tolist()
        steps.append((token, first - second))
        if token in ends:
            break
    return steps


def assert_tokens_as_reference(tokens: list[int], steps, ends=()) -> None:
    """``tokens`` are the greedy ``steps`` token for token (with their end token, or
    without when ``ends`` names it); where a device's rounding swaps a near tie
    they may part there."""
    for i, (token, margin) in enumerate(steps):
        if i == len(tokens) and token in ends:
            return
        if i == len(tokens) or tokens[i] != token:
            assert margin < near_tie(), (
                f"parted at token {i} (margin {margin:.5f}): "
                f"{tokens} != {[t for t, _ in steps]}"
            )
            return
    assert len(tokens) == len(steps), f"{tokens} != {[t for t, _ in steps]}"


def assert_text_as_reference(text: str, steps, decode, ends) -> None:
    """``text`` is the greedy ``steps``' text (``decode`` makes it, ``ends`` are
    the end tokens); where a device's rounding swaps a near tie they may part."""
    tokens = [t for t, _ in steps if t not in ends]
    if text == decode(tokens):
        return
    for i, (token, margin) in enumerate(steps):
        before = [t for t, _ in steps[: i + 1] if t not in ends]
        # A token that ends mid-character decodes with a replacement character.
        parted = token in ends or not text.startswith(decode(before).rstrip("\ufffd"))
        if parted:
            assert margin < near_tie(), (
                f"parted at token {i} (margin {margin:.5f}): "
                f"{text!r} != {decode(tokens)!r}"
            )
            return
    raise AssertionError(f"{text!r} != {decode(tokens)!r}")


def stream_texts(stub, request, **kwargs):
    replies = list(stub.PredictStream(request, **kwargs))
    return [r.message.decode() for r in replies], replies[-1]


def check_a_chat_reuses_its_first_turn(stub, folder: Path) -> dict[str, int]:
    """Two turns of a chat about trains, sent as LocalAI sends them (Messages
    through the chat template): each streams mlx-lm's greedy text for ``folder``,
    and the second reuses more than 80% of the first's prompt from the prompt
    cache. The Status breakdown after them."""
    model, tokenizer = load_mlx_lm(str(folder))

    def reference(messages: list[dict]) -> tuple[int, list[tuple[int, float]]]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return len(prompt), greedy_steps(model, prompt, 10, tokenizer.eos_token_ids)

    def check(text: str, steps) -> None:
        ends = tokenizer.eos_token_ids
        assert_text_as_reference(text, steps, tokenizer.decode, ends)

    def streamed(messages: list[dict]) -> str:
        request = pb.PredictOptions(
            UseTokenizerTemplate=True,
            Messages=[
                pb.Message(role=m["role"], content=m["content"]) for m in messages
            ],
            Tokens=10,
            Temperature=0.0,
        )
        replies = stub.PredictStream(request, timeout=60)
        return b"".join(r.message for r in replies).decode()

    def breakdown() -> dict[str, int]:
        return dict(stub.Status(pb.HealthMessage()).memory.breakdown)

    messages = [
        {"role": "system", "content": TRAINS},
        {"role": "user", "content": "When does the first train leave on Sunday?"},
    ]
    first, expected = reference(messages)
    assert first > 2 * WINDOW
    reply = streamed(messages)
    check(reply, expected)
    before = breakdown()["prompt_cache_reused_tokens"]
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the last one back?"},
    ]
    check(streamed(messages), reference(messages)[1])
    figures = breakdown()
    assert figures["prompt_cache_reused_tokens"] - before > 0.8 * first
    return figures


def error_of(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if not hasattr(result, "SerializeToString"):
            list(result)
    return info.value


def run_concurrently(calls) -> list:
    """Start every call at once on its own thread; their results in order."""
    results: list = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    """VmRSS (or another of /proc/PID/status's fields, e.g. the peak, VmHWM) of a
    process in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def server_rss_mib(server) -> int:
    return rss_kib(server.process.pid) // 1024


def entries_of(reply) -> list[dict]:
    """A reply's logprob entries, as its JSON ``logprobs`` lists them."""
    return json.loads(reply.logprobs)["content"] if reply.logprobs else []


# -- grammars -------------------------------------------------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
    },
    "required": ["name", "color", "age"],
    "additionalProperties": False,
}


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "color", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert person["color"] in ("red", "green", "blue")
    assert type(person["age"]) is int and 18 <= person["age"] <= 65


# -- forced tokens -------------------------------------------------------------


def make_forcing_processor(tokens: Sequence[int], eos: int | None):
    """A logits processor under which any sampler picks ``tokens``, then ``eos``
    (None: then the model's own choice).

    The model still runs every step through mlx-lm's generation loop; only its
    choice is fixed. Tests hand it to the engine in ``GenerationRequest.processors``.
    """
    script = list(tokens) + [eos]
    step = 0

    def force(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal step
        if eos is None and step >= len(tokens):
            return logits
        token = script[min(step, len(script) - 1)]
        step += 1
        allowed = mx.arange(logits.shape[-1]) == token
        return mx.where(allowed, mx.zeros_like(logits), -mx.inf)

    return force


class ForcingServicer(BackendServicer):
    """The backend for tests that fix what the model generates.

    A request's ``Metadata["forced_tokens"]`` (JSON token ids) is generated exactly,
    then EOS, through the engine's own hook: ``GenerationRequest.processors``;
    ``Metadata["forced_prefix"]`` is generated first, then the model goes on.
    """

    def parse_generation(self, request, info: ModelInfo) -> GenerationRequest:
        parsed = super().parse_generation(request, info)
        text = request.Metadata.get("forced_tokens")
        prefix = request.Metadata.get("forced_prefix")
        if text is None and prefix is None:
            return parsed
        eos = min(info.tokenizer.eos_token_ids) if prefix is None else None
        force = make_forcing_processor(json.loads(text or prefix), eos)
        return dataclasses.replace(parsed, processors=parsed.processors + (force,))


def merge_chat_deltas(chat_deltas) -> tuple[str, str, list[tuple[int, str, str, str]]]:
    """Content, reasoning, and each call (index, id, name, arguments) of proto
    ChatDeltas, a call's chunks merged by index as the frontend merges them."""
    calls: dict[int, list[str]] = {}
    for call in (c for d in chat_deltas for c in d.tool_calls):
        entry = calls.setdefault(call.index, ["", "", ""])
        entry[0] = entry[0] or call.id
        entry[1] = entry[1] or call.name
        entry[2] += call.arguments
    return (
        "".join(d.content for d in chat_deltas),
        "".join(d.reasoning_content for d in chat_deltas),
        [(index, *entry) for index, entry in calls.items()],
    )
