"""Test helpers: a real backend process on a real port, an in-process engine, and
request builders; the tiny models, adapters and chat models that tests build.
Tests, ``conftest.py`` and bench/ import them from here; no test module imports
another."""

import asyncio
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
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.sample_utils import greedy_sampler

import backend_pb2 as pb
import backend_pb2_grpc
from backend import BackendServicer
from mlx_backend.cpu.blas import blas_choice_environment, fast_blas_in_use
from mlx_backend.decoders.base import NewSequence
from mlx_backend.engine.engine import Engine
from mlx_backend.models.gguf import export_mlx_folder, save_tokenizer
from mlx_backend.models.loading import LoadPlan, ModelInfo, default_model_path
from mlx_backend.output.chat_output import merge_deltas
from mlx_backend.request_parsing import GenerationRequest
from mlx_utils import make_kv_cache
from python_utils import parse_options

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
QUESTIONS = (QUESTION, "Name three colors.", "Write a short poem about the sea.")
ANSWER = "The capital of France is Paris."
ANSWER_TOKENS = 7
# The tokens of ANSWER, as logprob entries name them.
ANSWER_PIECES = ["The", " capital", " of", " France", " is", " Paris", "."]
PROMPT_TOKENS = 37
STARTUP_TIMEOUT = 120.0
# The default model by path, so it has a name for ModelIdentity checks.
MODEL = str(default_model_path())
AUTH = (("authorization", "Bearer s3cret"),)


def backend_environment() -> dict:
    """A backend process's environment: it picks its BLAS afresh, as when LocalAI
    starts it, even though pytest runs with one preloaded (make test)."""
    if fast_blas_in_use(os.environ):
        return blas_choice_environment(os.environ, "auto")
    return dict(os.environ)


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
    """A distributed worker process: ``backend.py --worker --rank N``."""

    def __init__(self, hostfile: Path, rank: int):
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"worker{rank}-", suffix=".log", delete=False
        )
        command = [sys.executable, str(ROOT / "backend.py"), "--worker"]
        command += ["--hostfile", str(hostfile), "--rank", str(rank)]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=backend_environment(),
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
    """A backend process started with ``backend.py --addr 127.0.0.1:0``."""

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        launcher: list | None = None,
        forcing: bool = False,
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
            env={**backend_environment(), **(env or {})},
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

    def wait_for_log(self, text: str, timeout: float = STARTUP_TIMEOUT) -> None:
        """Wait until ``text`` is in the log; RuntimeError if the process exits."""
        deadline = time.monotonic() + timeout
        while text not in self.logs():
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
    """A backend serving the default model (named ``model``), once it is READY."""
    srv = Server("--model", model, forcing=forcing)
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


def stream_texts(stub, request, **kwargs):
    replies = list(stub.PredictStream(request, **kwargs))
    return [r.message.decode() for r in replies], replies[-1]


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


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
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


def make_forcing_processor(tokens: Sequence[int], eos: int):
    """A logits processor under which any sampler picks ``tokens``, then ``eos``.

    The model still runs every step through mlx-lm's generation loop; only its
    choice is fixed. Tests hand it to the engine in ``GenerationRequest.processors``.
    """
    script = list(tokens) + [eos]
    step = 0

    def force(history: mx.array, logits: mx.array) -> mx.array:
        nonlocal step
        token = script[min(step, len(script) - 1)]
        step += 1
        allowed = mx.arange(logits.shape[-1]) == token
        return mx.where(allowed, mx.zeros_like(logits), -mx.inf)

    return force


class ForcingServicer(BackendServicer):
    """The backend for tests that fix what the model generates.

    A request's ``Metadata["forced_tokens"]`` (JSON token ids) is generated exactly,
    then EOS, through the engine's own hook: ``GenerationRequest.processors``.
    """

    def parse_generation(self, request, info: ModelInfo) -> GenerationRequest:
        parsed = super().parse_generation(request, info)
        text = request.Metadata.get("forced_tokens")
        if text is None:
            return parsed
        eos = min(info.tokenizer.eos_token_ids)
        force = make_forcing_processor(json.loads(text), eos)
        return dataclasses.replace(parsed, processors=parsed.processors + (force,))


# -- in-process engine tests -----------------------------------------------


def load_engine(*options: str, draft: str = "") -> Engine:
    engine = Engine()
    engine.load(
        LoadPlan(identity="default", draft=draft, options=parse_options(list(options)))
    ).result()
    return engine


# Speculative decoders' costs where every k costs one pass: each step verifies all
# it can, so runs are long and the same on every machine.
FLAT = (1.0,) * 9

