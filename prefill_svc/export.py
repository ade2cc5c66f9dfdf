"""KVExport: the step hook that hands a Prefill's final blocks to its KV sender.

It runs on the engine thread after every step of the request and records what the engine's KV
connector (`disagg.ready_blocks`) reports final: each finished chunk's full blocks with
`overlap`, else none before PREFILLED; at PREFILLED the rest and the first tokens (the
transfer's trailer); a first token that already ends the request means no KV at all. A
preemption (the request's blocks were freed and will be recomputed) stops the send.

The send handle may come later than the first steps (PrefillAhead starts computing before the
decode worker's reservation is known): `attach` hands it what was recorded so far, and from
then on each step's news goes out at once. Quick and non-blocking on both threads:
`StreamSendHandle.add` only records the part for the sender thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kv_transfer.interface import StreamSendHandle
from kvmesh.engine import disagg
from kvmesh.engine.outputs import RequestOutput
from kvmesh.service.convert import first_tokens
from kvmesh.v1 import worker_pb2

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine
    from prefill_svc.spans import ChunkEvents


class KVExport:
    """One Prefill's export: `__call__` on the engine thread, `attach` on the event loop."""

    def __init__(self, *, overlap: bool) -> None:
        self.overlap = overlap
        self.events: ChunkEvents | None = None
        self.parts = 0  # block sets handed to the sender
        self._lock = threading.Lock()
        self._handle: StreamSendHandle | None = None
        self._num_blocks = 0
        self._ready: list[int] = []  # source block ids final so far (those to send)
        self._sent = 0  # blocks handed to the sender
        self._preemptions: int | None = None
        self._final: RequestOutput | None = None  # the output with the first tokens
        self._kv = True  # False: the first token ended the request, no KV to send
        self._stopped = False
        self._done = False

    def attach(self, handle: StreamSendHandle, num_blocks: int) -> None:
        """Start sending into `handle`, which expects `num_blocks` blocks."""
        with self._lock:
            self._handle, self._num_blocks = handle, num_blocks
            self._flush()

    def __call__(self, engine: LLMEngine, request_id: str, output: RequestOutput | None) -> None:
        with self._lock:
            if self._done or self._final is not None or self._stopped:
                return
            if output is not None and output.finished:  # the first token ended it: no KV left
                self._final, self._kv = output, False
            else:
                self._record(disagg.ready_blocks(engine, request_id), output)
            self._flush()

    def _record(self, ready: disagg.ReadyBlocks | None, output: RequestOutput | None) -> None:
        if ready is None:
            return
        if self.events is not None:
            self.events(ready)
        if self._preemptions is None:
            self._preemptions = ready.preemptions
        if ready.preemptions != self._preemptions:
            self._stopped = True
            return
        if self.overlap or ready.prefilled:
            self._ready = list(ready.block_ids)
        if ready.prefilled:
            if output is None:
                self._stopped = True
            else:
                self._final = output

    def _flush(self) -> None:
        """Hand the sender what it has not had yet (under the lock; no-op before `attach`)."""
        handle = self._handle
        if handle is None or self._done:
            return
        if handle.record.state.is_terminal:
            self._done = True
            return
        if self._stopped:
            self._stop(handle)
            return
        if self._kv and len(self._ready) > self._sent:
            handle.add(self._sent, self._ready[self._sent :])
            self._sent = len(self._ready)
            self.parts += 1
        if self._final is None:
            return
        if self._kv and self._sent != self._num_blocks:
            self._stop(handle)
            return
        trailer = worker_pb2.FirstTokens(tokens=first_tokens(self._final)).SerializeToString()
        handle.finish(trailer, kv=self._kv)
        self._done = True

    def _stop(self, handle: StreamSendHandle) -> None:
        self._done = True
        handle.cancel()
