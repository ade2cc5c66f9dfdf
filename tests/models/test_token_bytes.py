"""Each token's own bytes (OpenAI's logprob `bytes`): byte-level tokenizers map back through
the GPT-2 byte alphabet, SentencePiece byte fallback reads `<0xHH>`, special tokens are their
text, and joined in order the bytes give the exact text, also across split characters."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvmesh.models.tiny import tiny_model_path
from kvmesh.models.token_bytes import decoder_kind, token_bytes
from kvmesh.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID

TEXT = "Price: 12 € — 日本語, emoji 😀 and ascii."


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(tiny_model_path()))


def test_byte_level_tokens_join_into_the_exact_text(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    raw = token_bytes(byte_level, ids)
    assert decoder_kind(byte_level) == "ByteLevel"
    assert b"".join(raw) == TEXT.encode()
    euro = TEXT.encode().index("€".encode())
    assert raw[euro : euro + 3] == [b"\xe2", b"\x82", b"\xac"]  # alone each decodes to U+FFFD
    assert byte_level.decode([ids[euro]]) == "\ufffd"


def test_special_tokens_are_their_text(byte_level: PreTrainedTokenizerFast) -> None:
    assert token_bytes(byte_level, [BOS_TOKEN_ID, EOS_TOKEN_ID]) == [b"<bos>", b"<eos>"]
    assert token_bytes(None, [1, 2]) == [b"", b""]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2's decoder) with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581Hello", "\u2581", "a"]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                       byte_fallback=True, unk_token="<unk>")  # fmt: skip
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_byte_fallback_pieces_are_their_bytes() -> None:
    tokenizer = byte_fallback_tokenizer()
    pieces = ["\u2581Hello", "\u2581", "<0xE2>", "<0x82>", "<0xAC>"]
    ids = tokenizer.convert_tokens_to_ids(pieces)
    raw = token_bytes(tokenizer, ids)
    assert decoder_kind(tokenizer) == "ByteFallback"
    assert raw == [b" Hello", b" ", b"\xe2", b"\x82", b"\xac"]
    assert b"".join(raw) == b" " + tokenizer.decode(ids).encode()  # decode strips the first " "
