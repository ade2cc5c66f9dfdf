"""PrefillService: Prepare (validate + tokenize), Prefill (compute, ship KV, first token), Release.

Prefill runs the request prefill-only with chunked prefill on this worker's engine and ships its
KV to the reservation named by `target` as one streamed send (`KVSender.start_stream`), started
with the prefill. A step hook on the engine thread (`KVExport`, through the engine's KV connector
`disagg.ready_blocks`) hands the sender thread the blocks that are final, never waiting itself:
with `--transfer-overlap` (the default) each finished chunk's full blocks go out while the next
chunk computes; with `--no-transfer-overlap` the whole set goes once the request is PREFILLED.
At PREFILLED the hook adds the rest and finishes the send with the first tokens (and their
logprobs) as the transfer's trailer, so the decode worker has them with the KV; a first token
that already ends the request finishes it without KV. The receiver acknowledges once, after the
last frame; only then are the blocks released (back to the pool, full blocks staying in the
prefix cache), or on any failure. The whole call is bounded by its deadline and
`transfer_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from kv_transfer.interface import KVSender, StreamSendHandle
from kv_transfer.state import TransferRequest, TransferResult
from kvmesh.engine import disagg
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sequence import Request
from kvmesh.service.convert import first_tokens
from kvmesh.service.runtime import WorkerRuntime, check_layout
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.telemetry.metrics import WorkerMetrics, status_name
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from prefill_svc.senders import SenderPool
from prefill_svc.spans import ChunkEvents, TransferSpan

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

DEFAULT_TRANSFER_TIMEOUT = 30.0
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


@dataclasses.dataclass
class ActivePrefill:
    generation: int
    deadline: float
    task: asyncio.Task[Any] | None
    state: int = worker_pb2.BLOCK_SET_STATE_FILLING
    num_blocks: int = 0


@dataclasses.dataclass
class Timings:
    arrival: float
    added: float = 0.0
    first: float = 0.0
    transfer: float = 0.0


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        runtime: WorkerRuntime,
        senders: SenderPool,
        metrics: WorkerMetrics,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        *,
        transfer_overlap: bool = True,
    ) -> None:
        self.runtime = runtime
        self.senders = senders
        self.metrics = metrics
        self.transfer_timeout = transfer_timeout
        self.transfer_overlap = transfer_overlap
        self.active: dict[str, ActivePrefill] = {}
        self.released: set[str] = set()  # cancelled by Release, not by their caller

    async def Prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        return await self.runtime.serve_prepare(request, context)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        rid = request.request.request_id
        timings = Timings(time.monotonic())
        try:
            engine_request = self.runtime.request_from(request.request, prefill_only=True)
            self._check_target(request.target, engine_request)
            return await self._prefill(engine_request, request.target, context, timings)
        except asyncio.CancelledError:
            if rid not in self.released:  # the caller cancelled: nobody awaits a status
                raise
            self.metrics.request_done(grpc.StatusCode.ABORTED)
            await context.abort(grpc.StatusCode.ABORTED, "request_id: released by Release")
            raise
        except Exception as exc:
            self.metrics.request_done(status_of(exc)[0])
            await abort_with(context, exc)
            raise
        finally:
            self.released.discard(rid)

    def _check_target(self, target: worker_pb2.KVTarget, request: Request) -> None:
        mismatch = check_layout(self.runtime.layout, target.layout, "target.layout")
        if mismatch is not None:
            raise ServiceError(FAILED_PRECONDITION, mismatch)
        if target.backend not in self.senders.backends:
            raise ServiceError(
                FAILED_PRECONDITION,
                f"target.backend: {target.backend!r} is not one of {self.senders.backends}",
            )
        block_size = self.runtime.layout.block_size
        needed = -(-len(request.seqs[0].prompt_ids) // block_size)
        if len(target.block_ids) != needed:
            raise ServiceError(
                INVALID_ARGUMENT,
                f"target.block_ids: {len(target.block_ids)} blocks for a prompt needing {needed}",
            )
        try:
            if len(bytes.fromhex(target.transfer_id)) != 16:
                raise ValueError
        except ValueError:
            raise ServiceError(INVALID_ARGUMENT, "target.transfer_id: not 32 hex digits") from None
        if target.generation == 0:
            raise ServiceError(INVALID_ARGUMENT, "target.generation: must be non-zero")
        if request.request_id in self.active:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.request_id!r} in progress"
            )

    async def _prefill(
        self,
        request: Request,
        target: worker_pb2.KVTarget,
        context: grpc.aio.ServicerContext,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        """Prefill with its KV (and then its first tokens) streamed to `target`."""
        rid, engine = request.request_id, self.runtime.engine
        remaining = context.time_remaining()
        deadline = time.monotonic() + (self.transfer_timeout if remaining is None else remaining)
        active = ActivePrefill(target.generation, deadline, asyncio.current_task())
        active.num_blocks = len(target.block_ids)
        self.active[rid] = active
        backend, endpoint = target.backend, target.endpoint
        sender = self.senders.take_idle(backend, endpoint)
        handle: StreamSendHandle | None = None
        with TransferSpan(target, len(target.block_ids)) as span:
            try:
                if sender is None:
                    sender = await asyncio.to_thread(self.senders.acquire, backend, endpoint)
                transfer = TransferRequest(bytes.fromhex(target.transfer_id), target.generation)
                handle = sender.start_stream(transfer, list(target.block_ids), deadline=deadline)
                export = KVExport(handle, len(target.block_ids), overlap=self.transfer_overlap)
                export.events = ChunkEvents(trace.get_current_span())
                stream = await engine.open_stream(
                    rid,
                    lambda e: disagg.add_request(e, request),
                    cleanup=disagg.release,
                    on_step=export,
                )
                try:
                    timings.added = time.monotonic()
                    first = await anext(stream)
                    timings.first = time.monotonic()
                    active.state = worker_pb2.BLOCK_SET_STATE_SENDING
                    result = await self._await_sent(handle, target, timings, span)
                finally:
                    span.parts = export.parts
                    stream.close()  # the release, queued on the engine before the caller hears back
                self.metrics.request_done(grpc.StatusCode.OK)
                return self._response(first, timings, result)
            finally:
                self.active.pop(rid, None)
                if sender is not None:
                    self._give_back(backend, endpoint, sender, handle)

    async def _await_sent(
        self,
        handle: StreamSendHandle,
        target: worker_pb2.KVTarget,
        timings: Timings,
        span: TransferSpan,
    ) -> TransferResult:
        """The receiver's acknowledgement (bounded by `transfer_timeout` from the first token)."""
        try:
            result = await handle.wait_async(self.transfer_timeout)
        except BaseException:
            handle.cancel()
            raise
        if not result.state.is_terminal:
            handle.cancel()
            result = await handle.wait_async(2.0)
        timings.transfer = time.monotonic() - timings.first  # the part not hidden by compute
        span.settled(result)
        return self._settle(result, target, timings.transfer)

    def _settle(
        self, result: TransferResult, target: worker_pb2.KVTarget, seconds: float
    ) -> TransferResult:
        """Record a finished transfer's metrics; raise a ServiceError naming `target` unless the
        receiver acknowledged it."""
        backend = target.backend
        if result.ok:
            self.metrics.transfer_seconds.labels(backend, "OK").observe(seconds)
        else:
            error = result.error or ServiceError(grpc.StatusCode.ABORTED, result.state.name)
            code, message = status_of(error)
            self.metrics.transfer_seconds.labels(backend, status_name(code)).observe(seconds)
            raise ServiceError(code, f"target: KV transfer to {target.worker_id!r}: {message}")
        self.metrics.transfer_bytes.labels(backend).inc(result.num_bytes)
        return result

    def _give_back(
        self, backend: str, endpoint: str, sender: KVSender, handle: StreamSendHandle | None
    ) -> None:
        """Return the sender to the pool once its transfer thread ended (a sender carries one
        transfer at a time); never waits here."""
        if handle is not None:
            handle.cancel()  # no-op once terminal
        thread = None if handle is None else handle.thread
        if thread is None or not thread.is_alive():
            self.senders.release(backend, endpoint, sender)
            return

        def later() -> None:
            thread.join(10.0)
            if thread.is_alive():
                sender.close()
            else:
                self.senders.release(backend, endpoint, sender)

        threading.Thread(target=later, name="kv-sender-return", daemon=True).start()

    @staticmethod
    def _response(
        first: RequestOutput, timings: Timings, result: TransferResult | None
    ) -> worker_pb2.PrefillResponse:
        return worker_pb2.PrefillResponse(
            first_tokens=first_tokens(first),
            cached_tokens=first.num_cached_tokens,
            queue_seconds=timings.added - timings.arrival,
            prefill_seconds=timings.first - timings.added,
            transfer_seconds=timings.transfer,
            transfer_bytes=0 if result is None else result.num_bytes,
        )

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(
            released=self.release(request.request_id, request.generation)
        )

    def release(self, request_id: str, generation: int = 0) -> bool:
        """Cancel a prefill in progress (its blocks are freed by its own cleanup)."""
        active = self.active.get(request_id)
        if active is None or generation not in (0, active.generation) or active.task is None:
            return False
        self.released.add(request_id)
        active.task.cancel()
        return True

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        now = time.monotonic()
        return [
            worker_pb2.HeldBlockSet(
                request_id=rid,
                state=a.state,  # type: ignore[arg-type]
                num_blocks=a.num_blocks,
                generation=a.generation,
                lease_remaining_seconds=max(0.0, a.deadline - now),
            )
            for rid, a in self.active.items()
        ]