# A llama small enough to build in a test; the tests set its vocabulary.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def make_tiny_draft(
    folder: Path, vocabulary_changed: bool = False, layers: int = 1
) -> Path:
    """A llama of ``layers`` layers with random weights and the default model's
    tokenizer: a draft model whose proposals are mostly wrong, or a model whose
    head counts divide by 2. ``vocabulary_changed`` adds a token, so its
    vocabulary differs from the model's."""
    config = {
        **TINY_LLAMA,
        "num_hidden_layers": layers,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    folder.mkdir(parents=True, exist_ok=True)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    save_tokenizer(metadata, folder)
    if vocabulary_changed:
        path = folder / "tokenizer.json"
        tokenizer = json.loads(path.read_text())
        tokenizer["added_tokens"].append(
            {
                "id": 49152,
                "content": "<draft-only>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        path.write_text(json.dumps(tokenizer))
    return folder


def chat_prompt(engine: Engine, text: str = QUESTION) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    tokenizer = engine.info.tokenizer
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def generation(engine: Engine, text: str = QUESTION, **fields) -> GenerationRequest:
    fields.setdefault("max_tokens", 32)
    return GenerationRequest(
        prompt=chat_prompt(engine, text),
        load_id=engine.info.load_id,
        **fields,
    )


async def collect(engine: Engine, parsed: GenerationRequest) -> list:
    """Every event of one generation; an error ends the list instead of raising."""
    events = []
    try:
        async for event in engine.submit(parsed, asyncio.get_running_loop()):
            events.append(event)
    except Exception as e:
        events.append(e)
    return events


def run(engine: Engine, *requests: GenerationRequest) -> list[list]:
    """The requests' events, submitted together so that they share steps."""

    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    return asyncio.run(main())


def text_of(events: list) -> str:
    return merge_deltas(e.delta for e in events).content


def wait_idle(engine: Engine, turns: int = 200) -> None:
    """Until the engine thread has retired every sequence (each call is a turn)."""
    for _ in range(turns):
        engine.call(lambda: None).result(60)
        if engine.stats.active == 0:
            return
    raise AssertionError(f"{engine.stats.active} sequences still active")


def stats_after(engine: Engine) -> dict[str, int]:
    """Status figures once every sequence is retired."""
    wait_idle(engine)
    return engine.stats.memory


def on_engine_thread(engine: Engine, fn):
    """``fn(model, options)`` on the engine thread, which owns the MLX objects."""
    return engine.call(lambda: fn(engine.served.model, engine.info.options)).result()


def drive(
    decoder, model, options, prompts, max_tokens: int, logprobs: int | None
) -> dict:
    """Each prompt's greedy tokens, logprob entries and final KV state."""
    keys = [
        decoder.add(
            NewSequence(
                prompt=prompt,
                rest=prompt,
                kv_cache=make_kv_cache(model, options),
                sampler=greedy_sampler,
                processors=[],
                max_tokens=max_tokens,
                logprobs=logprobs,
            )
        )
        for prompt in prompts
    ]
    out = {key: ([], [], None) for key in keys}
    pending = set(keys)
    while pending:
        for result in decoder.step():
            assert result.error is None
            tokens, scores, _ = out[result.key]
            tokens += result.tokens
            scores += result.logprobs
            if result.done:
                pending.discard(result.key)
                state = result.state or decoder.remove(result.key)
                out[result.key] = (tokens, scores, state)
    return [out[key] for key in keys]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


# -- LoRA adapters for a tiny llama ----------------------------------------------


def tiny_model() -> llama.Model:
    """The same random tiny llama on every call."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY_LLAMA, "vocab_size": 64}))
    mx.eval(model.parameters())
    return model


def write_adapter(
    folder: Path,
    seed: int,
    own_scale: float = 2.0,
    rank: int = 4,
    config: dict | None = None,
    weights: dict | None = None,
) -> Path:
    """An adapter as mlx_lm.lora saves one, for every linear of the tiny llama's
    layers, with random nonzero lora_b (mlx-lm starts it at zero)."""
    folder.mkdir(parents=True)
    config = config or {
        "fine_tune_type": "lora",
        "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": own_scale, "dropout": 0.0},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if weights is None:
        mx.random.seed(seed)
        weights = {}
        for name, module in tiny_model().named_modules():
            if name.startswith("model.layers.") and isinstance(module, nn.Linear):
                out_dims, in_dims = module.weight.shape
                bound = in_dims**-0.5
                a = mx.random.uniform(-bound, bound, (in_dims, rank))
                weights[f"{name}.lora_a"] = a
                weights[f"{name}.lora_b"] = 0.05 * mx.random.normal((rank, out_dims))
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


# -- chat models: the default weights with reasoning and tool-call markers ----------

MARKER_TOKENS = {3: "<think>", 4: "</think>", 5: "<tool_call>", 6: "</tool_call>"}

# Qwen2.5/Qwen3-style: JSON calls in <tool_call>, reasoning in <think>.
JSON_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

# The same, but the assistant turn opens inside thinking (Qwen3 2507 Thinking).
OPEN_THINK_TEMPLATE = JSON_TEMPLATE.replace(
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n",
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n",
)

# Qwen3-Coder: XML-style calls, <tool_call>\n<function=NAME>\n<parameter=K>\nV\n...
CODER_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
<tool_call>
<function={{ tool_call.function.name }}>
{%- for key, value in tool_call.function.arguments.items() %}
<parameter={{ key }}>
{{ value }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


THOUGHT = "The user wants the weather. I should call the tool."
CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
CALL_LYON = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
REPLY = (
    f"<think>\n{THOUGHT}\n</think>\n\nLet me check both cities."
    f"<tool_call>\n{CALL_PARIS}\n</tool_call>\n<tool_call>\n{CALL_LYON}\n</tool_call>"
)


def make_chat_folder(base: Path, folder: Path, template: str) -> Path:
    """The exported default model with marker tokens and ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json"):
        (folder / name).symlink_to(base / name)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for entry in tokenizer["added_tokens"]:
        if entry["id"] in MARKER_TOKENS:
            del vocab[entry["content"]]
            entry["content"] = MARKER_TOKENS[entry["id"]]
            entry["special"] = False  # as in Qwen: the markers decode as text
            vocab[entry["content"]] = entry["id"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_chat_folders(root: Path) -> dict[str, Path]:
    """The default model exported under ``root``, and a chat folder for each
    template: ``json``, ``open`` (the turn opens inside thinking) and ``coder``."""
    base = export_mlx_folder(default_model_path(), root / "base")
    templates = {
        "json": JSON_TEMPLATE,
        "open": OPEN_THINK_TEMPLATE,
        "coder": CODER_TEMPLATE,
    }
    return {
        name: make_chat_folder(base, root / name, template)
        for name, template in templates.items()
    }
