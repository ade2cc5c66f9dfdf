"""Decode-side reservations: blocks held for a request's incoming KV, fenced and leased.

```
Reserve ──▶ RESERVED ──(KV lands)──▶ TRANSFERRED ──Decode──▶ DECODING ──finish──▶ gone
   │            └── lease expires / Release ──▶ gone (receive handle cancelled, blocks freed)
```
A reservation names (request id, generation, transfer id); the receiver accepts frames only
for that transfer id and `epoch == generation`, so a stale prefill can never write here.

A reservation dropped while a sender holds a write window into its blocks (registered memory:
the sender copies straight into this cache, and a cancel only asks it to stop) is fenced: the
engine keeps its prompt blocks out of the pool until the sender is known to have stopped
(`ReceiveHandle.when_quiet`: its END, CANCEL or closed connection) or the lease plus a grace
ran out, so a late copy can never land in blocks another request holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kv_transfer import (
    AUTHENTICATED_BACKENDS,
    IDLE_LIMITED_BACKENDS,
    bind_address,
    get_backend,
    receiver_ports,
)
from kv_transfer.blocks import BlockStore
from kv_transfer.interface import KVReceiver
from kv_transfer.receiver_core import ReceiveHandle, ReceiverCore
from kv_transfer.state import TransferRequest, TransferState
from kvmesh.engine import disagg
from kvmesh.engine.async_engine import AsyncLLMEngine, RequestStream
from kvmesh.engine.sequence import Request
from kvmesh.security import Security
from kvmesh.service.server import close_within
from kvmesh.telemetry.logs import request_scope
from kvmesh.v1 import worker_pb2

LOG = logging.getLogger("kvmesh.decode")
REAP_INTERVAL_SECONDS = 0.1


@dataclasses.dataclass
class Reservation:
    request: Request
    generation: int
    transfer_id: bytes  # 16 bytes; hex on the gRPC wire
    block_ids: list[int]
    handle: ReceiveHandle
    deadline: float  # monotonic end of the lease while not decoding
    decoding: bool = False
    task: asyncio.Task[Any] | None = None  # the Decode call serving it
    stream: RequestStream | None = None  # its engine stream once it joined the batch
    released: str | None = None  # why it was released while its Decode call was open

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def held(self) -> worker_pb2.HeldBlockSet:
        if self.decoding:
            state = worker_pb2.BLOCK_SET_STATE_DECODING
        elif self.handle.state is TransferState.COMPLETED:
            state = worker_pb2.BLOCK_SET_STATE_TRANSFERRED
        else:
            state = worker_pb2.BLOCK_SET_STATE_RESERVED
        return worker_pb2.HeldBlockSet(
            request_id=self.request_id,
            state=state,
            num_blocks=len(self.block_ids),
            generation=self.generation,
            lease_remaining_seconds=max(0.0, self.deadline - time.monotonic()),
        )


def open_receivers(
    store: BlockStore,
    backends: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    security: Security | None = None,
    max_connection_idle_seconds: float = 300.0,
) -> dict[str, KVReceiver]:
    """One receiver per backend, all sharing one ReceiverCore: a reservation is accepted on
    whichever backend the sender picks. Backends that cannot run here are skipped. Network
    receivers bind `host` on `port`, `port + 1`, ... in `backends` order (0: free ports); a port
    chosen that way which cannot be bound is an OSError naming --transfer-port, never a skip.
    The gRPC and gloo receivers require `security`'s cluster token (the gRPC one TLS too, when
    set); the gRPC receiver closes a connection idle for `max_connection_idle_seconds`, as the
    worker's own port does (gloo links keep their own idle limit)."""
    core = ReceiverCore(store)
    receivers: dict[str, KVReceiver] = {}
    ports = receiver_ports(backends, port)
    for name in backends:
        options: dict[str, Any] = {}
        if name in ports:
            options["bind"] = bind_address(host, ports[name])
        if name in IDLE_LIMITED_BACKENDS:
            options["max_connection_idle_seconds"] = max_connection_idle_seconds
        if name in AUTHENTICATED_BACKENDS and security is not None:
            options["security"] = security
        try:
            receiver = get_backend(name).Receiver(store, **options)
        except (ImportError, ValueError, OSError, RuntimeError) as exc:
            if isinstance(exc, OSError) and ports.get(name):  # a port the operator chose
                for opened in receivers.values():
                    opened.close()
                raise
            LOG.warning("kv transfer backend %s unavailable: %s", name, exc)
            continue
        receiver.core = core
        receivers[name] = receiver
    return receivers