class KVExport:
    """Step hook (engine thread) of one Prefill: hands the sender the blocks the engine's KV
    connector reports final (each finished chunk's with `overlap`, else none before
    PREFILLED), then the rest and the first tokens as the trailer once the request is
    PREFILLED; a first token that ended the request finishes the send without KV. Quick and
    non-blocking: `StreamSendHandle.add` only records the part for the sender thread. A
    preemption (the request's blocks were freed and will be recomputed) cancels the send."""

    def __init__(self, handle: StreamSendHandle, num_blocks: int, *, overlap: bool) -> None:
        self.handle = handle
        self.num_blocks = num_blocks
        self.overlap = overlap
        self.sent = 0  # blocks handed to the sender
        self.preemptions: int | None = None
        self.done = False
        self.parts = 0  # block sets handed to the sender
        self.events: ChunkEvents | None = None

    def __call__(self, engine: LLMEngine, request_id: str, output: RequestOutput | None) -> None:
        if self.done:
            return
        if self.handle.record.state.is_terminal:
            self.done = True
            return
        if output is not None and output.finished:  # the first token ended it: no KV left
            self._finish(output, kv=False)
            return
        ready = disagg.ready_blocks(engine, request_id)
        if ready is None:
            return
        if self.events is not None:
            self.events(ready)
        if self.preemptions is None:
            self.preemptions = ready.preemptions
        if ready.preemptions != self.preemptions:
            self._stop()
            return
        if (self.overlap or ready.prefilled) and len(ready.block_ids) > self.sent:
            self.handle.add(self.sent, ready.block_ids[self.sent :])
            self.sent = len(ready.block_ids)
            self.parts += 1
        if ready.prefilled:
            if self.sent != self.num_blocks or output is None:
                self._stop()
                return
            self._finish(output, kv=True)

    def _finish(self, output: RequestOutput, *, kv: bool) -> None:
        trailer = worker_pb2.FirstTokens(tokens=first_tokens(output)).SerializeToString()
        self.handle.finish(trailer, kv=kv)
        self.done = True

    def _stop(self) -> None:
        self.done = True
        self.handle.cancel()
