"""Property-based fuzzing of every Backend RPC over a real port.

Random and hostile requests (deep JSON, NaN and huge numbers, odd unicode, bad
grammars, out-of-range token ids, failing loads) must end in a proper status code,
never UNKNOWN or INTERNAL, and must never hang. Afterwards the server must still be
alive and answer the greedy reference exactly. The hostile values are in
``tests/fuzz_values.py`` and the requests built from them in
``tests/fuzz_requests.py``.
"""

import json
import struct

import grpc
import pytest
from hypothesis import (
    HealthCheck,
    Phase,
    currently_in_test_context,
    event,
    example,
    given,
    settings,
)
from hypothesis import strategies as st

import backend_pb2 as pb
from mlx_backend.models.loading import default_model_path
from tests.fuzz_requests import (
    MAX_TOKENS,
    THE_QUESTION,
    bad_loads,
    gguf_files,
    other_calls,
    predict_options,
)
from tests.fuzz_values import (
    DEEP_JSON,
    ENDLESS_TEMPLATE,
    GRAMMARS,
    HOSTILE_FLOATS,
    LOGIT_BIASES,
    LONG_TEXT,
    TEMPLATE_KWARGS,
    VOCAB_SIZE,
)
from tests.support import ANSWER, QUESTION, chat, start_default_server

# Every call has a client deadline; running into it counts as a hang.
DEADLINE_S = 30.0

# How a call may not end: an unhandled exception (UNKNOWN, INTERNAL), a hang
# (DEADLINE_EXCEEDED) or a server that went away (UNAVAILABLE).
BUGS = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
}

