"""Unit tests: a reply's text is decode(prompt + reply) - decode(prompt), byte for byte,
with the default model's BPE tokenizer and a SentencePiece-style one built here."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from mlx_backend.models.gguf import save_tokenizer
from mlx_backend.models.loading import default_model_path
from mlx_backend.output.detokenizer import (
    ContinuationDetokenizer,
    _bpe_bytes,
    make_token_bytes,
)

CORPUS = [
    "The capital of France is Paris.",
    "Once upon a time there was a lighthouse keeper.",
    "Hello world, hello again, and hello once more.",
    "A café in Lyon sells croissants and bread.",
]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def build_spm_folder(folder: Path) -> Path:
    """A Llama-style tokenizer: ▁ for spaces, byte fallback, and the decoder that
    strips the first space, which mlx-lm streams with its SPM detokenizer."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *BYTES]
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    bpe_folder = tmp_path_factory.mktemp("bpe")
    _, metadata = mx.load(str(default_model_path()), return_metadata=True)
    save_tokenizer(metadata, bpe_folder)
    spm_folder = build_spm_folder(tmp_path_factory.mktemp("spm"))
    loaded = {"bpe": load_tokenizer(bpe_folder), "spm": load_tokenizer(spm_folder)}
    assert isinstance(loaded["bpe"].detokenizer, BPEStreamingDetokenizer)
    assert isinstance(loaded["spm"].detokenizer, SPMStreamingDetokenizer)
    return loaded


@pytest.fixture(scope="module")
def tables(tokenizers) -> dict:
    """Each tokenizer's token bytes, built once rather than per example."""
    return {kind: make_token_bytes(t) for kind, t in tokenizers.items()}


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def stream(tokenizer, prompt: list[int], reply: list[int]) -> list[str]:
    """The pieces a reply streams, one per token, then what finalize flushes."""
    detokenizer = ContinuationDetokenizer(tokenizer, prompt)
    pieces = []
    for token in reply:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    return pieces + [detokenizer.last_segment]


def continuation(tokenizer, prompt: list[int], reply: list[int]) -> str:
    whole, head = decode(tokenizer, prompt + reply), decode(tokenizer, prompt)
    assert whole.startswith(head)
    return whole[len(head) :]


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_a_continuation_keeps_its_first_space(tokenizers, kind):
    tokenizer = tokenizers[kind]
    prompt = tokenizer.encode("The capital of France is")
    reply = tokenizer.encode(" Paris.", add_special_tokens=False)
    if kind == "spm":
        # SentencePiece writes the space as part of the word: "▁Paris".
        reply = tokenizer.encode("Paris.", add_special_tokens=False)
    assert "".join(stream(tokenizer, prompt, reply)) == " Paris."
    assert continuation(tokenizer, prompt, reply) == " Paris."
    # The logprob bytes of the tokens join to the same text.
    table = make_token_bytes(tokenizer)
    assert b"".join(table.of(t) for t in reply) == b" Paris."


def test_bpe_token_bytes_are_what_each_character_stands_for(tokenizers, tables):
    """The table's one-pass translation against the definition, character by
    character, on the whole vocabulary and on added-token texts that hold
    characters standing for no byte (below 256 and above)."""
    decoder = _byte_decoder()

    def by_character(piece: str) -> bytes:
        return b"".join(
            bytes((decoder[c],)) if c in decoder else c.encode("utf-8") for c in piece
        )

    tokenmap = tokenizers["bpe"].detokenizer.tokenmap
    assert tables["bpe"].table == tuple(map(by_character, tokenmap))
    for piece in (
        "<|im end|>",
        "\u00a0x\u00ad",
        "caf\u00e9",
        "\u65e5\u672c",
        "\x00\x7f",
    ):
        assert _bpe_bytes(piece) == by_character(piece)


TEXT = st.text(alphabet=" \nabcéPrisl.,日本🙂", max_size=24)


@pytest.mark.parametrize("kind", ["bpe", "spm"])
@settings(max_examples=40, deadline=None)
@given(prompt=TEXT.filter(str.strip), reply=TEXT)
def test_any_reply_streams_what_decoding_adds(tokenizers, tables, kind, prompt, reply):
    tokenizer = tokenizers[kind]
    prompt_ids = tokenizer.encode(prompt)
    # The reply is tokenized on its own, as a model generates it after the prompt.
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    expected = continuation(tokenizer, prompt_ids, reply_ids)
    assert "".join(stream(tokenizer, prompt_ids, reply_ids)) == expected
    table = tables[kind]
    assert b"".join(table.of(t) for t in reply_ids) == expected.encode()
