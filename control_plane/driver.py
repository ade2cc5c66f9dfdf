"""One attempt of a request through the workers, in the order of docs/PROTOCOL.md.

Disaggregated: route (prefix affinity on the prompt's token ids) → ledger.open → Reserve
(decode; it prepares a text or chat prompt and returns the token ids) → Prefill, with the Decode
stream opened at the same time (it waits for the KV, whose final frame carries the first token).
Colocated: Prepare → ledger.open → ColocatedService.Generate stream. Responses go to the run's
queue; failures raise RpcFailure (final) or WorkerLost (the caller may retry).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from control_plane.cluster import Cluster
from control_plane.ledger import WorkerRef
from control_plane.registry import WorkerRecord
from control_plane.releases import BackgroundReleases
from control_plane.routing import NoRouteError, common_backend, order_pairs
from control_plane.run import RpcFailure, Run, WorkerLost
from kvmesh.v1 import generation_pb2, status, worker_pb2, worker_pb2_grpc

DECODE_SKIP_CODES = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def ref(worker: WorkerRecord) -> WorkerRef:
    return WorkerRef(worker.worker_id, worker.epoch)


def avoid_last(workers: Sequence[WorkerRecord], avoid: set[str]) -> list[WorkerRecord]:
    return sorted(workers, key=lambda w: w.worker_id in avoid)


def map_error(error: grpc.aio.AioRpcError, worker: WorkerRecord, what: str) -> Exception:
    """A failed worker call: WorkerLost when the worker is gone (LOST_CODES: a retry may help),
    else the RpcFailure the request ends with (`kvmesh.v1.status.from_call`)."""
    where = f"{what} on {worker.role} worker {worker.worker_id!r}"
    failure = status.from_call(error, where)
    if failure.code in status.LOST_CODES:
        return WorkerLost(worker.worker_id, failure.message)
    return RpcFailure(failure.code, failure.message, failure.retry_after_ms, field=failure.field)


class Driver:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._releases = BackgroundReleases(cluster)

    async def attempt(self, run: Run) -> None:
        live = self._cluster.registry.alive_by_role()
        prefills, decodes, colocated = live["prefill"], live["decode"], live["colocated"]
        try:
            if prefills and decodes:
                await self._disaggregated(run, prefills, decodes)
                return
        except NoRouteError:
            if not colocated:
                raise
        if colocated:
            await self._colocated(run, avoid_last(colocated, run.avoid)[0])
            return
        raise RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            "no live workers: need a prefill and a decode worker, or a colocated worker",
        )

    async def _invoke(
        self, run: Run, worker: WorkerRecord, what: str, method: Any, request: Any
    ) -> Any:
        """A unary worker call under the run's deadline and request span (raw gRPC errors; the
        tracing interceptor of the channel adds the CLIENT span and the `traceparent`)."""
        with run.calling(ref(worker)), run.traced():
            return await method(request, timeout=run.timeout())

    async def _call(
        self, run: Run, worker: WorkerRecord, what: str, method: Any, request: Any
    ) -> Any:
        try:
            return await self._invoke(run, worker, what, method, request)
        except grpc.aio.AioRpcError as error:
            raise map_error(error, worker, what) from None

    def _prefill_stub(self, worker: WorkerRecord) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self._cluster.channels.get(worker.address))

    def _decode_stub(self, worker: WorkerRecord) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self._cluster.channels.get(worker.address))

    async def _prepare(self, run: Run, worker: WorkerRecord) -> worker_pb2.EngineRequest:
        stub = self._prefill_stub(worker)
        prepare = worker_pb2.PrepareRequest(request=client_request(run))
        response = await self._call(run, worker, "prepare", stub.Prepare, prepare)
        engine: worker_pb2.EngineRequest = response.request
        run.timings.prompt_tokens = len(engine.prompt_ids)
        return engine

    def _open(self, run: Run) -> int:
        run.generation = self._cluster.ledger.open(run.request_id, run.deadline).generation
        return run.generation

    async def _disaggregated(
        self, run: Run, prefills: list[WorkerRecord], decodes: list[WorkerRecord]
    ) -> None:
        routing = self._cluster.config.routing
        engine = engine_request(run)  # None: a text or chat prompt, prepared by Reserve
        ids = [] if engine is None else engine.prompt_ids
        salt = run.request.cache_salt
        pairs = order_pairs(prefills, decodes, ids, run.max_tokens(), salt, routing)
        pairs.sort(key=lambda pair: sum(w.worker_id in run.avoid for w in pair))
        generation = self._open(run)
        decode, reservation = await self._reserve(run, engine, generation, pairs)
        if reservation.HasField("request"):
            engine = reservation.request
        assert engine is not None
        run.timings.prompt_tokens = len(engine.prompt_ids)
        if not ids:  # now the token ids are known: route the prefill by prefix affinity
            pairs = order_pairs(prefills, [decode], engine.prompt_ids, 1, salt, routing)
            pairs.sort(key=lambda pair: pair[0].worker_id in run.avoid)
        prefill = next(p for p, d in pairs if d is decode)
        run.event("routed", prefill=prefill.worker_id, decode=decode.worker_id)
        run.timings.queue = self._cluster.clock() - run.arrival
        request = worker_pb2.DecodeRequest(
            request_id=run.request_id,
            epoch=reservation.epoch,
            generation=generation,
            transfer_id=reservation.transfer_id,
        )
        with self._streaming(
            run, decode, "decode", self._decode_stub(decode).Decode, request
        ) as call:
            first = asyncio.ensure_future(call.read())  # read as it arrives, relayed after
            first.add_done_callback(_retrieve)
            try:
                await self._prefill(run, engine, generation, prefill, decode, reservation)
            except BaseException:
                first.cancel()
                raise
            self._cluster.ledger.decoding(run.request_id, generation)
            await self._relay(run, decode, "decode", call, first)

    async def _reserve(
        self,
        run: Run,
        engine: worker_pb2.EngineRequest | None,
        generation: int,
        pairs: list[tuple[WorkerRecord, WorkerRecord]],
    ) -> tuple[WorkerRecord, worker_pb2.ReserveResponse]:
        ledger, config = self._cluster.ledger, self._cluster.config
        exhausted, refused = False, []
        for decode in dict.fromkeys(d for _, d in pairs):
            ledger.expect(run.request_id, generation, ref(decode))
            lease = min(config.reservation_lease_seconds, run.timeout())
            request = worker_pb2.ReserveRequest(generation=generation, lease_seconds=lease)
            if engine is None:
                request.prompt.CopyFrom(client_request(run))
            else:
                request.request.CopyFrom(engine)
            try:
                stub = self._decode_stub(decode)
                response = await self._invoke(run, decode, "reserve", stub.Reserve, request)
            except grpc.aio.AioRpcError as error:
                if error.code() not in DECODE_SKIP_CODES:
                    raise map_error(error, decode, "reserve") from None
                exhausted |= error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused.append(f"{decode.worker_id}: {error.details()}")
                self._releases.send([ledger.refused(run.request_id, generation, ref(decode))])
                continue
            if response.epoch != decode.epoch:
                refused.append(f"{decode.worker_id}: epoch {response.epoch} is not registered")
                self._releases.send([ledger.refused(run.request_id, generation, ref(decode))])
                continue
            ledger.reserved(run.request_id, generation, ref(decode), len(response.block_ids))
            return decode, response
        if exhausted:
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "no decode worker has free KV blocks for the request: " + "; ".join(refused),
                config.retry_after_ms,
            )
        raise RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            "no decode worker accepted the reservation: " + "; ".join(refused),
        )

    async def _prefill(
        self,
        run: Run,
        engine: worker_pb2.EngineRequest,
        generation: int,
        prefill: WorkerRecord,
        decode: WorkerRecord,
        reservation: worker_pb2.ReserveResponse,
    ) -> None:
        backend = common_backend(prefill, decode, self._cluster.config.transfer_backends) or ""
        target = worker_pb2.KVTarget(
            worker_id=decode.worker_id,
            epoch=reservation.epoch,
            generation=generation,
            backend=backend,
            endpoint=decode.info.transfer_endpoints.get(backend, ""),
            block_ids=reservation.block_ids,
            transfer_id=reservation.transfer_id,
            layout=reservation.layout,
        )
        self._cluster.ledger.prefilling(run.request_id, generation, ref(prefill))
        request = worker_pb2.PrefillRequest(request=engine, target=target)
        stub = self._prefill_stub(prefill)
        response = await self._call(run, prefill, "prefill", stub.Prefill, request)
        self._cluster.ledger.transferred(run.request_id, generation, ref(prefill))
        timings = run.timings
        timings.queue += response.queue_seconds
        timings.prefill = response.prefill_seconds
        timings.transfer = response.transfer_seconds
        timings.cached_tokens = response.cached_tokens

    async def _colocated(self, run: Run, worker: WorkerRecord) -> None:
        run.event("routed", colocated=worker.worker_id)
        engine = await self._prepare(run, worker)
        generation = self._open(run)
        self._cluster.ledger.decoding(run.request_id, generation, ref(worker))
        run.timings.queue = self._cluster.clock() - run.arrival
        stub = worker_pb2_grpc.ColocatedServiceStub(self._cluster.channels.get(worker.address))
        with self._streaming(run, worker, "generate", stub.Generate, engine) as call:
            await self._relay(run, worker, "generate", call, colocated=True)

    @contextlib.contextmanager
    def _streaming(
        self, run: Run, worker: WorkerRecord, what: str, method: Any, request: Any
    ) -> Iterator[Any]:
        """A worker's response stream, opened now (under the run's deadline and trace context,
        counted as a call in flight) and cancelled when the block ends."""
        with run.calling(ref(worker)), run.traced():
            call = method(request, timeout=run.timeout())
            try:
                yield call
            finally:
                call.cancel()

    async def _relay(
        self,
        run: Run,
        worker: WorkerRecord,
        what: str,
        call: Any,
        first: asyncio.Future[Any] | None = None,
        *,
        colocated: bool = False,
    ) -> None:
        """Relay a worker's token stream into the run's queue until every completion ended;
        `first` is the stream's first read, when it was started earlier."""
        try:
            response = await (call.read() if first is None else first)
            while response is not grpc.aio.EOF:  # type: ignore[attr-defined]
                if colocated and run.timings.ttft is None:
                    run.timings.queue += response.queue_seconds
                    run.timings.prefill = response.prefill_seconds
                run.streamed |= bool(response.token_ids)
                run.queue.put_nowait(run.response(response))
                response = await call.read()
        except grpc.aio.AioRpcError as error:
            raise map_error(error, worker, what) from None
        if run.worker_aborted:
            raise RpcFailure(
                grpc.StatusCode.ABORTED,
                f"{worker.role} worker {worker.worker_id!r} aborted the request (released there)",
            )
        missing = set(range(run.expected_completions())) - run.finished_indexes
        if missing:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE,
                f"{worker.role} worker {worker.worker_id!r} ended the stream before completion "
                f"{min(missing)} finished",
            )


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a read's failure retrieved (the relay, or the failure that stopped it, reports)."""
    if not future.cancelled():
        future.exception()


def client_request(run: Run) -> generation_pb2.GenerateRequest:
    """The client's request, named by the run's request id."""
    request = type(run.request)()
    request.CopyFrom(run.request)
    request.request_id = run.request_id
    return request


def engine_request(run: Run) -> worker_pb2.EngineRequest | None:
    """The request as workers take it when the client sent token ids (the workers validate
    it); None for a text or chat prompt, which a worker must tokenize."""
    message = run.request
    if message.WhichOneof("prompt") != "token_ids":
        return None
    return worker_pb2.EngineRequest(
        request_id=run.request_id,
        prompt_ids=message.token_ids.ids,
        sampling=message.sampling,
        cache_salt=message.cache_salt,
    )
