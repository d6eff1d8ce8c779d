"""Unit tests for the MLX-free helpers, and the proto against the wire contract."""

import json
import math
import re
from pathlib import Path

import pytest

import backend_pb2
from mlx_backend.cpu import preload
from mlx_backend.cpu.allocator import ALLOCATOR_ENV, allocator_in_use, find_allocator
from mlx_backend.cpu.blas import (
    FAST_BLAS_ENV,
    blas_choice_environment,
    fast_blas_in_use,
    find_fast_blas,
    preload_environment,
)
from mlx_backend.cpu.preload import preloaded_environment
from mlx_backend.errors import InvalidArgument
from mlx_backend.switches import switched_off
from python_utils import (
    MAX_JSON_DEPTH,
    LoadOptions,
    TemplateArgs,
    check_sampling,
    convert_messages,
    encode_prompt,
    json_nesting,
    parse_duration,
    parse_json_field,
    parse_logit_bias,
    parse_logprobs,
    parse_options,
    parse_template_args,
    parse_tool_choice,
    parse_tools,
    render_chat,
)

WIRE_REFERENCE = (
    Path(__file__).resolve().parents[2] / "shared/reference/localai-backend-wire.md"
)


def test_parse_options_typed_values_and_aliases():
    options = parse_options(
        [
            "temperature:0.7",
            "top_k: 40",
            "max_tokens:128",
            "enable_thinking:false",
            "penalty:1.1",
        ]
    )
    assert options == LoadOptions(
        temperature=0.7,
        top_k=40,
        max_tokens=128,
        enable_thinking=False,
        repetition_penalty=1.1,
    )


def test_parse_options_dequantize_switches():
    assert parse_options(["dequantize:auto"]).dequantize is None
    assert parse_options(["dequantize:false"]).dequantize is False
    assert parse_options(["dequantize_max_bytes:1000"]).dequantize_max_bytes == 1000
    with pytest.raises(InvalidArgument, match="dequantize_max_bytes"):
        parse_options(["dequantize_max_bytes:0"])


def test_parse_options_kv_dtype():
    assert parse_options([]).kv_dtype == "auto"
    assert parse_options(["kv_dtype:Float16"]).kv_dtype == "float16"
    with pytest.raises(InvalidArgument, match="kv_dtype must be one of auto"):
        parse_options(["kv_dtype:bfloat16"])


def test_fast_blas_switch_and_discovery(tmp_path):
    assert not switched_off({}, FAST_BLAS_ENV)
    assert not switched_off({FAST_BLAS_ENV: "auto"}, FAST_BLAS_ENV)
    for word in ("off", "false", "0", "No"):
        assert switched_off({FAST_BLAS_ENV: word}, FAST_BLAS_ENV)
    assert fast_blas_in_use({}) is None
    assert fast_blas_in_use({FAST_BLAS_ENV: "auto"}) is None
    # A path counts only once it is preloaded, i.e. after the restart.
    assert fast_blas_in_use({FAST_BLAS_ENV: "/x/libopenblas.so.0"}) is None
    assert (
        fast_blas_in_use(preload_environment({}, "/x/libopenblas.so.0"))
        == "/x/libopenblas.so.0"
    )


def test_find_fast_blas_by_family_and_path(tmp_path):
    mkl, openblas = (
        tmp_path / "libmkl_rt.so.3",
        tmp_path / "OpenBLAS" / "libopenblas.so.0",
    )
    openblas.parent.mkdir()
    candidates = {"mkl": (str(mkl),), "openblas": ("/nope.so", str(openblas))}
    assert find_fast_blas(candidates=candidates) is None
    openblas.write_bytes(b"")
    assert find_fast_blas(candidates=candidates) == str(openblas)
    assert find_fast_blas("mkl", candidates) is None
    mkl.write_bytes(b"")
    assert find_fast_blas("auto", candidates) == str(mkl)
    assert find_fast_blas("OpenBLAS", candidates) == str(openblas)
    assert find_fast_blas(str(openblas), candidates) == str(openblas)
    assert find_fast_blas(str(tmp_path / "missing.so"), candidates) is None
    with pytest.raises(ValueError, match=f"{FAST_BLAS_ENV}='atlas'"):
        find_fast_blas("atlas", candidates)