class ReservationTable:
    """Reservations of one decode worker; methods run on the asyncio loop."""

    def __init__(self, engine: AsyncLLMEngine, receivers: dict[str, KVReceiver]) -> None:
        self.engine = engine
        self.receivers = receivers
        self._core = next(iter(receivers.values())).core if receivers else None
        self._by_request: dict[str, Reservation] = {}
        self._fenced: dict[str, ReceiveHandle] = {}  # fence id -> handle of the open window
        self._reaper: asyncio.Task[None] | None = None
        self.on_expire: Callable[[Reservation], None] = lambda res: None

    def get(self, request_id: str) -> Reservation | None:
        return self._by_request.get(request_id)

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        return [res.held() for res in self._by_request.values()]

    async def reserve(
        self, request: Request, generation: int, lease_seconds: float
    ) -> Reservation | None:
        """Blocks for the prompt (once, whatever n: the n completions fork from it) plus the
        spares their first step needs, and a receive slot; None when the pool is short now."""
        assert self._core is not None
        rid = request.request_id
        try:
            blocks = await self.engine.call(disagg.reserve, request)
        except (asyncio.CancelledError, TimeoutError):
            self.engine.submit(disagg.release, rid)  # runs after the reserve
            raise
        if blocks is None:
            return None
        deadline = time.monotonic() + lease_seconds
        transfer_id = os.urandom(16)
        try:
            handle = self._core.expect(TransferRequest(transfer_id, generation), blocks, deadline)
        except BaseException:
            self.engine.submit(disagg.release, rid)
            raise
        res = Reservation(request, generation, transfer_id, blocks, handle, deadline)
        self._by_request[rid] = res
        return res

    def drop(self, res: Reservation) -> bool:
        """Forget `res`: no more KV writes, and the engine drops the request (waiting for its
        KV, or in the batch) with its blocks. True when it was held."""
        if self._by_request.get(res.request_id) is not res:
            return False
        del self._by_request[res.request_id]
        res.handle.cancel()
        fence = None if res.handle.quiet else f"#fence:{res.transfer_id.hex()}"  # no request id
        self.engine.submit(disagg.release, res.request_id, fence)
        if fence is not None:
            self._fenced[fence] = res.handle
            res.handle.when_quiet(lambda: self._unfence(fence))
        return True

    @property
    def fenced(self) -> int:
        """Dropped reservations whose blocks wait for their sender to stop writing."""
        return len(self._fenced)

    def _unfence(self, fence: str) -> None:
        """The window behind `fence` closed (any thread): its blocks go back to the pool."""
        if self._fenced.pop(fence, None) is not None:
            self.engine.submit(disagg.unfence, fence)

    def start_reaper(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self, timeout: float = 2.0) -> None:
        """Stop the reaper, drop every reservation (cancelling its Decode call) and close the
        receivers in parallel, all within `timeout` s."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for res in list(self._by_request.values()):
            if res.task is not None:
                res.task.cancel()
            self.drop(res)
        await close_within([r.close for r in self.receivers.values()], timeout, "kv receiver")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECONDS)
            now = time.monotonic()
            for fence, handle in list(self._fenced.items()):
                if handle.close_window_if_due(now):  # the sender stopped by then
                    self._unfence(fence)  # a no-op unless its quiet callback went missing
            for res in list(self._by_request.values()):
                if now < res.deadline:
                    continue
                if res.decoding:  # its Decode waits for the KV: end that wait (no-op once landed)
                    res.handle.expire_if_due()
                    continue
                with request_scope(res.request_id):  # the log line's request_id field
                    LOG.info("reservation of %s expired", res.request_id)
                self.drop(res)
                self.on_expire(res)
