"""Streamed (multi-part) transfers: parts added while the transfer runs, one acknowledgement."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.errors import FrameError, TransferError, UnknownTransferError
from kv_transfer.header import MAX_TRAILER, MsgType, frame_header
from kv_transfer.interface import KVReceiver, KVSender
from kvmesh.security import Security
from kvmesh.security.credentials import CredentialError
from kvmesh.security.tls import TlsConfig
from tests.pki import make_pki

SHAPE = (48, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]
BACKENDS = ["fake", "shm", "grpc"]


def stores() -> tuple[BlockStore, BlockStore]:
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    return BlockStore(src), BlockStore(torch.zeros(SHAPE))


def soon(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVSender, KVReceiver]]:
    src, dst = stores()
    backend = get_backend(request.param)
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address, frame_bytes=1500)  # 1 KiB blocks: 1 per frame
    yield sender, receiver
    sender.close()
    receiver.close()


def ids() -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(SHAPE[0], generator=torch.Generator().manual_seed(1))
    return perm[:12], perm[12:24]


@pytest.mark.parametrize("order", ["in_order", "out_of_order"])
def test_parts_arrive_exactly_in_any_order(pair: tuple[KVSender, KVReceiver], order: str) -> None:
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon())
    handle = sender.start_stream(req, dst_ids, deadline=soon())
    parts = [(0, 5), (5, 3), (8, 4)]
    if order == "out_of_order":
        parts = [parts[2], parts[0], parts[1]]
    for offset, n in parts:
        time.sleep(0.05)  # the sender idles between parts
        assert got.state is not TransferState.COMPLETED  # one acknowledgement, at the end
        handle.add(offset, src_ids[offset : offset + n])
    handle.finish()
    assert handle.wait(5).ok and got.wait(5).ok
    assert torch.equal(receiver.store.cache[dst_ids], sender.store.cache[src_ids])
    others = torch.ones(SHAPE[0], dtype=torch.bool)
    others[dst_ids] = False
    assert not receiver.store.cache[others].any()


def test_cancel_between_parts_ends_both_sides(pair: tuple[KVSender, KVReceiver]) -> None:
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon())
    handle = sender.start_stream(req, dst_ids, deadline=soon())
    handle.add(0, src_ids[:4])
    time.sleep(0.1)
    handle.cancel()
    assert handle.wait(5).state is TransferState.CANCELLED
    assert got.wait(5).state is TransferState.CANCELLED
    handle.add(4, src_ids[4:])  # a late part after the end is harmless: nothing is sent
    handle.finish()
    assert handle.wait(1).state is TransferState.CANCELLED


def test_deadline_between_parts_expires(pair: tuple[KVSender, KVReceiver]) -> None:
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon(0.5))
    handle = sender.start_stream(req, dst_ids, deadline=soon(0.5))
    handle.add(0, src_ids[:4])
    assert handle.wait(5).state in (TransferState.EXPIRED, TransferState.CANCELLED)
    assert got.wait(5).state in (TransferState.EXPIRED, TransferState.CANCELLED)


@pytest.mark.parametrize("added", [0, 4], ids=["no-block-sent", "a-part-sent"])
def test_a_sender_deadline_before_the_lease_ends_the_receiver_at_once(
    pair: tuple[KVSender, KVReceiver], added: int
) -> None:
    """The sender's deadline passes after BEGIN, long before the receiver's lease: the
    receiver's transfer ends (not COMPLETED) within a second of it, not at the lease."""
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon(30))
    deadline = soon(0.5)
    handle = sender.start_stream(req, dst_ids, deadline=deadline)
    if added:
        handle.add(0, src_ids[:added])
    assert handle.wait(5).state in (TransferState.EXPIRED, TransferState.CANCELLED)
    result = got.wait(deadline + 1.0 - time.monotonic())
    assert result.state in (TransferState.CANCELLED, TransferState.FAILED)
    assert time.monotonic() < deadline + 1.0


def test_unknown_transfer_refused_before_any_byte(pair: tuple[KVSender, KVReceiver]) -> None:
    sender, receiver = pair
    src_ids, dst_ids = ids()
    handle = sender.start_stream(TransferRequest(new_transfer_id(), 3), dst_ids, deadline=soon())
    handle.add(0, src_ids)
    handle.finish()
    result = handle.wait(5)
    assert result.state is TransferState.FAILED
    assert isinstance(result.error, UnknownTransferError)
    assert not receiver.store.cache.any()


def test_sender_refuses_overlapping_or_incomplete_parts() -> None:
    src, dst = stores()
    backend = get_backend("fake")
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address)
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 1)
    got = receiver.expect(req, dst_ids, soon())
    handle = sender.start_stream(req, dst_ids, deadline=soon())
    handle.add(0, src_ids[:6])
    with pytest.raises(TransferError):
        handle.add(5, src_ids[5:8])  # block 5 again
    with pytest.raises(TransferError):
        handle.add(10, src_ids[:4])  # past the end
    with pytest.raises(TransferError):
        handle.finish()  # blocks 6.. never added
    handle.add(6, src_ids[6:])
    handle.finish()
    assert handle.wait(5).ok and got.wait(5).ok
    assert torch.equal(dst.cache[dst_ids], src.cache[src_ids])


def _frame(req: TransferRequest, store: BlockStore, index: int, offset: int, n: int):  # type: ignore[no-untyped-def]
    payload = torch.ones(n * store.layout.bytes_per_block, dtype=torch.uint8)
    header = frame_header(
        MsgType.FRAME,
        req.transfer_id,
        req.epoch,
        payload.numpy(),
        frame_index=index,
        frame_count=8,
        block_offset=offset,
        num_blocks=n,
    )
    return header, payload


