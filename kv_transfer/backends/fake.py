"""In-process loopback backend for fast tests: same protocol and checks, no transport."""

from __future__ import annotations

import os
import threading

import torch

from kv_transfer.blocks import BlockStore
from kv_transfer.errors import DeadlineExpiredError, PeerError, TransferCancelledError
from kv_transfer.header import MsgType, frame_header
from kv_transfer.interface import (
    DEFAULT_FRAME_BYTES,
    KVReceiver,
    KVSender,
    SendPlan,
    Waiter,
    fill_frame,
)
from kv_transfer.state import TransferRecord

_RECEIVERS: dict[str, Receiver] = {}
_LOCK = threading.Lock()


class Receiver(KVReceiver):
    def __init__(self, store: BlockStore) -> None:
        super().__init__(store)
        self._address = f"fake://{os.urandom(6).hex()}"
        with _LOCK:
            _RECEIVERS[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        with _LOCK:
            _RECEIVERS.pop(self._address, None)


class Sender(KVSender):
    def __init__(
        self,
        store: BlockStore,
        address: str,
        *,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        connect_deadline: float | None = None,  # connecting never waits here
    ) -> None:
        super().__init__(store, frame_bytes)
        with _LOCK:
            peer = _RECEIVERS.get(address)
        if peer is None:
            raise PeerError(f"no fake receiver at {address}")
        peer.layout.check_compatible(self.layout)
        self._peer = peer
        self._staging = torch.empty(
            max(frame_bytes, self.layout.bytes_per_block), dtype=torch.uint8
        )

    def _transfer(self, plan: SendPlan, record: TransferRecord, waiter: Waiter) -> None:
        core = self._peer.core
        tid, epoch = plan.request.transfer_id, plan.request.epoch
        begin = plan.begin_payload()
        core.on_begin(frame_header(MsgType.BEGIN, tid, epoch, begin), begin)
        try:
            for index in plan.iter_frames(waiter):
                waiter.check()
                header, payload = fill_frame(self.store, plan, index, self._staging)
                core.on_frame(header, payload)
            waiter.check()
        except (TransferCancelledError, DeadlineExpiredError):  # CANCEL, as on the wire backends
            core.on_cancel(frame_header(MsgType.CANCEL, tid, epoch))
            raise
        core.on_end(*plan.end_frame())
