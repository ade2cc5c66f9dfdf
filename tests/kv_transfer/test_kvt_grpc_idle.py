"""The gRPC KV receiver bounds idle connections as the worker's own port does: a connection
with no call for `max_connection_idle_seconds` is closed with GOAWAY even when its peer
answers every keepalive ping, and a pooled sender's channel reconnects on its next transfer."""

from __future__ import annotations

import asyncio
import time

import torch
from test_kvt_grpc_auth import SHAPE, transfer

from decode_svc.reservations import open_receivers
from kv_transfer import BlockStore, get_backend
from tests.http2 import closed_with_goaway

IDLE = 0.3  # seconds: the bound under test


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
