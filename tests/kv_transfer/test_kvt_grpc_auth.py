"""The gRPC KV receiver with a cluster token: a call without it is UNAUTHENTICATED before its
bytes are parsed; with it, undecodable bytes are INVALID_ARGUMENT naming `request`, and a
transfer from a sender holding the token lands exactly."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from kv_transfer import BlockStore, TransferRequest, get_backend, new_transfer_id
from kv_transfer.interface import KVReceiver, KVSender
from kvmesh.security import Security
from kvmesh.v1 import wire

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]
TOKEN = "kv-receiver-cluster-token-0123456789"
HANDSHAKE = "/kvmesh.v1.KVTransferService/Handshake"


def transfer(sender: KVSender, receiver: KVReceiver, src: BlockStore, dst: BlockStore) -> None:
    """Move blocks 1-3 of `src` into `dst` over one stream; both ends report OK."""
    request = TransferRequest(new_transfer_id(), 1)
    ids = torch.tensor([1, 2, 3])
    got = receiver.expect(request, ids, time.monotonic() + 10)
    sent = sender.start_stream(request, ids, deadline=time.monotonic() + 10)
    sent.add(0, ids)
    sent.finish()
    assert sent.wait(10).ok and got.wait(10).ok
    assert torch.equal(dst.cache[ids], src.cache[ids])


def test_token_first_then_decode_check_then_a_real_transfer() -> None:
    grpc_backend = get_backend("grpc")
    security = Security(token=TOKEN)
    dst = BlockStore(torch.zeros(SHAPE))
    receiver = grpc_backend.Receiver(dst, security=security)
    channel = grpc.insecure_channel(receiver.address)
    try:
        handshake = channel.unary_unary(HANDSHAKE)
        with pytest.raises(grpc.RpcError) as caught:
            handshake(b"\xff\xff garbage", timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert receiver.auth[0].refused == 1
        with pytest.raises(grpc.RpcError) as caught:
            handshake(b"\xff\xff garbage", metadata=security.call_metadata(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert wire.field_of(caught.value) == "request"

        src = BlockStore(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
        sender = grpc_backend.Sender(src, receiver.address, security=security)
        try:
            transfer(sender, receiver, src, dst)
        finally:
            sender.close()
    finally:
        channel.close()
        receiver.close()


def test_a_busy_transfer_port_is_refused_at_once_naming_the_flag() -> None:
    """A second gRPC receiver on a port already serving one does not share it (no
    SO_REUSEPORT): it fails at once, naming --transfer-port, instead of after a wait."""
    grpc_backend = get_backend("grpc")
    first = grpc_backend.Receiver(BlockStore(torch.zeros(SHAPE)))
    try:
        started = time.monotonic()
        with pytest.raises(OSError, match="--transfer-port: cannot bind"):
            grpc_backend.Receiver(BlockStore(torch.zeros(SHAPE)), bind=first.address)
        assert time.monotonic() - started < 5
    finally:
        first.close()
