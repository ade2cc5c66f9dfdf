"""PrefillService: Prepare (validate + tokenize), Prefill (compute, ship KV, first token), Release.

Prefill runs the request prefill-only with chunked prefill on this worker's engine; when it is
PREFILLED its blocks are shipped to the reservation named by `target` and released (back to the
pool, full blocks staying in the prefix cache) only after the receiver acknowledged, or on any
failure. The whole call is bounded by its deadline and `transfer_timeout`.

Overlap of transfer with compute (`--transfer-overlap`, the default): the transfer starts with
the prefill as a streamed send (`KVSender.start_stream`). A step hook on the engine thread
(`AsyncLLMEngine.open_stream(on_step=...)`) hands the sender thread the blocks that each finished
chunk filled (they are final: a prefill-only request's blocks change only if it is preempted,
which cancels the transfer), never waiting itself; the sender gathers and ships them while the
next chunk computes. When the request is PREFILLED (first token sampled) the hook adds the rest
(the last, partial block) and finishes the send; the receiver acknowledges once, after the last
block, and only then are the blocks released. `--no-transfer-overlap` sends the whole block set
after the first token.
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
from kvmesh.engine.sequence import Request, SequenceStatus
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
            if self.transfer_overlap:
                return await self._prefill_streamed(
                    engine_request, request.target, context, timings
                )
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
        rid, engine = request.request_id, self.runtime.engine
        remaining = context.time_remaining()
        deadline = time.monotonic() + (self.transfer_timeout if remaining is None else remaining)
        active = ActivePrefill(target.generation, deadline, asyncio.current_task())
        self.active[rid] = active
        try:
            stream = await engine.open_stream(
                rid,
                lambda e: disagg.add_request(e, request),
                cleanup=disagg.release_prefilled,
                on_step=ChunkEvents(trace.get_current_span()),
            )
            try:
                timings.added = time.monotonic()
                first = await anext(stream)
                timings.first = time.monotonic()
                result = None
                if not first.finished:  # a first token that ends the request left no KV to ship
                    result = await self._ship(request, target, active, timings)
                    await stream.aclose()  # release_prefilled, before the caller hears back
            finally:
                stream.close()  # releases the blocks on any failure; no-op after aclose
            self.metrics.request_done(grpc.StatusCode.OK)
            return self._response(first, timings, result)
        finally:
            self.active.pop(rid, None)

    async def _ship(
        self,
        request: Request,
        target: worker_pb2.KVTarget,
        active: ActivePrefill,
        timings: Timings,
    ) -> TransferResult:
        rid = request.request_id
        blocks = await self.runtime.engine.call(disagg.prefilled_block_ids, rid)
        active.state, active.num_blocks = worker_pb2.BLOCK_SET_STATE_SENDING, len(blocks)
        deadline = min(active.deadline, time.monotonic() + self.transfer_timeout)
        backend, endpoint = target.backend, target.endpoint
        started = time.monotonic()
        with TransferSpan(target, len(blocks)) as span:
            sender = await asyncio.to_thread(self.senders.acquire, backend, endpoint)
            transfer = TransferRequest(bytes.fromhex(target.transfer_id), target.generation)
            handle = sender.start(transfer, blocks, list(target.block_ids), deadline=deadline)
            try:
                result = await asyncio.to_thread(handle.wait)
            except BaseException:
                handle.cancel()
                raise
            finally:
                self.senders.release(backend, endpoint, sender)
            timings.transfer = time.monotonic() - started
            span.settled(result)
            return self._settle(result, target, timings.transfer)

    async def _prefill_streamed(
        self,
        request: Request,
        target: worker_pb2.KVTarget,
        context: grpc.aio.ServicerContext,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        """Prefill with the transfer overlapping it: each finished chunk's blocks go out while
        the next chunk computes (see the module docstring)."""
        rid, engine = request.request_id, self.runtime.engine
        remaining = context.time_remaining()
        deadline = time.monotonic() + (self.transfer_timeout if remaining is None else remaining)
        active = ActivePrefill(target.generation, deadline, asyncio.current_task())
        active.num_blocks = len(target.block_ids)
        self.active[rid] = active
        backend, endpoint = target.backend, target.endpoint
        sender: KVSender | None = None
        handle: StreamSendHandle | None = None
        with TransferSpan(target, len(target.block_ids)) as span:
            try:
                sender = await asyncio.to_thread(self.senders.acquire, backend, endpoint)
                transfer = TransferRequest(bytes.fromhex(target.transfer_id), target.generation)
                handle = sender.start_stream(transfer, list(target.block_ids), deadline=deadline)
                feeder = ChunkFeeder(handle, self.runtime.layout.block_size, len(target.block_ids))
                feeder.events = ChunkEvents(trace.get_current_span())
                stream = await engine.open_stream(
                    rid,
                    lambda e: disagg.add_request(e, request),
                    cleanup=disagg.release_prefilled,
                    on_step=feeder,
                )
                try:
                    timings.added = time.monotonic()
                    first = await anext(stream)
                    timings.first = time.monotonic()
                    result = None
                    if first.finished:  # a first token that ends the request left no KV to ship
                        handle.cancel()
                    else:
                        active.state = worker_pb2.BLOCK_SET_STATE_SENDING
                        span.parts = feeder.parts
                        result = await self._await_streamed(handle, target, timings, span)
                        await stream.aclose()  # release_prefilled, before the caller hears back
                finally:
                    stream.close()  # releases the blocks on any failure; no-op after aclose
                self.metrics.request_done(grpc.StatusCode.OK)
                return self._response(first, timings, result)
            finally:
                self.active.pop(rid, None)
                if sender is not None:
                    self._give_back(backend, endpoint, sender, handle)

    async def _await_streamed(
        self,
        handle: StreamSendHandle,
        target: worker_pb2.KVTarget,
        timings: Timings,
        span: TransferSpan,
    ) -> TransferResult:
        """The receiver's acknowledgement (bounded by `transfer_timeout` from the first token)."""
        try:
            result = await asyncio.to_thread(handle.wait, self.transfer_timeout)
        except BaseException:
            handle.cancel()
            raise
        if not result.state.is_terminal:
            handle.cancel()
            result = await asyncio.to_thread(handle.wait, 2.0)
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


