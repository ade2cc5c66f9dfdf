"""DecodeService: Reserve blocks under a lease, Decode once the KV landed, Release.

Reserve takes the prepared request, or the client's request, which it prepares (validates,
tokenizes) itself and returns. Decode may be opened right after Reserve, while the prefill
runs: it subscribes to the request's engine stream at once, and the thread that ends the
transfer (a receiver's, or the lease's expiry) queues the join itself, one engine command that
takes the first tokens (and their logprobs) from the transfer's final frame and joins the
running batch (the KV connector's `import_prefilled`), with no hop through the event loop in
between. Fencing: Decode names the worker epoch, the ledger generation and the transfer id of
its reservation; any mismatch is FAILED_PRECONDITION naming the field. First tokens that
already end every completion (stop id, EOS, max_tokens 1, stop string) come without KV. With
n > 1 the prompt's blocks are reserved once, with n - 1 spare blocks for the forks' first
step, and Decode joins the n completions sharing them copy on write."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from decode_svc.reservations import Reservation, ReservationTable
from kv_transfer.state import TransferResult, TransferState
from kvmesh.engine import disagg
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sequence import Request
from kvmesh.service.convert import logprobs_from_proto
from kvmesh.service.runtime import WorkerRuntime
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.service.streaming import responses
from kvmesh.telemetry.metrics import WorkerMetrics
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

DEFAULT_LEASE_SECONDS = 30.0
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self, runtime: WorkerRuntime, table: ReservationTable, metrics: WorkerMetrics
    ) -> None:
        self.runtime = runtime
        self.table = table
        self.metrics = metrics
        table.on_expire = lambda res: metrics.reservation_leases.labels("expired").inc()

    # -- Reserve ---------------------------------------------------------------------------
    async def Reserve(
        self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        try:
            response = await self._reserve(request, context)
        except Exception as exc:
            await abort_with(context, exc)
            raise
        self.metrics.reservation_leases.labels("granted").inc()
        return response

    async def _reserve(
        self, message: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveResponse:
        prepared = message.request
        if message.HasField("prompt"):
            prepared = await self.runtime.prepare_request(message.prompt)
        engine_request = self.runtime.request_from(prepared, prefill_only=False)
        if message.generation == 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "generation: must be non-zero")
        lease = self._lease(message, context)  # checked before anything changes
        rid = engine_request.request_id
        held = self.table.get(rid)
        if held is not None:
            if held.generation >= message.generation:
                raise ServiceError(
                    FAILED_PRECONDITION,
                    f"generation: {rid!r} is held under generation {held.generation}",
                )
            # a newer generation supersedes a stale reservation (its open Decode call ends);
            # stale whatever this call's outcome, it is freed even when the pool is then short
            self.release(rid, held.generation, f"superseded by generation {message.generation}")
        res = await self.table.reserve(engine_request, message.generation, lease)
        if res is None:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, self._shortage(engine_request))
        return worker_pb2.ReserveResponse(
            block_ids=res.block_ids,
            transfer_id=res.transfer_id.hex(),
            epoch=self.runtime.epoch,
            layout=self.runtime.layout,
            request=prepared,
        )

    def _shortage(self, request: Request) -> str:
        """What a refused reservation lacked, naming the field that sized it."""
        load = self.runtime.engine.load()
        free = load.free_blocks
        layout = self.runtime.layout
        prompt = -(-len(request.seqs[0].prompt_ids) // layout.block_size)
        n = request.params.n
        if n == 1:
            return f"blocks: the prompt needs {prompt} KV blocks, {free} free now"
        spare = disagg.spare_blocks(n)
        return (
            f"sampling.n: {n} completions need {prompt + spare} KV blocks ({prompt} for the"
            f" shared prompt + {spare} for the forks' first step), {free} free now"
            f" of {load.total_blocks}"
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
        started = time.monotonic()
        try:
            res = self._claim(request)
            raise_if_released(res)
        except Exception as exc:
            self.metrics.request_done(status_of(exc)[0])
            await abort_with(context, exc)
            return
        code = grpc.StatusCode.CANCELLED  # unless the stream finishes or fails
        try:
            stream = self.runtime.engine.open_stream_when(
                res.request_id,
                res.handle.when_done,
                lambda engine: self._join(engine, res),
                cleanup=_table_cleans_up,
            )
            res.stream = stream
            try:
                tokenizer = self.runtime.core.tokenizer
                landed = self._landed(res, started)
                async for response in responses(stream, landed, tokenizer=tokenizer):
                    yield response
                if stream.finished:
                    code = grpc.StatusCode.OK
            finally:
                stream.close()
        except Exception as exc:
            code = status_of(exc)[0]
            await abort_with(context, exc)
        finally:
            self.table.drop(res)  # drops the request (fenced while a sender may write)
            self.metrics.request_done(code)

    def _join(self, engine: LLMEngine, res: Reservation) -> RequestOutput:
        """On the engine thread, the moment the transfer ended (the receiving thread queued
        this): join the batch with the trailer's first tokens, or raise why not (released,
        transfer failed or expired, a bad trailer)."""
        raise_if_released(res)
        result = res.handle.wait(0.0)  # terminal already: the result, without waiting
        check_transfer(result)
        first = self._trailer_tokens(result, res)
        tokens = [t.token_id for t in first]
        logprobs = [
            logprobs_from_proto(t.logprobs) if t.HasField("logprobs") else None for t in first
        ]
        return disagg.import_prefilled(
            engine, res.request, tokens, logprobs, kv_complete=result.kv_complete
        )

    @staticmethod
    def _landed(res: Reservation, started: float) -> Callable[[], float]:
        """When the KV landed (read at the first response, which follows it); the call's span
        gets a `kv_received` event stamped with that moment."""

        def landed() -> float:
            now = time.monotonic()
            at = res.handle.ended or now
            waited = {"kvmesh.kv_wait_seconds": max(0.0, at - started)}
            stamp = time.time_ns() - int((now - at) * 1e9)
            trace.get_current_span().add_event("kv_received", waited, timestamp=stamp)
            return at

        return landed

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
        res.decoding = True
        res.task = asyncio.current_task()
        return res

    def _trailer_tokens(
        self, result: TransferResult, res: Reservation
    ) -> list[worker_pb2.FirstToken]:
        """The first tokens of the transfer's trailer (INVALID_ARGUMENT naming it when bad)."""
        try:
            tokens = list(worker_pb2.FirstTokens.FromString(result.trailer).tokens)
        except DecodeError:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, "transfer_id: the trailer is not FirstTokens"
            ) from None
        vocab = self.runtime.core.runner.vocab_size
        check_first_tokens(tokens, res.request.params.n, vocab, "transfer_id.trailer")
        return tokens

    # -- Release ---------------------------------------------------------------------------
    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        reason = request.reason or "released"
        released = self.release(request.request_id, request.generation, reason)
        return worker_pb2.ReleaseResponse(released=released)

    def release(self, request_id: str, generation: int = 0, reason: str = "released") -> bool:
        """Free whatever is held for the request (generation 0: any); idempotent. An open
        Decode call for it ends at once with ABORTED naming `reason` (its wait for the KV
        ends with the cancelled receive; its stream with the error)."""
        res = self.table.get(request_id)
        if res is None or generation not in (0, res.generation):
            return False
        if res.task is not None and res.task is not asyncio.current_task():
            res.released = reason
            if res.stream is not None:  # ends now; its request id is free for a newer one
                res.stream.detach(released_error(res))
        return self.table.drop(res)


def _table_cleans_up(engine: LLMEngine, request_id: str) -> None:
    """A Decode stream's cleanup: none of its own. The call's `ReservationTable.drop` drops
    the request, fenced while a registered-memory sender may still write into its blocks; a
    stream's default abort would free them to the pool at once."""


def released_error(res: Reservation) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.ABORTED, f"request_id: {res.request_id!r} was released ({res.released})"
    )


def raise_if_released(res: Reservation) -> None:
    if res.released is not None:
        raise released_error(res)


def check_first_tokens(
    tokens: Sequence[worker_pb2.FirstToken], n: int, vocab: int, where: str
) -> None:
    """INVALID_ARGUMENT naming `where` unless the tokens are one per completion, indexes
    0..n-1 in order, each a token of the vocabulary."""
    if [t.index for t in tokens] != list(range(n)):
        indexes = [t.index for t in tokens]
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: expected indexes 0..{n - 1} in order (n = {n}), got {indexes}",
        )
    for token in tokens:
        if not 0 <= token.token_id < vocab:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.token_id: {token.token_id} out of range [0, {vocab})",
            )


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