def _begun(n: int = 8):  # type: ignore[no-untyped-def]
    _, dst = stores()
    receiver = get_backend("fake").Receiver(dst)
    req = TransferRequest(new_transfer_id(), 9)
    dst_ids = torch.arange(n)
    handle = receiver.expect(req, dst_ids, soon())
    begin = dst_ids.to(torch.int32).numpy().tobytes()
    receiver.core.on_begin(frame_header(MsgType.BEGIN, req.transfer_id, 9, begin), begin)
    return receiver, req, handle


def test_receiver_completes_on_coverage_out_of_order() -> None:
    receiver, req, handle = _begun()
    store = receiver.store
    for index, (offset, n) in enumerate([(6, 2), (0, 3), (3, 3)]):
        receiver.core.on_frame(*_frame(req, store, index, offset, n))
        assert handle.state is TransferState.IN_FLIGHT
    result = receiver.core.on_end(frame_header(MsgType.END, req.transfer_id, req.epoch))
    assert result.ok and handle.wait(1).ok


@pytest.mark.parametrize(
    ("index", "offset", "n"), [(1, 2, 2), (0, 5, 1), (1, 7, 2)], ids=["overlap", "repeat", "range"]
)
def test_receiver_refuses_duplicate_or_out_of_range_part(index: int, offset: int, n: int) -> None:
    receiver, req, handle = _begun()
    receiver.core.on_frame(*_frame(req, receiver.store, 0, 0, 3))
    with pytest.raises(FrameError):
        receiver.core.on_frame(*_frame(req, receiver.store, index, offset, n))
    assert handle.wait(1).state is TransferState.FAILED


def test_receiver_end_before_every_block_fails() -> None:
    receiver, req, handle = _begun()
    receiver.core.on_frame(*_frame(req, receiver.store, 0, 0, 7))
    with pytest.raises(FrameError):
        receiver.core.on_end(frame_header(MsgType.END, req.transfer_id, req.epoch))
    assert handle.wait(1).state is TransferState.FAILED


def test_trailer_rides_the_final_frame(pair: tuple[KVSender, KVReceiver]) -> None:
    """The producer's trailer (the first token) reaches the receiver's result with the END."""
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon())
    handle = sender.start_stream(req, dst_ids, deadline=soon())
    handle.add(0, src_ids)
    handle.finish(b"first-token\x00\x01")
    result = got.wait(5)
    assert result.ok and result.kv_complete and result.trailer == b"first-token\x00\x01"
    assert handle.wait(5).ok


def test_no_kv_end_completes_with_the_trailer_only(pair: tuple[KVSender, KVReceiver]) -> None:
    """A producer whose request ended at its first token finishes without KV: the receiver
    completes with `kv_complete` False (and refuses such an END without the flag)."""
    sender, receiver = pair
    src_ids, dst_ids = ids()
    req = TransferRequest(new_transfer_id(), 3)
    got = receiver.expect(req, dst_ids, soon())
    handle = sender.start_stream(req, dst_ids, deadline=soon())
    handle.add(0, src_ids[:4])
    with pytest.raises(TransferError, match="4 of 12"):
        handle.finish(b"x")
    handle.finish(b"ended", kv=False)
    result = got.wait(5)
    assert result.ok and not result.kv_complete and result.trailer == b"ended"


def test_oversized_trailer_refused_by_the_producer(pair: tuple[KVSender, KVReceiver]) -> None:
    sender, _ = pair
    _, dst_ids = ids()
    handle = sender.start_stream(TransferRequest(new_transfer_id(), 3), dst_ids, deadline=soon())
    with pytest.raises(TransferError, match="trailer"):
        handle.finish(bytes(MAX_TRAILER + 1), kv=False)
    handle.cancel()


def _threads_waiting_for_parts() -> int:
    """Threads whose stack is inside a streamed transfer's wait for its next part."""
    waiting = 0
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None and not (
            f.f_code.co_name == "indices" and f.f_code.co_filename.endswith("interface.py")
        ):
            f = f.f_back
        waiting += f is not None
    return waiting


def test_a_refused_grpc_stream_leaves_no_thread_waiting_for_parts() -> None:
    """The receiver ends a streamed gRPC transfer (its reservation released mid-transfer):
    grpc's thread that feeds the call its frames stops with the call instead of waiting for
    parts until the transfer's deadline, and reads no part added after."""
    src, dst = stores()
    backend = get_backend("grpc")
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address, frame_bytes=1500)
    try:
        request = TransferRequest(new_transfer_id(), 3)
        got = receiver.expect(request, list(range(4)), time.monotonic() + 60)
        sent = sender.start_stream(request, list(range(4)), deadline=time.monotonic() + 60)
        sent.add(0, [10])
        assert wait_until(lambda: got.state is TransferState.IN_FLIGHT)
        got.cancel()  # e.g. a Release on the decode worker
        sent.add(1, [11])
        assert sent.wait(5).state.is_terminal
        assert wait_until(lambda: _threads_waiting_for_parts() == 0)
    finally:
        sender.close()
        receiver.close()


def test_a_grpc_receiver_that_cannot_start_says_why_at_once(tmp_path: Path) -> None:
    """A receiver whose server cannot be built (here: a CA for mutual TLS without the
    receiver's own certificate) raises that error at once, not "could not bind" after the
    start-up wait."""
    tls = TlsConfig(ca=str(make_pki(tmp_path).ca))  # a valid CA: the config itself is fine
    started = time.monotonic()
    with pytest.raises(CredentialError):
        get_backend("grpc").Receiver(BlockStore(torch.zeros(SHAPE)), security=Security(tls=tls))
    assert time.monotonic() - started < 5


def wait_until(ready: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
