"""Each token's own bytes, as its tokenizer defines them.

A token decoded alone may be part of a UTF-8 character (a byte-level BPE token holding the
first two bytes of "€", a SentencePiece byte-fallback token `<0xE2>`); its text is then
U+FFFD and says nothing about its bytes. OpenAI's logprobs carry each token's `bytes` so that a
client can join them into the exact text; `token_bytes` gives them:

- a `ByteLevel` decoder (GPT-2, Llama 3, Qwen, SmolLM2): each character of the token mapped
  back through the GPT-2 byte alphabet;
- a `ByteFallback` decoder (Llama 2, Mistral SentencePiece): `<0xHH>` is byte HH, any other
  piece its UTF-8 with `▁` as a space;
- any other tokenizer, and added or special tokens: the UTF-8 of the token decoded alone.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from kvmesh.models.tokenizer import byte_alphabet

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_PIECE = "\u2581"  # SentencePiece's word boundary
BYTE_OF_CHAR = {char: byte for byte, char in enumerate(byte_alphabet())}


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The bytes of each token of `ids` (empty for every one without a tokenizer)."""
    if tokenizer is None:
        return [b""] * len(ids)
    return [_reader(tokenizer)(int(i)) for i in ids]


@functools.lru_cache(maxsize=8)
def _reader(tokenizer: Any) -> Any:
    """A cached id -> bytes function for `tokenizer` (its decoder inspected once)."""
    kind = decoder_kind(tokenizer)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))

    @functools.lru_cache(maxsize=1 << 16)
    def read(token_id: int) -> bytes:
        piece = None if token_id in added else tokenizer.convert_ids_to_tokens(token_id)
        raw = piece_bytes(kind, piece) if isinstance(piece, str) else None
        if raw is None:
            return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode()
        return raw

    return read


def piece_bytes(kind: str, piece: str) -> bytes | None:
    """The bytes a vocabulary piece stands for under a `kind` decoder; None when the piece
    does not follow that decoder's alphabet (or `kind` is neither)."""
    if kind == "ByteLevel":
        if not all(char in BYTE_OF_CHAR for char in piece):
            return None
        return bytes(BYTE_OF_CHAR[char] for char in piece)
    if kind == "ByteFallback":
        byte = BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE_PIECE, " ").encode()
    return None


def decoder_kind(tokenizer: Any) -> str:
    """ "ByteLevel", "ByteFallback" or "" (neither) for a tokenizer with a `tokenizers`
    backend; "" for any other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    return next((kind for kind in ("ByteLevel", "ByteFallback") if kind in kinds), "")
