"""A hostile sender holding the cluster token, on the gRPC KV receiver's raw calls: malformed
BEGINs are typed refusals (never UNKNOWN with a Python class name), and no transfer a call
began outlives the call, however many it began or however it failed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, get_backend, new_transfer_id
from kv_transfer.header import MsgType, frame_header
from kv_transfer.state import TransferState
from kvmesh.security import Security
from kvmesh.v1 import kv_transfer_pb2 as pb

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]
TOKEN = "kv-receiver-cluster-token-0123456789"
SERVICE = "/kvmesh.v1.KVTransferService/"
SECURITY = Security(token=TOKEN)


class Raw:
    """The receiver's two push calls, spoken by hand."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self._push = self.channel.stream_unary(
            SERVICE + "PushFrames", response_deserializer=pb.PushResult.FromString
        )
        self._unary = self.channel.unary_unary(
            SERVICE + "PushBlocksUnary",
            request_serializer=pb.KVFrame.SerializeToString,
            response_deserializer=pb.PushResult.FromString,
        )

    def push(self, *messages: bytes) -> pb.PushResult:
        result: pb.PushResult = self._push(
            iter(messages), metadata=SECURITY.call_metadata(), timeout=5
        )
        return result

    def unary(self, frame: pb.KVFrame) -> pb.PushResult:
        result: pb.PushResult = self._unary(frame, metadata=SECURITY.call_metadata(), timeout=5)
        return result


@pytest.fixture
def receiver() -> Iterator[tuple[object, Raw]]:
    r = get_backend("grpc").Receiver(BlockStore(torch.zeros(SHAPE)), security=SECURITY)
    raw = Raw(r.address)
    try:
        yield r, raw
    finally:
        raw.channel.close()
        r.close()


def begin(request: TransferRequest, ids: list[int]) -> bytes:
    payload = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
    return frame_header(MsgType.BEGIN, request.transfer_id, request.epoch, payload).encode() + (
        payload
    )


def reserve(r: object, ids: list[int]) -> tuple[TransferRequest, object]:
    request = TransferRequest(new_transfer_id(), 1)
    return request, r.expect(request, torch.tensor(ids), time.monotonic() + 60)  # type: ignore[attr-defined]


def test_malformed_begins_are_typed_refusals(receiver: tuple[object, Raw]) -> None:
    r, raw = receiver
    request, handle = reserve(r, [1, 2])
    empty = frame_header(MsgType.BEGIN, request.transfer_id, 1).encode()  # no ids at all
    result = raw.push(empty)
    assert (result.state, result.error_code) == ("FAILED", "bad_frame"), result
    assert handle.state is TransferState.FAILED  # type: ignore[attr-defined]
    for frame in (
        pb.KVFrame(msg_type=99, transfer_id=request.transfer_id, epoch=1),
        pb.KVFrame(msg_type=MsgType.BEGIN, transfer_id=bytes(16), dst_block_ids=[2**32 - 1]),
    ):
        result = raw.unary(frame)  # not UNKNOWN "Unexpected <class 'ValueError'>"
        assert result.state == "FAILED" and result.error_code, result


def test_every_transfer_a_stream_began_ends_with_it(receiver: tuple[object, Raw]) -> None:
    r, raw = receiver
    first, first_handle = reserve(r, [3])
    second, second_handle = reserve(r, [4])
    result = raw.push(begin(first, [3]), begin(second, [4]))  # then the stream ends
    assert result.error_code == "cancelled", result
    states = {first_handle.state, second_handle.state}  # type: ignore[attr-defined]
    assert states == {TransferState.CANCELLED}, "both end now, not at their lease"


@pytest.mark.parametrize("kind", [MsgType.BEGIN, MsgType.FRAME])
def test_a_unary_push_failing_after_its_begin_ends_the_transfer(
    receiver: tuple[object, Raw], kind: MsgType
) -> None:
    """PushBlocksUnary begins the transfer, then applies the frame: a second BEGIN, or a FRAME
    without its payload, fails the call and the transfer with it."""
    r, raw = receiver
    request, handle = reserve(r, [5])
    frame = pb.KVFrame(msg_type=kind, transfer_id=request.transfer_id, epoch=1,
                       frame_count=1, num_blocks=1, dst_block_ids=[5])  # fmt: skip
    result = raw.unary(frame)
    assert result.state == "FAILED", result
    assert handle.state is TransferState.FAILED  # type: ignore[attr-defined]


def test_late_frames_for_an_ended_transfer_keep_nothing(receiver: tuple[object, Raw]) -> None:
    """Each late frame for a cancelled transfer is refused with the transfer's own reason,
    and the error the receiver keeps for it (in its record, remembered for 1,024 transfers)
    stays without a traceback: raising the kept error again for every late frame grew its
    traceback by that call's frames, whose locals held the refused message (MiBs each)."""
    r, raw = receiver
    request, handle = reserve(r, [1])
    handle.cancel()  # e.g. the decode worker's Release
    payload = bytes(1 << 20)
    late = frame_header(
        MsgType.FRAME, request.transfer_id, request.epoch, payload,
        frame_index=0, frame_count=1, block_offset=0, num_blocks=1,
    ).encode()  # fmt: skip
    for _ in range(3):
        assert raw.push(late + payload).error_code == "cancelled"
    kept = handle.wait(0).error
    assert kept is not None and kept.__traceback__ is None
