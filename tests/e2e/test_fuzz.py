"""Property-based fuzzing of every Backend RPC over a real port.

Random and hostile requests (deep JSON, NaN and huge numbers, odd unicode, bad
grammars, out-of-range token ids, failing loads) must end in a proper status code,
never UNKNOWN or INTERNAL, and must never hang. Afterwards the server must still be
alive and answer the greedy reference exactly.
"""

import json
import math
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
from tests.support import ANSWER, QUESTION, chat, start_default_server

# Every call has a client deadline; running into it counts as a hang.
DEADLINE_S = 30.0
# Few generated tokens per request: the machine is slow and the file has a time budget.
MAX_TOKENS = 16
# SmolLM2's vocabulary; token ids probe both of its edges.
VOCAB_SIZE = 49152

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


# -- text -----------------------------------------------------------------------------

# Text the tokenizer, the chat template or a parser may trip on.
ODD_TEXT = [
    "",
    " ",
    "\x00",
    "\x00" * 64,
    "\r\n\t\x0b\x0c\x1b[31m\x7f",
    "\u202e\u200b\ufeff\u2028",
    "e\u0301" * 8,
    "🙂👩‍👩‍👧\U0010ffff",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "{{ raise_exception('boom') }}",
    "{% if %}",
    "\\",
    '"',
    "%s%n",
]
# Each is over the model's 8192-token context, so it is refused before any prefill.
LONG_TEXT = ["hello " * 9000, "\x00" * 20000, "x" * 40000, "東京" * 6000]

short_texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT))
texts = st.one_of(short_texts, st.sampled_from(LONG_TEXT))

# -- JSON -----------------------------------------------------------------------------

DEEP_JSON = [
    "[" * 5000,
    '{"1":' * 3000,
    "[" * 500 + "]" * 500,
    '{"a":' * 300 + "1" + "}" * 300,
    "[" * 101 + "]" * 101,
    "[" * 100 + "]" * 100,
]
ODD_JSON = [
    "null",
    "[]",
    "{}",
    "[null]",
    "[1, 2]",
    '"none"',
    "NaN",
    "-Infinity",
    "1e999",
    "[1",
    "{1: 2}",
    "{'a': 1}",
    '{"a": 1} trailing',
    "\ufeff{}",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
json_texts = st.one_of(
    st.sampled_from(DEEP_JSON),
    st.sampled_from(ODD_JSON),
    json_values.map(json.dumps),
    short_texts,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
tools_texts = st.one_of(
    json_texts,
    st.sampled_from(
        [
            json.dumps([TOOL]),
            '[{"type": "function"}]',
            '[{"function": 1}]',
            '[{"type": "function", "function": {"name": null}}]',
        ]
    ),
    st.lists(json_values, max_size=3).map(json.dumps),
)
tool_choices = st.one_of(
    json_texts,
    st.sampled_from(
        ["none", "auto", "required", '"none"', '{"function": {"name": "weather"}}']
    ),
)
# A message's tool_calls: arguments are JSON text inside JSON, parsed a second time.
tool_calls_texts = st.one_of(
    json_texts,
    st.fixed_dictionaries(
        {
            "id": short_texts,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": short_texts, "arguments": json_texts | json_values}
            ),
        }
    ).map(lambda tool_call: json.dumps([tool_call])),
)

# chat_template_kwargs go to apply_chat_template beside its own arguments.
TEMPLATE_KWARGS = [
    '{"return_dict": true}',
    '{"tokenize": false}',
    '{"messages": []}',
    '{"tools": 1}',
    '{"add_generation_prompt": false}',
    '{"continue_final_message": true}',
    '{"return_tensors": "np"}',
    '{"enable_thinking": "maybe"}',
    '{"chat_template": "{{ 1 / 0 }}"}',
    '{"truncation": true, "max_length": 1}',
]
# A request must not swap the model's chat template: this one loops 10**10 times.
ENDLESS_TEMPLATE = json.dumps(
    {
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}"
    }
)
metadata = st.dictionaries(
    st.one_of(
        st.sampled_from(
            [
                "chat_template_kwargs",
                "enable_thinking",
                "reasoning_effort",
                "forced_tokens",
            ]
        ),
        short_texts,
    ),
    st.one_of(
        json_texts,
        st.sampled_from(TEMPLATE_KWARGS),
        st.sampled_from(["true", "false", "yes", "2"]),
    ),
    max_size=3,
)