FUZZ = settings(
    deadline=None,  # RPC latency is noisy here; DEADLINE_S catches hangs
    derandomize=True,  # the same examples on every run, as CI needs
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


class Backend:
    """The backend process under test. An input that kills it fails, and a new
    process is started, so that later examples (and shrinking) meet a live server."""

    def __init__(self):
        self.deaths: list[str] = []
        self.server = start_default_server()

    @property
    def stub(self):
        return self.server.stub

    def check_alive(self, rpc: str):
        code = self.server.process.poll()
        if code is None:
            return
        tail = "\n".join(self.server.logs().splitlines()[-10:])
        self.deaths.append(f"{rpc} (exit code {code})")
        self.server.stop()
        self.server = start_default_server()
        raise AssertionError(f"{rpc} killed the server (exit code {code}):\n{tail}")


@pytest.fixture(scope="module")
def backend():
    backend = Backend()
    yield backend
    backend.server.stop()


def call(backend: Backend, rpc: str, request):
    """Make one call with a deadline (a stream is read to its end) and check how it
    ended. Returns the reply, the stream's replies, or the error."""
    try:
        reply = getattr(backend.stub, rpc)(request, timeout=DEADLINE_S)
        if rpc == "PredictStream":
            reply = list(reply)
    except grpc.RpcError as error:
        reply = error
    backend.check_alive(rpc)
    ended = reply.code() if isinstance(reply, grpc.RpcError) else grpc.StatusCode.OK
    if currently_in_test_context():  # --hypothesis-show-statistics: how calls ended
        event(f"{rpc}: {ended.name}")
    assert ended not in BUGS, f"{rpc} ended in {ended.name}: {reply.details()}"
    return reply


# -- the tests ------------------------------------------------------------------------


def check_failed_load(backend: Backend, request: pb.ModelOptions):
    """LoadModel must fail, and the model loaded before must go on serving."""
    result = call(backend, "LoadModel", request)
    succeeded = isinstance(result, pb.Result) and result.success
    # Any RPC that needs the model tells whether it is still loaded.
    kept = call(backend, "TokenizeString", pb.PredictOptions(Prompt="Paris"))
    if succeeded or not isinstance(kept, pb.TokenizationResponse):
        # Put the default model back, so that the next case meets the same server.
        restored = backend.stub.LoadModel(pb.ModelOptions(Model="default"), timeout=120)
        assert restored.success, restored.message
    assert not succeeded, f"LoadModel succeeded: {result.message}"
    assert isinstance(kept, pb.TokenizationResponse), (
        f"the failed LoadModel unloaded the model ({kept.details()}); "
        f"it answered: {getattr(result, 'message', result)}"
    )


SAMPLING_FIELDS = [
    "Temperature",
    "TopP",
    "MinP",
    "Penalty",
    "FrequencyPenalty",
    "PresencePenalty",
]
INT_EDGES = [-(2**31), -1, 2**31 - 1, VOCAB_SIZE]


def json_in_every_json_field(text: str) -> list[dict]:
    """PredictOptions fields that put ``text`` wherever a request carries JSON."""
    tool_call = {"function": {"name": "f", "arguments": text}}
    return [
        {"Tools": text},
        {"ToolChoice": text},
        {"LogitBias": text},
        {"Grammar": text},
        {"Metadata": {"chat_template_kwargs": text}},
        {"Messages": [THE_QUESTION, pb.Message(role="assistant", tool_calls=text)]},
        {
            "Messages": [
                THE_QUESTION,
                pb.Message(role="assistant", tool_calls=json.dumps([tool_call])),
            ]
        },
    ]


def shown(value) -> str:
    """A short one-line repr: long hostile strings are cut."""
    if isinstance(value, list) and value and isinstance(value[-1], pb.Message):
        value = value[-1]  # the hostile message; the one before is the question
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else f"{text[:64]}...({len(text)} chars)"


def named_cases() -> list[tuple[str, dict, object]]:
    """The issue's hostile values, one per request: generation fields on the question
    (greedy, and sampled where the sampler reads them), then the other RPCs' and
    LoadModel's. Each case is (rpc, the fields it sets, request)."""
    # Each also with sampling (not greedy), so that the sampler meets them too.
    sampled = {"Temperature": 0.7, "Seed": 1}
    fields = [{name: v} for name in SAMPLING_FIELDS for v in HOSTILE_FLOATS]
    fields += [
        {**sampled, name: v} for name in SAMPLING_FIELDS[1:] for v in HOSTILE_FLOATS
    ]
    fields += [
        {**sampled, name: v}
        for name in ["TopK", "NDraft", "Seed", "Logprobs", "TopLogprobs"]
        for v in INT_EDGES
    ]
    fields += [
        case for text in DEEP_JSON[:3] for case in json_in_every_json_field(text)
    ]
    fields += [{"Grammar": text} for text in GRAMMARS]
    fields += [{"LogitBias": text} for text in LOGIT_BIASES]
    fields += [{**sampled, "LogitBias": text} for text in LOGIT_BIASES]
    fields += [{"Metadata": {"chat_template_kwargs": text}} for text in TEMPLATE_KWARGS]
    fields += [{"StopPrompts": ["", "\x00", "The", LONG_TEXT[0]]}]
    question = dict(UseTokenizerTemplate=True, Messages=[THE_QUESTION], Tokens=2)
    cases = [("Predict", f, pb.PredictOptions(**{**question, **f})) for f in fields]
    bad_ids = [[-1], [VOCAB_SIZE], [-(2**31)], [2**31 - 1], [0] * 9000]
    for ids in bad_ids:
        embed = pb.PredictOptions(EmbeddingTokens=ids)
        cases.append(("Embedding", {"EmbeddingTokens": ids}, embed))
        cases.append(("Detokenize", {"tokens": ids}, pb.DetokenizeRequest(tokens=ids)))
    for candidates in [[], [""], ["\x00"], [" ", "ok"], [LONG_TEXT[2]]]:
        score = {"prompt": "Hi", "candidates": candidates}
        cases.append(("Score", score, pb.ScoreRequest(**score)))
    for load in [
        {"Model": "/nonexistent/model.gguf"},
        {"Model": "/etc/passwd"},
        {"ModelFile": "/etc/shadow"},
        {"Model": "default", "LoraAdapter": "/nonexistent/adapter"},
        {"Model": "default", "Options": ["temperature:abc"]},
        {"Model": "default", "Options": ["max_batch_size:-1"]},
        {"Model": "default", "Options": ["temperature:nan"]},
        {"Model": "default", "Options": ["penalty:-2"]},
    ]:
        cases.append(("LoadModel", load, pb.ModelOptions(**load)))
    return cases


def test_named_hostile_values(backend):
    """Each named hostile value alone, on every run; all failures are listed at once."""
    failures = []
    cases = named_cases()
    for rpc, fields, request in cases:
        try:
            if rpc == "LoadModel":
                check_failed_load(backend, request)
            else:
                call(backend, rpc, request)
        except AssertionError as error:
            args = ", ".join(f"{name}={shown(v)}" for name, v in fields.items())
            failures.append(f"{rpc}({args}): {str(error).splitlines()[0]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(
        failures
    )


@settings(FUZZ, max_examples=30)
@given(rpc=st.sampled_from(["Predict", "PredictStream"]), request=predict_options())
def test_generation(backend, rpc, request):
    reply = call(backend, rpc, request)
    final = reply[-1] if isinstance(reply, list) else reply
    if isinstance(final, pb.Reply) and 1 <= request.Tokens <= MAX_TOKENS:
        assert final.tokens <= request.Tokens  # the limit holds whatever else is sent


@settings(FUZZ, max_examples=60)
@given(rpc=st.sampled_from(["TokenizeString", "Embedding"]), request=predict_options())
def test_tokenize_and_embed(backend, rpc, request):
    call(backend, rpc, request)


@settings(FUZZ, max_examples=80)
@given(rpc_and_request=other_calls)
def test_other_rpcs(backend, rpc_and_request):
    call(backend, *rpc_and_request)


@settings(FUZZ, max_examples=40)
@given(request=bad_loads)
def test_failed_load_keeps_the_model(backend, request):
    check_failed_load(backend, request)


def test_a_request_cannot_run_its_own_chat_template(backend):
    # Never drawn, and after the other generation tests: where it hangs, it keeps a
    # core busy until the server stops.
    kwargs = {"chat_template_kwargs": ENDLESS_TEMPLATE}
    call(backend, "Predict", chat(Tokens=2, Metadata=kwargs))


@pytest.fixture(scope="module")
def corrupt_gguf(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "corrupt.gguf"


# The start of the real model: a truncated download.
with default_model_path().open("rb") as model_file:
    TRUNCATED_MODEL = model_file.read(200_000)


# Zero tensors, then a metadata key that claims 2**63 - 1 bytes: mx.load crashes.
@example(contents=b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**63 - 1))
# Not shrunk: each crash costs a restart of the server.
@settings(FUZZ, max_examples=50, phases=[Phase.explicit, Phase.generate])
@given(
    contents=st.one_of(
        gguf_files(),
        st.sampled_from([0, 4, 24, 100, 10_000, 200_000]).map(
            lambda size: TRUNCATED_MODEL[:size]
        ),
    )
)
def test_corrupt_gguf_file_is_refused(backend, corrupt_gguf, contents):
    corrupt_gguf.write_bytes(contents)
    check_failed_load(backend, pb.ModelOptions(Model=str(corrupt_gguf)))


def test_server_still_serves_the_greedy_reference(backend):
    # Last in the file: after everything above, the first process still runs and
    # answers exactly as before.
    assert not backend.deaths, f"inputs killed the server: {backend.deaths}"
    reply = backend.stub.Predict(chat(QUESTION, Tokens=64), timeout=DEADLINE_S)
    assert reply.message.decode() == ANSWER
    assert backend.server.process.poll() is None
