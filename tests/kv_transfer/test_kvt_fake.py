"""State machine and receiver fencing, through the in-process fake backend."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.errors import IllegalTransitionError, LayoutMismatchError, PeerError
from kv_transfer.header import MsgType, frame_header
from kv_transfer.receiver_core import ReceiverCore
from kv_transfer.state import TransferRecord

SHAPE = (32, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]


def stores(
    dtype: torch.dtype = torch.bfloat16, scales: bool = False
) -> tuple[BlockStore, BlockStore]:
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(SHAPE, generator=gen).to(dtype)
    src_scales = torch.rand(SHAPE[:5], generator=gen) if scales else None
    dst_scales = torch.zeros(SHAPE[:5]) if scales else None
    return BlockStore(src, src_scales), BlockStore(torch.zeros(SHAPE, dtype=dtype), dst_scales)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_state_machine_allows_only_legal_transitions() -> None:
    record = TransferRecord(TransferRequest(new_transfer_id(), 0), 1, soon())
    with pytest.raises(IllegalTransitionError):
        record.move(TransferState.COMPLETED)  # PENDING -> COMPLETED skips IN_FLIGHT
    record.move(TransferState.IN_FLIGHT)
    record.move(TransferState.COMPLETED)
    assert not record.end(TransferState.CANCELLED)  # terminal states never change
    assert record.state is TransferState.COMPLETED


def test_a_finished_transfers_seconds_end_when_it_ended() -> None:
    """`seconds` runs from start to end: reading the result later does not add the wait (the
    transfer-seconds metric and span read it after the call returned)."""
    record = TransferRecord(TransferRequest(new_transfer_id(), 0), 1, soon())
    record.move(TransferState.IN_FLIGHT)
    time.sleep(0.02)
    assert record.result().seconds >= 0.02  # running: up to now
    record.move(TransferState.COMPLETED)
    at_end = record.result().seconds
    time.sleep(0.05)
    assert record.result().seconds == at_end


def test_record_wait_expires_at_deadline() -> None:
    record = TransferRecord(TransferRequest(new_transfer_id(), 0), 1, soon(0.05))
    assert record.wait().state is TransferState.EXPIRED


@pytest.mark.parametrize(("dtype", "scales"), [(torch.bfloat16, False), (torch.float32, True)])
def test_fake_moves_random_blocks_exactly(dtype: torch.dtype, scales: bool) -> None:
    src, dst = stores(dtype, scales)
    backend = get_backend("fake")
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address, frame_bytes=700)  # several frames
    perm = torch.randperm(SHAPE[0], generator=torch.Generator().manual_seed(1))
    src_ids, dst_ids = perm[:11], perm[11:22]
    req = TransferRequest(new_transfer_id(), 4)
    handle = receiver.expect(req, dst_ids, soon())
    result = sender.send(req, src_ids, dst_ids, deadline=soon())
    assert result.ok and handle.wait().ok
    assert torch.equal(dst.cache[dst_ids], src.cache[src_ids])
    untouched = perm[22:]
    assert not dst.cache[untouched].any()
    if scales:
        assert dst.scales is not None and src.scales is not None
        assert torch.equal(dst.scales[dst_ids], src.scales[src_ids])


def test_stale_epoch_and_unknown_transfer_are_refused_blocks_untouched() -> None:
    src, dst = stores()
    backend = get_backend("fake")
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address)
    tid = new_transfer_id()
    handle = receiver.expect(TransferRequest(tid, 2), [3, 4], soon())
    stale = sender.send(TransferRequest(tid, 1), [0, 1], [3, 4], deadline=soon())
    unknown = sender.send(TransferRequest(new_transfer_id(), 2), [0, 1], [3, 4], deadline=soon())
    assert stale.state is TransferState.FAILED and type(stale.error).__name__ == "StaleEpochError"
    assert type(unknown.error).__name__ == "UnknownTransferError"
    assert not dst.cache.any()
    assert handle.state is TransferState.PENDING  # the real reservation survives
    assert sender.send(TransferRequest(tid, 2), [0, 1], [3, 4], deadline=soon()).ok


def test_receiver_cancel_and_expiry_refuse_later_frames() -> None:
    src, dst = stores()
    backend = get_backend("fake")
    receiver = backend.Receiver(dst)
    sender = backend.Sender(src, receiver.address)
    req = TransferRequest(new_transfer_id(), 0)
    receiver.expect(req, [5], soon()).cancel()
    result = sender.send(req, [0], [5], deadline=soon())
    assert result.state is TransferState.CANCELLED
    late = TransferRequest(new_transfer_id(), 0)
    expiring = receiver.expect(late, [6], soon(0.01))
    time.sleep(0.05)
    assert sender.send(late, [0], [6], deadline=soon()).state is TransferState.EXPIRED
    assert expiring.wait().state is TransferState.EXPIRED
    assert not dst.cache.any()


def test_a_connection_lost_after_the_lease_ends_expired_not_failed() -> None:
    """A peer found gone (its connection broken) fails the transfers it had begun, unless their
    reservation ended first: those end EXPIRED, as they would have without the loss."""
    _, dst = stores()
    core = ReceiverCore(dst)
    ids = {}
    for name, seconds in (("lapsed", 0.01), ("live", 60.0)):
        req = TransferRequest(new_transfer_id(), 0)
        handle = core.expect(req, [3 if name == "live" else 4], soon(seconds))
        dst_ids = torch.tensor([3 if name == "live" else 4], dtype=torch.int32).numpy().tobytes()
        core.on_begin(frame_header(MsgType.BEGIN, req.transfer_id, 0, dst_ids), dst_ids)
        ids[name] = (req.transfer_id, handle)
    time.sleep(0.05)
    core.fail_ids([(tid, 0) for tid, _ in ids.values()], PeerError("connection lost"))
    assert ids["lapsed"][1].wait(0.0).state is TransferState.EXPIRED
    assert ids["live"][1].wait(0.0).state is TransferState.FAILED


def test_layout_mismatch_refused_before_any_bytes() -> None:
    src, _ = stores()
    other = BlockStore(torch.zeros(8, 2, 2, 8, 2, 8, dtype=torch.bfloat16))  # block_size 8
    backend = get_backend("fake")
    receiver = backend.Receiver(other)
    with pytest.raises(LayoutMismatchError) as info:
        backend.Sender(src, receiver.address)
    assert info.value.field == "block_size"


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="shm"):
        get_backend("carrier-pigeon")


@pytest.mark.parametrize("host_rows", [True, False])
def test_gather_then_scatter_moves_fp8_blocks_byte_exact(host_rows: bool) -> None:
    """An fp8 cache with scales round-trips through gather_into / scatter_from, on the host
    path and on the device path (forced here on CPU, whose index_copy_ has no fp8 kernel, as
    CUDA's has none: the device path used to raise there for every fp8 receive)."""
    src, dst = stores(torch.float8_e4m3fn, scales=True)
    if not host_rows:
        dst._kv_rows = dst._scale_rows = None  # what a device cache has
    ids, into = torch.tensor([5, 1, 9]), torch.tensor([30, 2, 17])
    buf = torch.empty(3 * src.layout.bytes_per_block, dtype=torch.uint8)
    src.gather_into(ids, buf)
    dst.scatter_from(into, buf)
    assert torch.equal(dst.cache[into].view(torch.uint8), src.cache[ids].view(torch.uint8))
    assert dst.scales is not None and src.scales is not None
    assert torch.equal(dst.scales[into], src.scales[ids])
    untouched = [i for i in range(SHAPE[0]) if i not in into.tolist()]
    assert not dst.cache[untouched].view(torch.uint8).any()