def test_preload_environment_keeps_other_preloads():
    env = preload_environment({"LD_PRELOAD": "/a.so", "PATH": "/bin"}, "/blas.so")
    assert env == {
        "LD_PRELOAD": "/blas.so:/a.so",
        "PATH": "/bin",
        FAST_BLAS_ENV: "/blas.so",
    }
    again = preload_environment(env, "/blas.so")
    assert again["LD_PRELOAD"] == "/blas.so:/a.so"
    # A child told to choose again loses this process's BLAS, not the others.
    child = blas_choice_environment(env, "off")
    assert child == {"LD_PRELOAD": "/a.so", "PATH": "/bin", FAST_BLAS_ENV: "off"}


def test_find_allocator_by_family_and_path(tmp_path):
    jemalloc, tcmalloc = tmp_path / "libjemalloc.so.2", tmp_path / "libtc.so.4"
    candidates = {"jemalloc": (str(jemalloc),), "tcmalloc": (str(tcmalloc),)}
    assert find_allocator(candidates=candidates) is None
    tcmalloc.write_bytes(b"")
    assert find_allocator(candidates=candidates) == str(tcmalloc)
    jemalloc.write_bytes(b"")
    assert find_allocator("auto", candidates) == str(jemalloc)
    assert find_allocator("TCMalloc", candidates) == str(tcmalloc)
    with pytest.raises(ValueError, match=f"{ALLOCATOR_ENV}='mimalloc'"):
        find_allocator("mimalloc", candidates)


def test_preloaded_environment_adds_the_allocator_and_the_blas_once(
    tmp_path, monkeypatch
):
    """Both libraries go in front of the host's preloads, the allocator first; the
    restarted process finds them in use and adds nothing (no second restart)."""
    monkeypatch.setattr(preload, "linux_cpu_build", lambda: True)
    malloc, library = tmp_path / "libjemalloc.so.2", tmp_path / "libblas.so"
    malloc.write_bytes(b"")
    library.write_bytes(b"")
    # The host's list may be spaced, as the loader allows.
    host = {"LD_PRELOAD": " /a.so ", ALLOCATOR_ENV: str(malloc)}
    host[FAST_BLAS_ENV] = str(library)
    env = preloaded_environment(host)
    assert env["LD_PRELOAD"] == f"{malloc}:{library}:/a.so"
    assert allocator_in_use(env) == str(malloc)
    assert fast_blas_in_use(env) == str(library)
    assert preloaded_environment(env) == env
    # Each switch off leaves its library out; a missing library adds nothing.
    assert preloaded_environment({**host, ALLOCATOR_ENV: "off"})["LD_PRELOAD"] == (
        f"{library}:/a.so"
    )
    assert preloaded_environment({**host, FAST_BLAS_ENV: "off"})["LD_PRELOAD"] == (
        f"{malloc}:/a.so"
    )
    missing = {ALLOCATOR_ENV: str(tmp_path / "none.so"), FAST_BLAS_ENV: "off"}
    assert preloaded_environment(missing) == missing
    # A child that picks its BLAS afresh keeps the allocator.
    assert allocator_in_use(blas_choice_environment(env, "auto")) == str(malloc)
    # A path the loader's list can't hold is skipped, not restarted for forever.
    spaced = tmp_path / "my libs" / "libjemalloc.so.2"
    spaced.parent.mkdir()
    spaced.write_bytes(b"")
    odd = {ALLOCATOR_ENV: str(spaced), FAST_BLAS_ENV: "off"}
    assert preloaded_environment(odd) == odd


def test_parse_options_ignores_unknown_keys():
    assert parse_options(["gpu_layers:99"]) == LoadOptions()


