"""Frame header and layout handshake: round trips, and every defect a typed error."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.errors import ChecksumError, FrameError, LayoutMismatchError, TransferError
from kv_transfer.header import (
    HEADER_SIZE,
    FrameHeader,
    MsgType,
    decode_header,
    frame_header,
    new_transfer_id,
)
from kv_transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


def test_header_round_trip_and_payload_check() -> None:
    payload = bytes(range(256)) * 10
    header = frame_header(
        MsgType.FRAME, new_transfer_id(), 7, payload, frame_index=2, frame_count=5,
        block_offset=8, num_blocks=4, aux=3,
    )  # fmt: skip
    raw = header.encode()
    assert len(raw) == HEADER_SIZE == 80
    back = decode_header(raw)
    assert back == header
    back.verify_payload(payload)
    with pytest.raises(ChecksumError):
        back.verify_payload(payload[:-1] + b"\x00")
    with pytest.raises(FrameError, match="payload_len"):
        back.verify_payload(payload[:-1])


@pytest.mark.parametrize(
    ("offset", "value", "field"),
    [(0, b"XXXX", "magic"), (4, b"\x02\x00", "version"), (72, b"\x00\x00\x00\x00", "header_check")],
)
def test_header_defects_name_the_field(offset: int, value: bytes, field: str) -> None:
    raw = bytearray(FrameHeader(MsgType.BEGIN, new_transfer_id(), 1).encode())
    raw[offset : offset + len(value)] = value
    with pytest.raises(FrameError) as info:
        decode_header(bytes(raw))
    assert info.value.field == field


def test_truncated_header_and_flipped_id_are_refused() -> None:
    raw = bytearray(FrameHeader(MsgType.FRAME, new_transfer_id(), 1, frame_count=1).encode())
    with pytest.raises(FrameError, match="header"):
        decode_header(bytes(raw[:-1]))
    raw[10] ^= 0x01  # a bit of the transfer id: caught by the header check
    with pytest.raises(ChecksumError):
        decode_header(bytes(raw))


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=0, max_size=120))
def test_decoder_fuzz_never_crashes(data: bytes) -> None:
    with contextlib.suppress(TransferError):
        decode_header(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, HEADER_SIZE - 1), st.integers(1, 255))
def test_any_single_byte_corruption_is_refused(position: int, xor: int) -> None:
    raw = bytearray(
        frame_header(MsgType.FRAME, new_transfer_id(), 3, b"abc", frame_count=1).encode()
    )
    raw[position] ^= xor
    if position >= 76:  # reserved padding
        return
    with pytest.raises(FrameError):
        decode_header(bytes(raw))


def test_layout_round_trip_and_mismatch_names_field() -> None:
    assert KVLayout.from_bytes(LAYOUT.to_bytes()) == LAYOUT
    changes: dict[str, Any] = {"block_size": 32, "dtype": "float16", "model_id": "other"}
    for field, value in changes.items():
        other = dataclasses.replace(LAYOUT, **{field: value})
        with pytest.raises(LayoutMismatchError) as info:
            LAYOUT.check_compatible(other)
        assert info.value.field == field
        assert (info.value.ours, info.value.theirs) == (getattr(LAYOUT, field), value)


@pytest.mark.parametrize(
    "data", [b"", b"[]", b"{}", b'{"num_layers": "4"}', b"\xff\xfe", LAYOUT.to_bytes()[:-3]]
)
def test_layout_decoder_refuses_garbage(data: bytes) -> None:
    with pytest.raises(FrameError):
        KVLayout.from_bytes(data)
