"""PrefillService: Prepare (validate + tokenize), Prefill (compute, ship KV, first token), Release.

Prefill runs the request prefill-only with chunked prefill on this worker's engine; when it is
PREFILLED its blocks are shipped to the reservation named by `target` and released (back to the
pool, full blocks staying in the prefix cache) only after the receiver acknowledged, or on any
failure. The whole call is bounded by its deadline and `transfer_timeout`.

Overlap of transfer with compute: the blocks of a finished prefill chunk are final once the
scheduler committed them, so a per-chunk sender would start them after each engine step
(a step hook in `AsyncLLMEngine` → `KVSender.start` on the chunk's full blocks, with the tail
block sent last). Today the whole block set is sent after the last chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import grpc

from kv_transfer.state import TransferRequest, TransferResult
from kvmesh.engine import disagg
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sequence import Request
from kvmesh.service.convert import first_tokens
from kvmesh.service.runtime import WorkerRuntime, check_layout
from kvmesh.service.server import span
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.telemetry.metrics import WorkerMetrics
from kvmesh.telemetry.tracing import tracer
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from prefill_svc.senders import SenderPool

TRACER = tracer("kvmesh.prefill")
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
    ) -> None:
        self.runtime = runtime
        self.senders = senders
        self.metrics = metrics
        self.transfer_timeout = transfer_timeout
        self.active: dict[str, ActivePrefill] = {}

    async def Prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        with span(TRACER, "prefill.prepare", context):
            return await self.runtime.serve_prepare(request, context)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        with span(TRACER, "prefill.prefill", context):
            timings = Timings(time.monotonic())
            try:
                engine_request = self.runtime.request_from(request.request, prefill_only=True)
                self._check_target(request.target, engine_request)
                return await self._prefill(engine_request, request.target, context, timings)
            except Exception as exc:
                self.metrics.requests.labels(status_of(exc)[0].name.lower()).inc()
                await abort_with(context, exc)
                raise

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
                rid, lambda e: disagg.add_request(e, request), cleanup=disagg.release_prefilled
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
            self.metrics.requests.labels("ok").inc()
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
        outcome = "ok" if result.ok else result.state.name.lower()
        self.metrics.transfer_seconds.labels(backend, outcome).observe(timings.transfer)
        if not result.ok:
            error = result.error or ServiceError(grpc.StatusCode.ABORTED, result.state.name)
            code, message = status_of(error)
            raise ServiceError(code, f"target: KV transfer to {target.worker_id!r}: {message}")
        self.metrics.transfer_bytes.labels(backend).inc(result.num_bytes)
        return result

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
        with span(TRACER, "prefill.release", context):
            return worker_pb2.ReleaseResponse(
                released=self.release(request.request_id, request.generation)
            )

    def release(self, request_id: str, generation: int = 0) -> bool:
        """Cancel a prefill in progress (its blocks are freed by its own cleanup)."""
        active = self.active.get(request_id)
        if active is None or generation not in (0, active.generation) or active.task is None:
            return False
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