# -- grammars and logit bias ----------------------------------------------------------

GRAMMARS = [
    "json",
    " json ",
    "JSON",
    'root ::= "yes"',
    "root ::= root",
    'root ::= "a" root',
    "root ::= [",
    "root ::= x",
    'start: "a"',
    "%llguidance {}\nstart: /(a|b)*/",
    "[1, 2]",
    "1",
    '"s"',
    "null",
    "{}",
    '{"type": "string", "maxLength": 3}',
    '{"type": "integer", "minimum": 5, "maximum": 1}',
    '{"$ref": "#"}',
    '{"type": "string", "pattern": "(a"}',
    '{"type": "array", "minItems": 1000000}',
    '{"enum": []}',
    '{"type": "nope"}',
]
# GBNF-ish text: its punctuation, shuffled.
gbnf_texts = st.text(alphabet='root:=|()[]*+?"\\ -a^\n.{}0123456789', max_size=40)
grammar_texts = st.one_of(
    st.sampled_from(GRAMMARS),
    st.sampled_from(DEEP_JSON),
    gbnf_texts,
    gbnf_texts.map(lambda body: "root ::= " + body),
    json_texts,
)

LOGIT_BIASES = [
    '{"0": 100}',
    '{"2": -100}',
    '{"-1": 1}',
    f'{{"{VOCAB_SIZE}": 1}}',
    '{"99999999999999999999": 1}',
    '{"1": 1e400}',
    '{"1": NaN}',
    '{"1": -Infinity}',
    '{"1": 1e300}',
    '{"1": 3.4e38, "2": 3.4e38}',
    '{"1": true}',
    '{"1": "5"}',
    '{"1": [1]}',
    '{"1e3": 1}',
    '{" 7 ": 1}',
    '{"٣": 1}',
]
logit_biases = st.one_of(
    st.sampled_from(LOGIT_BIASES),
    json_texts,
    st.dictionaries(
        st.integers(-5, VOCAB_SIZE + 5).map(str), st.floats(), max_size=4
    ).map(json.dumps),
)

# -- numbers and token ids ------------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, -2.0, -1e-45, 1e30, -1e30, 3.4e38]
hostile_floats = st.one_of(st.sampled_from(HOSTILE_FLOATS), st.floats(width=32))
hostile_ints = st.one_of(
    st.sampled_from([-(2**31), -1, 0, 2**31 - 1, 21, VOCAB_SIZE]), INT32
)
token_ids = st.one_of(
    st.integers(0, VOCAB_SIZE - 1),
    st.sampled_from([-1, VOCAB_SIZE, -(2**31), 2**31 - 1]),
    INT32,
)
embedding_tokens = st.one_of(
    st.lists(token_ids, max_size=32),
    st.just([0] * 9000),  # over the context: refused before any compute
)

# -- PredictOptions -------------------------------------------------------------------

THE_QUESTION = pb.Message(role="user", content=QUESTION)

ROLES = ["user", "assistant", "system", "tool", "developer", "", "USER", "<|im_start|>"]
sensible_messages = st.builds(
    pb.Message,
    role=st.sampled_from(["user", "assistant", "system"]),
    content=short_texts,
)
hostile_messages = st.builds(
    pb.Message,
    role=st.one_of(st.sampled_from(ROLES), short_texts),
    content=texts,
    name=short_texts,
    tool_call_id=short_texts,
    reasoning_content=short_texts,
    tool_calls=st.one_of(st.just(""), tool_calls_texts),
)


def optional(values):
    """A value, or proto3's zero: the field unset."""
    return st.one_of(st.just(0.0), values)


