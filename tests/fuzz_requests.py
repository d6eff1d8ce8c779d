"""Hostile requests for the fuzz tests (tests/e2e/test_fuzz.py), built from the
values in ``fuzz_values.py``: PredictOptions (a sensible request with a few
fields made hostile), the other RPCs' requests, LoadModel requests that must fail,
and the start of a corrupt or truncated GGUF file."""

import struct

from hypothesis import strategies as st

import backend_pb2 as pb
from tests.fuzz_values import (
    VOCAB_SIZE,
    embedding_tokens,
    grammar_texts,
    hostile_floats,
    hostile_ints,
    logit_biases,
    metadata,
    short_texts,
    texts,
    token_ids,
    tool_calls_texts,
    tool_choices,
    tools_texts,
)
from tests.support import QUESTION

# Few generated tokens per request: the machine is slow and test_fuzz.py has a
# time budget.
MAX_TOKENS = 16

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
