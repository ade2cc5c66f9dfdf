"""gloo backend inside one process: handshake refusals, pooled links, receiver close, runs."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, TransferState, get_backend, new_transfer_id
from kv_transfer.errors import LayoutMismatchError, PeerError

SHAPE = (16, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]


def store(seed: int, shape: tuple[int, ...] = SHAPE) -> BlockStore:
    gen = torch.Generator().manual_seed(seed)
    return BlockStore(torch.randn(shape, generator=gen).to(torch.bfloat16))


@pytest.fixture(scope="module")
def gloo() -> object:
    return get_backend("gloo")


def test_layout_mismatch_refused_at_handshake(gloo: object) -> None:
    receiver = gloo.Receiver(store(1))  # type: ignore[attr-defined]
    try:
        with pytest.raises(LayoutMismatchError) as info:
            gloo.Sender(store(2, (16, 2, 2, 8, 2, 8)), receiver.address)  # type: ignore[attr-defined]
        assert info.value.field == "block_size"
    finally:
        receiver.close()


def test_links_are_pooled_and_a_closed_receiver_fails_fast(gloo: object) -> None:
    src, dst = store(2), store(1)
    receiver = gloo.Receiver(dst)  # type: ignore[attr-defined]
    first = gloo.Sender(src, receiver.address, frame_bytes=1024)  # type: ignore[attr-defined]
    link = first._link
    first.close()
    second = gloo.Sender(src, receiver.address, frame_bytes=1024)  # type: ignore[attr-defined]
    assert second._link is link  # the process group is reused, not rebuilt
    req = TransferRequest(new_transfer_id(), 1)
    handle = receiver.expect(req, [3, 4, 5], time.monotonic() + 10)
    assert second.send(req, [0, 1, 2], [3, 4, 5], deadline=time.monotonic() + 10).ok
    assert handle.wait().ok and torch.equal(dst.cache[3:6], src.cache[0:3])
    receiver.close()
    began = time.monotonic()
    late = second.send(
        TransferRequest(new_transfer_id(), 1), [0], [3], deadline=time.monotonic() + 5
    )
    assert late.state in (TransferState.FAILED, TransferState.EXPIRED)
    assert time.monotonic() - began < 5
    with pytest.raises(PeerError):
        gloo.Sender(src, receiver.address)  # type: ignore[attr-defined]
    second.close()


def test_run_view_is_the_cache_bytes_of_consecutive_blocks() -> None:
    """What a run of blocks is sent from in place (no staging copy)."""
    s = store(1)
    view = s.run_view(torch.tensor([3, 4, 5]))
    assert view is not None and view.data_ptr() == s.cache[3].data_ptr()
    assert torch.equal(view, s.cache[3:6].reshape(-1).view(torch.uint8))
    assert s.run_view(torch.tensor([3, 5])) is None  # not one run: gathered
    scaled = BlockStore(s.cache.float(), torch.ones(SHAPE[:5]))
    assert scaled.run_view(torch.tensor([3, 4])) is None  # [scales][kv] is two ranges