# A request the backend should serve; predict_options spoils a few of its fields.
sensible_fields = st.fixed_dictionaries(
    {
        "UseTokenizerTemplate": st.booleans(),
        "Prompt": short_texts,
        "Messages": st.lists(sensible_messages, max_size=3),
        "Tokens": st.integers(1, MAX_TOKENS),
        "IgnoreEOS": st.booleans(),
        "Temperature": optional(st.floats(0.1, 2.0)),
        "TopP": optional(st.floats(0.05, 1.0)),
        "TopK": st.integers(0, 100),
        "MinP": optional(st.floats(0.0, 0.5)),
        "Penalty": optional(st.floats(0.5, 2.0)),
        "FrequencyPenalty": optional(st.floats(-2.0, 2.0)),
        "PresencePenalty": optional(st.floats(-2.0, 2.0)),
        "Seed": st.integers(-1, 1000),
        "Logprobs": st.integers(0, 3),
        "TopLogprobs": st.integers(0, 5),
        "StopPrompts": st.lists(short_texts, max_size=2),
        "Embeddings": short_texts,
        "EmbeddingTokens": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
    }
)
HOSTILE_FIELDS = {
    "Prompt": texts,
    "Messages": st.lists(hostile_messages, max_size=4),
    "Tokens": hostile_ints,
    "Temperature": hostile_floats,
    "TopP": hostile_floats,
    "MinP": hostile_floats,
    "Penalty": hostile_floats,
    "FrequencyPenalty": hostile_floats,
    "PresencePenalty": hostile_floats,
    "TopK": hostile_ints,
    "NDraft": hostile_ints,
    "Seed": hostile_ints,
    "Logprobs": hostile_ints,
    "TopLogprobs": hostile_ints,
    "StopPrompts": st.lists(texts, max_size=4),
    "LogitBias": logit_biases,
    "Grammar": grammar_texts,
    "Tools": tools_texts,
    "ToolChoice": tool_choices,
    "Metadata": metadata,
    "ModelIdentity": texts,
    "Embeddings": texts,
    "EmbeddingTokens": embedding_tokens,
    # Fields this backend ignores must stay ignored, whatever they hold.
    "Images": st.lists(texts, max_size=2),
    "Mirostat": hostile_ints,
    "TypicalP": hostile_floats,
    "NegativePrompt": texts,
    "PromptCachePath": texts,
}
# Where Tokens sets no bound (0, negative) or a huge one, only a request that ends by
# itself: the greedy question stops at EOS after seven tokens.
ENDS_BY_ITSELF = dict(
    UseTokenizerTemplate=True,
    Messages=[THE_QUESTION],
    IgnoreEOS=False,
    Temperature=0.0,
    Penalty=0.0,
    FrequencyPenalty=0.0,
    PresencePenalty=0.0,
    LogitBias="",
    Grammar="",
    Tools="",
    ToolChoice="",
    Metadata={},
)


@st.composite
def predict_options(draw) -> pb.PredictOptions:
    """A sensible request with up to three fields made hostile, so most requests
    reach the engine and the hostile values meet the parser, sampler and template."""
    fields = draw(sensible_fields)
    spoiled = st.lists(st.sampled_from(sorted(HOSTILE_FIELDS)), max_size=3, unique=True)
    for name in draw(spoiled):
        fields[name] = draw(HOSTILE_FIELDS[name])
    if not 1 <= fields["Tokens"] <= MAX_TOKENS:
        fields.update(ENDS_BY_ITSELF)
    return pb.PredictOptions(**fields)


# -- the other RPCs' requests ---------------------------------------------------------

score_requests = st.builds(
    pb.ScoreRequest,
    prompt=texts,
    candidates=st.lists(texts, max_size=4),
    include_token_logprobs=st.booleans(),
    length_normalize=st.booleans(),
    ModelIdentity=st.one_of(st.just(""), texts),
    stable_prefix_len=hostile_ints,
)
# ModelMetadata takes ModelOptions, and must not act on them.
model_options = st.builds(
    pb.ModelOptions,
    Model=texts,
    ContextSize=hostile_ints,
    ModelFile=texts,
    Options=st.lists(texts, max_size=3),
)
other_calls = st.one_of(
    st.tuples(
        st.just("Detokenize"),
        st.builds(pb.DetokenizeRequest, tokens=st.lists(token_ids, max_size=64)),
    ),
    st.tuples(st.just("Score"), score_requests),
    st.tuples(st.sampled_from(["Health", "Status"]), st.just(pb.HealthMessage())),
    st.tuples(st.just("GetMetrics"), st.just(pb.MetricsRequest())),
    st.tuples(st.just("ModelMetadata"), model_options),
)

