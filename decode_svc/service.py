"""DecodeService: Reserve blocks under a lease, Decode once the KV landed, Release.

Fencing: Decode names the worker epoch, the ledger generation and the transfer id of its
reservation; any mismatch is FAILED_PRECONDITION naming the field. A request whose first token
already ends it (stop id, EOS, max_tokens 1, stop string) needs no KV and does not wait for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import grpc

from decode_svc.reservations import Reservation, ReservationTable
from kv_transfer.state import TransferResult, TransferState
from kvmesh.engine import disagg
from kvmesh.service.convert import logprobs_from_proto
from kvmesh.service.runtime import WorkerRuntime
from kvmesh.service.server import span
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.service.streaming import responses
from kvmesh.telemetry.metrics import WorkerMetrics
from kvmesh.telemetry.tracing import tracer
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

TRACER = tracer("kvmesh.decode")
DEFAULT_LEASE_SECONDS = 30.0
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self, runtime: WorkerRuntime, table: ReservationTable, metrics: WorkerMetrics
    ) -> None:
        self.runtime = runtime
        self.table = table
        self.metrics = metrics
        table.on_expire = lambda res: metrics.lease_expiries.labels("reservation").inc()

    # -- Reserve ---------------------------------------------------------------------------
    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        with span(TRACER, "decode.reserve", context):
            try:
                return await self._reserve(request, context)
            except Exception as exc:
                await abort_with(context, exc)
                raise

    async def _reserve(
        self, message: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        engine_request = self.runtime.request_from(message.request, prefill_only=False)
        if engine_request.params.n != 1:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n: decode takes n 1")
        if message.generation == 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "generation: must be non-zero")
        rid = engine_request.request_id
        held = self.table.get(rid)
        if held is not None:
            if held.generation >= message.generation:
                raise ServiceError(
                    FAILED_PRECONDITION,
                    f"generation: {rid!r} is held under generation {held.generation}",
                )
            self.table.drop(held)  # a newer generation supersedes a stale reservation
        res = await self.table.reserve(
            engine_request, message.generation, self._lease(message, context)
        )
        if res is None:
            load = self.runtime.engine.load()
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"blocks: the prompt needs more KV blocks than the {load.free_blocks} free now",
            )
        return worker_pb2.ReserveResponse(
            block_ids=res.block_ids,
            transfer_id=res.transfer_id.hex(),
            epoch=self.runtime.epoch,
            layout=self.runtime.layout,
        )

    @staticmethod
    def _lease(message: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> float:
        lease = message.lease_seconds
        if not math.isfinite(lease) or lease < 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "lease_seconds: must be >= 0")
        lease = lease or DEFAULT_LEASE_SECONDS
        remaining = context.time_remaining()
        return lease if remaining is None else min(lease, remaining)

    # -- Decode ----------------------------------------------------------------------------
    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        with span(TRACER, "decode.decode", context):
            started = time.monotonic()
            try:
                res = self._claim(request)
                first_token = await self._await_kv(res, request, context)
            except Exception as exc:
                await abort_with(context, exc)
                return
            first_lp = request.first_tokens[0]
            logprobs = logprobs_from_proto(first_lp.logprobs) if first_lp.HasField(
                "logprobs") else None  # fmt: skip
            finished = False
            try:
                stream = await self.runtime.engine.open_stream(
                    res.request_id,
                    lambda e: disagg.join_prefilled(e, res.request, first_token, logprobs),
                )
                try:
                    tokenizer = self.runtime.core.tokenizer
                    async for response in responses(stream, started, tokenizer=tokenizer):
                        yield response
                    finished = stream.finished
                finally:
                    stream.close()
            except Exception as exc:
                await abort_with(context, exc)
            finally:
                self.table.drop(res)  # aborts the request unless it finished; idempotent
                if finished:
                    self.metrics.requests.labels("ok").inc()

    def _claim(self, message: worker_pb2.DecodeRequest) -> Reservation:
        """The reservation this Decode names, checked field by field, now DECODING."""
        if message.epoch != self.runtime.epoch:
            raise ServiceError(
                FAILED_PRECONDITION,
                f"epoch: {message.epoch} is not this worker's incarnation {self.runtime.epoch}",
            )
        res = self.table.get(message.request_id)
        if res is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"request_id: no reservation for {message.request_id!r}"
            )
        if res.generation != message.generation:
            raise ServiceError(
                FAILED_PRECONDITION,
                f"generation: {message.generation} does not hold the reservation "
                f"(generation {res.generation})",
            )
        if res.transfer_id.hex() != message.transfer_id:
            raise ServiceError(FAILED_PRECONDITION, "transfer_id: not this reservation's")
        if res.decoding:
            raise ServiceError(FAILED_PRECONDITION, "request_id: already decoding")
        if len(message.first_tokens) != 1 or message.first_tokens[0].index != 0:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, "first_tokens: expected one, with index 0"
            )
        token = message.first_tokens[0].token_id
        if not 0 <= token < self.runtime.core.runner.vocab_size:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"first_tokens.token_id: {token} out of range"
            )
        res.decoding = True
        res.task = asyncio.current_task()
        return res

    async def _await_kv(
        self, res: Reservation, message: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> int:
        """Wait for the KV (bounded by the lease and the call deadline) unless not needed."""
        token = message.first_tokens[0].token_id
        try:
            needs_kv = not await self.runtime.engine.call(
                disagg.first_token_finishes, res.request, token
            )
            if not needs_kv:
                res.handle.cancel()
                return token
            limit = res.deadline - time.monotonic()
            remaining = context.time_remaining()
            if remaining is not None:
                limit = min(limit, remaining)
            result = await asyncio.to_thread(res.handle.wait, max(0.0, limit))
            check_transfer(result)
            return token
        except BaseException:
            self.table.drop(res)
            raise

    # -- Release ---------------------------------------------------------------------------
    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        with span(TRACER, "decode.release", context):
            released = self.release(request.request_id, request.generation)
            return worker_pb2.ReleaseResponse(released=released)

    def release(self, request_id: str, generation: int = 0) -> bool:
        """Free whatever is held for the request (generation 0: any); idempotent."""
        res = self.table.get(request_id)
        if res is None or generation not in (0, res.generation):
            return False
        if res.task is not None and res.task is not asyncio.current_task():
            res.task.cancel()
        return self.table.drop(res)


def check_transfer(result: TransferResult) -> None:
    """Raise the status for a transfer that did not complete."""
    if result.ok:
        return
    if result.state in (TransferState.PENDING, TransferState.IN_FLIGHT, TransferState.EXPIRED):
        raise ServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"transfer_id: the KV did not arrive in time (state {result.state.name})",
        )
    if result.error is not None:
        code, message = status_of(result.error)
        raise ServiceError(code, f"transfer_id: {message}")
    raise ServiceError(grpc.StatusCode.ABORTED, f"transfer_id: transfer {result.state.name}")