@pytest.mark.parametrize(
    "entry, message",
    [
        ("max_tokens:many", "max_tokens"),
        ("enable_thinking:maybe", "enable_thinking"),
        ("no-colon", "key:value"),
        ("prefill_step_size:0", "prefill_step_size"),
        ("max_kv_size:0", "max_kv_size"),
        ("max_tokens:-1", "max_tokens"),
        ("temperature:nan", "temperature"),
        ("top_p:1.5", "top_p"),
        ("frequency_penalty:-3", "frequency_penalty"),
        ("penalty:inf", "repetition_penalty"),
        ("max_stream_backlog:0", "max_stream_backlog"),
        ("speculative:maybe", "speculative"),
        ("cpu_pacing:sometimes", "cpu_pacing must be one of auto, on, off"),
        ("num_draft_tokens:33", "num_draft_tokens"),
        ("num_draft_tokens:-1", "num_draft_tokens"),
        ("ngram_min:0", "ngram_min"),
        ("ngram_min:5", "ngram_max"),
    ],
)
def test_parse_options_rejects_bad_values(entry, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_options([entry])


@pytest.mark.parametrize(
    "text, seconds",
    [("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("3", 3.0), ("0.25", 0.25)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage():
    with pytest.raises(ValueError):
        parse_duration("soon")


class Message:
    def __init__(
        self,
        role,
        content="",
        name="",
        tool_call_id="",
        reasoning_content="",
        tool_calls="",
    ):
        self.role, self.content, self.name = role, content, name
        self.tool_call_id, self.reasoning_content, self.tool_calls = (
            tool_call_id,
            reasoning_content,
            tool_calls,
        )


def test_convert_messages_decodes_tool_call_arguments():
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'},
        }
    ]
    converted = convert_messages(
        [
            Message("user", "hi", name="bob"),
            Message(
                "assistant", "", reasoning_content="hmm", tool_calls=json.dumps(calls)
            ),
            Message("tool", "42", tool_call_id="c1"),
        ]
    )
    assert converted == [
        {"role": "user", "content": "hi", "name": "bob"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "hmm",
            "tool_plan": "hmm",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": 1}},
                }
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize(
    "tool_calls, where",
    [
        ("[oops", "Messages[1].tool_calls"),
        ('"text"', "Messages[1].tool_calls"),
        (
            '[{"function": {"name": "f", "arguments": "{bad"}}]',
            "Messages[1].tool_calls.arguments",
        ),
        ('[{"name": "f"}]', "Messages[1].tool_calls"),
    ],
)
def test_convert_messages_names_the_bad_field(tool_calls, where):
    with pytest.raises(InvalidArgument, match=re.escape(where)):
        convert_messages(
            [Message("user", "x"), Message("assistant", tool_calls=tool_calls)]
        )


def test_parse_tools_and_tool_choice():
    assert parse_tools("") is None
    assert parse_tools('[{"type": "function"}]') == [{"type": "function"}]
    with pytest.raises(InvalidArgument, match="Tools"):
        parse_tools('{"type": "function"}')
    assert parse_tool_choice('"none"') == "none"
    assert parse_tool_choice("auto") == "auto"
    assert parse_tool_choice('{"type": "function"}') == {"type": "function"}
    with pytest.raises(InvalidArgument, match="ToolChoice: malformed JSON"):
        parse_tool_choice('{"type": ')


@pytest.mark.parametrize(
    "name, good, bad",
    [
        ("temperature", [0.0, 0.7, 2.0], [-0.1, 2.01]),
        ("top_p", [0.0, 1.0], [-0.5, 1.5]),
        ("min_p", [0.0, 0.05, 1.0], [1.01]),
        ("repetition_penalty", [0.0, 1.1, 50.0], [-2.0]),
        ("frequency_penalty", [-2.0, 0.0, 2.0], [-2.5, 2.5]),
        ("presence_penalty", [-2.0, 1.5], [3.0]),
    ],
)
def test_sampling_values_are_refused_outside_their_range(name, good, bad):
    for value in good:
        assert check_sampling("Field", name, value) == value
    for value in bad + [math.nan, math.inf, -math.inf]:
        with pytest.raises(InvalidArgument, match="^Field must be a finite number"):
            check_sampling("Field", name, value)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        '{"1":' * 3000,
        "[" * 101 + "]" * 101,
        '{"a": ' * 101 + "1" + "}" * 101,
    ],
)
def test_deeply_nested_json_is_invalid_argument(text):
    with pytest.raises(InvalidArgument, match="^Tools: JSON nested deeper than 100"):
        parse_json_field("Tools", text)
    with pytest.raises(InvalidArgument, match="^ToolChoice: JSON nested deeper"):
        parse_tool_choice(text)


def test_json_nesting():
    assert json_nesting("1") == 0 and json_nesting("[]") == 1
    assert json_nesting('{"a": [1]}') == 2
    # Brackets inside strings, escaped quotes among them, do not nest.
    assert json_nesting('["[[{", "\\"[["]') == 1
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json_field("Tools", deepest) == json.loads(deepest)


def test_parse_logit_bias_refuses_non_finite_biases():
    for text in ('{"1": NaN}', '{"1": Infinity}', '{"1": 1e999}', '{"1": "x"}'):
        with pytest.raises(InvalidArgument, match="LogitBias.*finite number"):
            parse_logit_bias(text, vocab_size=10)


def test_parse_logit_bias_ignores_out_of_vocabulary_ids():
    assert parse_logit_bias('{"5": -100, "99": 2, "-1": 3}', vocab_size=10) == {
        5: -100.0
    }
    assert parse_logit_bias("", vocab_size=10) == {}
    with pytest.raises(InvalidArgument, match="LogitBias"):
        parse_logit_bias("[1, 2]", vocab_size=10)


def test_parse_template_args():
    tools = '[{"type": "function", "function": {"name": "f"}}]'
    args = parse_template_args(
        tools, "", {"enable_thinking": "true", "chat_template_kwargs": '{"x": 1}'}, None
    )
    assert args == TemplateArgs(
        tools=json.loads(tools), enable_thinking=True, extra={"x": 1}
    )
    assert parse_template_args(tools, '"none"', {}, False) == TemplateArgs(
        enable_thinking=False
    )
    with_effort = parse_template_args("", "", {"reasoning_effort": "low"}, None)
    assert with_effort.extra == {"reasoning_effort": "low"}
    with pytest.raises(InvalidArgument, match="Metadata.enable_thinking"):
        parse_template_args("", "", {"enable_thinking": "perhaps"}, None)


@pytest.mark.parametrize(
    "name", ["chat_template", "return_tensors", "tokenize", "messages", "tools"]
)
def test_chat_template_kwargs_cannot_set_apply_chat_template_arguments(name):
    # A request's own template could loop without end; others change the result.
    kwargs = json.dumps({name: "{% for i in range(10**9) %}{% endfor %}"})
    with pytest.raises(InvalidArgument, match=f"'{name}' is an argument"):
        parse_template_args("", "", {"chat_template_kwargs": kwargs}, None)


class FakeTokenizer:
    bos_token = "<s>"

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens):
        self.calls.append((text, add_special_tokens))
        return [1, 2] if add_special_tokens else [2]

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("fail"):
            raise ValueError("template exploded")
        return [7, 8, 9]