# -- LoadModel requests that must fail ------------------------------------------------

# Each fails to parse on its own; placed last, no later entry can undo it.
BAD_OPTIONS = [
    "temperature:abc",
    "temperature:nan",
    "temp:1e999",
    "top_p:2",
    "penalty:-2",
    "top_k:1.5",
    "max_batch_size:-1",
    "max_batch_size:0",
    "prefill_step_size:0",
    "max_kv_size:-5",
    "max_tokens:-1",
    "max_cache_bytes:1e9",
    "dequantize:maybe",
    "trust_remote_code:perhaps",
    "embedding_pooling:max",
    "no separator",
]
OPTION_KEYS = [
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_tokens",
    "max_batch_size",
    "prefill_step_size",
    "max_kv_size",
    "max_cache_entries",
    "enable_thinking",
    "trust_remote_code",
    "dequantize",
    "embedding_pooling",
    "unknown",
    "",
]
option_texts = st.one_of(
    st.sampled_from(BAD_OPTIONS),
    st.tuples(st.sampled_from(OPTION_KEYS), short_texts).map(":".join),
    short_texts,
)
# Absolute paths and .gguf names, which never reach the Hugging Face Hub.
MISSING_MODELS = [
    "/nonexistent/model",
    "/nonexistent/model.gguf",
    "/etc/passwd",
    "/etc/shadow",
    "/",
    "/etc",
    "/dev/null",
    "/proc/self/status",
    "~/nonexistent.gguf",
    "missing.gguf",
    "../../../../etc/passwd.gguf",
    "/etc/passwd\x00.gguf",
]
missing_models = st.one_of(
    st.sampled_from(MISSING_MODELS),
    short_texts.map(lambda name: "/nonexistent/" + name),
    short_texts.map(lambda name: name + ".gguf"),
)
bad_adapters = st.one_of(
    st.sampled_from(["/nonexistent/adapter", "/etc", "/etc/passwd"]), short_texts
)
bad_loads = st.one_of(
    # A model that is not there; everything else random.
    st.builds(
        pb.ModelOptions,
        Model=missing_models,
        ModelFile=st.one_of(st.just(""), missing_models),
        ModelPath=st.one_of(st.just(""), short_texts),
        LoraAdapter=st.one_of(st.just(""), bad_adapters),
        Options=st.lists(option_texts, max_size=3),
        ContextSize=hostile_ints,
    ),
    # No Model, a ModelFile that is not a model.
    st.builds(pb.ModelOptions, ModelFile=missing_models, ContextSize=hostile_ints),
    # The default model with garbage options, the last of them bad.
    st.builds(
        pb.ModelOptions,
        Model=st.sampled_from(["", "default"]),
        Options=st.tuples(
            st.lists(option_texts, max_size=2), st.sampled_from(BAD_OPTIONS)
        ).map(lambda opts: [*opts[0], opts[1]]),
    ),
    # The default model with an adapter folder that is not one.
    st.builds(
        pb.ModelOptions,
        Model=st.sampled_from(["", "default"]),
        LoraAdapter=bad_adapters.filter(bool),
    ),
)


@st.composite
def gguf_files(draw) -> bytes:
    """What a corrupt or truncated GGUF file starts with: the magic, random version
    and counts, then random bytes."""
    version = draw(st.sampled_from([1, 2, 3]) | st.integers(0, 2**32 - 1))
    tensors = draw(st.integers(0, 2**64 - 1))
    pairs = draw(st.integers(0, 2**64 - 1))
    return b"GGUF" + struct.pack("<IQQ", version, tensors, pairs) + draw(st.binary())


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
