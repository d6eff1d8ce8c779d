"""Every chat format end to end over gRPC, unary and streaming: each family's chat
model (tests/chat_models.py ``FAMILIES``: a tiny llama with the default tokenizer,
the family's real chat template and marker tokens) generates the family's exact reply (forced
tokens, through the real generation loop), and the client gets it structured."""

import json
import re

import pytest

import backend_pb2 as pb
from tests.chat_models import FAMILIES
from tests.support import merge_chat_deltas
from tests.unit.test_chat_formats import CASES, WEATHER_TOOL


@pytest.fixture(scope="module")
def server(forcing_server):
    return forcing_server


def merged(chat_deltas) -> tuple:
    """Content, reasoning and calls (name, arguments) as the frontend merges them."""
    content, reasoning, calls = merge_chat_deltas(chat_deltas)
    return content, reasoning, tuple((name, args) for _, _, name, args in calls)


@pytest.mark.parametrize("name, i", CASES)
def test_each_family_streams_what_predict_returns(
    server, folders, chat_models, name, i
):
    family = FAMILIES[name]
    if server.test_model != name:
        result = server.stub.LoadModel(pb.ModelOptions(Model=str(folders[name])))
        assert result.success, result.message
        assert f"chat format {family.format}" in result.message
        server.test_model = name
    expected = family.replies[i]
    tokenizer = chat_models(name)[0]
    tokens = tokenizer.encode(expected.text, add_special_tokens=False)
    request = pb.PredictOptions(
        UseTokenizerTemplate=True,
        Messages=[pb.Message(role="user", content="Weather in Paris and Lyon?")],
        Tools=json.dumps([WEATHER_TOOL]),
        Metadata={
            "forced_tokens": json.dumps(tokens),
            "chat_template_kwargs": json.dumps(expected.kwargs),
        },
    )
    reply = server.stub.Predict(request)
    assert merged(reply.chat_deltas) == (
        expected.content,
        expected.reasoning,
        expected.calls,
    )
    assert reply.message.decode() == expected.content
    stream = list(server.stub.PredictStream(request))
    deltas = [d for r in stream for d in r.chat_deltas]
    assert merged(deltas) == merged(reply.chat_deltas)
    markers = [m for m in family.tokens if m in expected.text]
    for delta in deltas:
        text = delta.content + delta.reasoning_content
        assert not any(m in text for m in markers)
    # Each call's id and name come once, on its first delta; Mistral's ids are
    # the nine alphanumerics its templates take, the model's own where it wrote one
    # (Kimi's functions.NAME:INDEX, which its template writes back).
    firsts = [c for d in deltas for c in d.tool_calls if c.name]
    assert [c.index for c in firsts] == list(range(len(expected.calls)))
    ids = [c.id for c in firsts]
    pattern = r"call_\w{24}"
    if family.format.startswith("mistral"):
        pattern = r"[A-Za-z0-9]{9}"
    elif family.format.startswith("kimi_k2"):
        pattern = r"functions\.get_weather:\d+"
    assert len(set(ids)) == len(ids) and all(re.fullmatch(pattern, i) for i in ids)
    if name == "mistral_small_3_2":
        assert ids == ["a1B2c3D4e", "Zz9Yy8Xx7"]