def test_encode_prompt_adds_bos_only_when_missing():
    tokenizer = FakeTokenizer()
    assert encode_prompt(tokenizer, "hello") == [1, 2]
    assert encode_prompt(tokenizer, "<s>hello") == [2]


def test_render_chat_passes_template_arguments():
    tokenizer = FakeTokenizer()
    args = TemplateArgs(tools=[{"t": 1}], enable_thinking=False, extra={"k": "v"})
    assert render_chat(tokenizer, [{"role": "user", "content": "x"}], args) == [7, 8, 9]
    assert tokenizer.calls[-1] == {
        "tools": [{"t": 1}],
        "add_generation_prompt": True,
        "tokenize": True,
        "k": "v",
        "enable_thinking": False,
    }
    with pytest.raises(InvalidArgument, match="template exploded"):
        render_chat(tokenizer, [], TemplateArgs(extra={"fail": True}))


# -- backend.proto against the wire contract ----------------------------------------

_PROTO_TYPES = {
    "string": "string",
    "bytes": "bytes",
    "bool": "bool",
    "int32": "int32",
    "uint64": "uint64",
    "float": "float",
    "double": "double",
}


def _reference_tables() -> dict[str, dict[int, tuple[str, str]]]:
    tables: dict[str, dict[int, tuple[str, str]]] = {}
    current = None
    for line in WIRE_REFERENCE.read_text().splitlines():
        heading = re.match(r"^## (\w+)$", line)
        if heading:
            current = heading.group(1)
            continue
        row = re.match(r"^\| (\d+) \| (\w+) \| (.+?) \|$", line)
        if current and row:
            tables.setdefault(current, {})[int(row.group(1))] = (
                row.group(2),
                row.group(3),
            )
    return tables