class ChunkFeeder:
    """Step hook (engine thread): hands the sender each finished chunk's full blocks, then the
    rest once the request is PREFILLED. Quick and non-blocking: `StreamSendHandle.add` only
    records the part for the sender thread. A preemption (the request's blocks were freed and
    will be recomputed) or an early finish cancels the transfer instead."""

    def __init__(self, handle: StreamSendHandle, block_size: int, num_blocks: int) -> None:
        self.handle = handle
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sent = 0  # blocks handed to the sender
        self.preemptions: int | None = None
        self.done = False
        self.parts = 0  # block sets handed to the sender
        self.events: ChunkEvents | None = None

    def __call__(self, engine: LLMEngine, request_id: str) -> None:
        if self.events is not None:
            self.events(engine, request_id)
        if self.done:
            return
        if self.handle.record.state.is_terminal:
            self.done = True
            return
        request = engine.scheduler.get_request(request_id)
        if request is None:
            return
        head = request.seqs[0]
        if self.preemptions is None:
            self.preemptions = head.num_preemptions
        seq = disagg.parked_sequence(request) or head  # n > 1: any parked child's table
        status = seq.status
        if head.num_preemptions != self.preemptions or status.is_finished:
            self._stop()
            return
        if status is SequenceStatus.PREFILLED:
            ready = self.num_blocks
        elif status is SequenceStatus.RUNNING:
            ready = min(seq.num_computed_tokens // self.block_size, self.num_blocks)
        else:
            return
        if ready > self.sent:
            table = engine.scheduler.block_manager.block_table(seq.seq_id)
            if len(table) < ready:
                self._stop()
                return
            self.handle.add(self.sent, table[self.sent : ready])
            self.sent = ready
            self.parts += 1
        if status is SequenceStatus.PREFILLED:
            self.handle.finish()
            self.done = True

    def _stop(self) -> None:
        self.done = True
        self.handle.cancel()
