"""The gRPC KV receiver bounds idle connections as the worker's own port does: a connection
with no call for `max_connection_idle_seconds` is closed with GOAWAY even when its peer
answers every keepalive ping, and a pooled sender's channel reconnects on its next transfer."""

from __future__ import annotations

import asyncio
import time

import torch

from decode_svc.reservations import open_receivers
from kv_transfer import BlockStore, TransferRequest, get_backend, new_transfer_id
from kv_transfer.interface import KVReceiver, KVSender
from tests.http2 import closed_with_goaway

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, layers, 2, block_size, heads, head_dim]
IDLE = 0.3  # seconds: the bound under test


def transfer(sender: KVSender, receiver: KVReceiver, src: BlockStore, dst: BlockStore) -> None:
    request = TransferRequest(new_transfer_id(), 1)
    ids = torch.tensor([1, 2, 3])
    got = receiver.expect(request, ids, time.monotonic() + 10)
    sent = sender.start_stream(request, ids, deadline=time.monotonic() + 10)
    sent.add(0, ids)
    sent.finish()
    assert sent.wait(10).ok and got.wait(10).ok
    assert torch.equal(dst.cache[ids], src.cache[ids])


def test_an_idle_connection_to_the_kv_receiver_gets_goaway_and_senders_reconnect() -> None:
    dst = BlockStore(torch.zeros(SHAPE))
    receiver = open_receivers(dst, ["grpc"], max_connection_idle_seconds=IDLE)["grpc"]
    src = BlockStore(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    sender = get_backend("grpc").Sender(src, receiver.address)
    try:
        assert asyncio.run(closed_with_goaway(receiver.address))
        for _ in range(2):
            transfer(sender, receiver, src, dst)
            time.sleep(3 * IDLE)  # the sender's connection is closed meanwhile
    finally:
        sender.close()
        receiver.close()