def _type_name(field) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields
        return f"map<{_type_name(key)}, {_type_name(value)}>"
    if field.message_type is not None:
        base = field.message_type.name
    elif field.enum_type is not None:
        base = field.enum_type.name
    else:
        base = {
            field.TYPE_STRING: "string",
            field.TYPE_BYTES: "bytes",
            field.TYPE_BOOL: "bool",
            field.TYPE_INT32: "int32",
            field.TYPE_UINT64: "uint64",
            field.TYPE_FLOAT: "float",
            field.TYPE_DOUBLE: "double",
        }[field.type]
    repeated = (
        field.is_repeated
        if hasattr(field, "is_repeated")
        else field.label == field.LABEL_REPEATED
    )
    return f"repeated {base}" if repeated else base


@pytest.mark.skipif(
    not WIRE_REFERENCE.exists(), reason="the wire reference is not beside the checkout"
)
def test_proto_matches_the_wire_reference():
    tables = _reference_tables()
    assert len(tables) > 20
    for message, fields in tables.items():
        descriptor = backend_pb2.DESCRIPTOR.message_types_by_name.get(message)
        if descriptor is None:
            nested = {"State"}  # enums are not tables of fields
            assert message in nested, f"{message} is missing from backend.proto"
            continue
        declared = {f.number: (f.name, _type_name(f)) for f in descriptor.fields}
        assert declared == fields, message


def test_service_declares_the_text_rerank_and_fine_tuning_surface():
    methods = {
        m.name for m in backend_pb2.DESCRIPTOR.services_by_name["Backend"].methods
    }
    assert methods == {
        "Health",
        "Free",
        "LoadModel",
        "Predict",
        "PredictStream",
        "Embedding",
        "TokenizeString",
        "Detokenize",
        "Status",
        "GetMetrics",
        "Score",
        "Rerank",
        "ModelMetadata",
        "StartFineTune",
        "FineTuneProgress",
        "StopFineTune",
        "ListCheckpoints",
        "ExportModel",
    }


@pytest.mark.parametrize(
    "logprobs, top, expected",
    [(0, 0, None), (1, 0, 0), (0, 3, 3), (5, 5, 5), (1, 20, 20)],
)
def test_parse_logprobs(logprobs, top, expected):
    assert parse_logprobs(logprobs, top) == expected


@pytest.mark.parametrize(
    "logprobs, top, field", [(-1, 0, "Logprobs"), (1, 21, "TopLogprobs")]
)
def test_parse_logprobs_refuses_bad_counts(logprobs, top, field):
    with pytest.raises(InvalidArgument, match=field):
        parse_logprobs(logprobs, top)


def test_parse_options_embedding_pooling():
    assert parse_options([]).embedding_pooling == "mean"
    assert parse_options(["embedding_pooling: Last"]).embedding_pooling == "last"
    with pytest.raises(InvalidArgument, match="embedding_pooling"):
        parse_options(["embedding_pooling:max"])
