"""One attempt of a request through the workers, in the order of docs/PROTOCOL.md.

Disaggregated: Prepare (prefill) → ledger.open → Reserve (decode) → Prefill → Decode stream.
Colocated: Prepare → ledger.open → ColocatedService.Generate stream. Responses go to the
run's queue; failures raise RpcFailure (final) or WorkerLost (the caller may retry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from control_plane.cluster import Cluster
from control_plane.ledger import WorkerRef
from control_plane.registry import WorkerRecord
from control_plane.releases import BackgroundReleases
from control_plane.routing import NoRouteError, common_backend, order_pairs
from control_plane.run import DEFAULT_MAX_TOKENS, RpcFailure, Run, WorkerLost
from kvmesh.v1 import wire, worker_pb2, worker_pb2_grpc

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
    code, details = error.code(), error.details() or ""
    where = f"{what} on {worker.role} worker {worker.worker_id!r}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerLost(worker.worker_id, f"{where} failed: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RpcFailure(code, details, field=wire.field_of(error))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RpcFailure(code, f"{where}: {details}", wire.retry_delay_ms(error))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RpcFailure(code, f"{where} exceeded the request deadline")
    return RpcFailure(code, f"{where}: {details}")


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
        request = type(run.request)()
        request.CopyFrom(run.request)
        request.request_id = run.request_id
        stub = self._prefill_stub(worker)
        prepare = worker_pb2.PrepareRequest(request=request)
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
        config = self._cluster.config
        compatible = [p for p in prefills if any(p.layout == d.layout for d in decodes)]
        if not compatible:
            order_pairs(prefills, decodes, [], 1, b"", config.routing)  # raises the precise error
        by_load = sorted(compatible, key=lambda w: (w.load.queue, w.worker_id))
        engine = await self._prepare(run, avoid_last(by_load, run.avoid)[0])
        sampling = engine.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        pairs = order_pairs(
            prefills, decodes, engine.prompt_ids, max_tokens, engine.cache_salt, config.routing
        )
        pairs.sort(key=lambda pair: sum(w.worker_id in run.avoid for w in pair))
        generation = self._open(run)
        decode, reservation = await self._reserve(run, engine, generation, pairs)
        prefill = next(p for p, d in pairs if d is decode)
        run.event("routed", prefill=prefill.worker_id, decode=decode.worker_id)
        run.timings.queue = self._cluster.clock() - run.arrival
        first = await self._prefill(run, engine, generation, prefill, decode, reservation)
        await self._decode(run, generation, decode, reservation, first)

    async def _reserve(
        self,
        run: Run,
        engine: worker_pb2.EngineRequest,
        generation: int,
        pairs: list[tuple[WorkerRecord, WorkerRecord]],
    ) -> tuple[WorkerRecord, worker_pb2.ReserveResponse]:
        ledger, config = self._cluster.ledger, self._cluster.config
        exhausted, refused = False, []
        for decode in dict.fromkeys(d for _, d in pairs):
            ledger.expect(run.request_id, generation, ref(decode))
            lease = min(config.reservation_lease_seconds, run.timeout())
            request = worker_pb2.ReserveRequest(
                request=engine, generation=generation, lease_seconds=lease
            )
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
    ) -> list[worker_pb2.FirstToken]:
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
        return list(response.first_tokens)

    async def _decode(
        self,
        run: Run,
        generation: int,
        decode: WorkerRecord,
        reservation: worker_pb2.ReserveResponse,
        first_tokens: list[worker_pb2.FirstToken],
    ) -> None:
        self._cluster.ledger.decoding(run.request_id, generation)
        request = worker_pb2.DecodeRequest(
            request_id=run.request_id,
            epoch=reservation.epoch,
            generation=generation,
            transfer_id=reservation.transfer_id,
            first_tokens=first_tokens,
        )
        await self._stream(run, decode, "decode", self._decode_stub(decode).Decode, request)

    async def _colocated(self, run: Run, worker: WorkerRecord) -> None:
        run.event("routed", colocated=worker.worker_id)
        engine = await self._prepare(run, worker)
        generation = self._open(run)
        self._cluster.ledger.decoding(run.request_id, generation, ref(worker))
        run.timings.queue = self._cluster.clock() - run.arrival
        stub = worker_pb2_grpc.ColocatedServiceStub(self._cluster.channels.get(worker.address))
        await self._stream(run, worker, "generate", stub.Generate, engine, colocated=True)

    async def _stream(
        self,
        run: Run,
        worker: WorkerRecord,
        what: str,
        method: Any,
        request: Any,
        *,
        colocated: bool = False,
    ) -> None:
        """Relay a worker's token stream into the run's queue until every completion ended."""
        with run.calling(ref(worker)), run.traced():
            call = method(request, timeout=run.timeout())
            try:
                async for response in call:
                    if colocated and run.timings.ttft is None:
                        run.timings.queue += response.queue_seconds
                        run.timings.prefill = response.prefill_seconds
                    run.streamed |= bool(response.token_ids)
                    run.queue.put_nowait(run.response(response))
            except grpc.aio.AioRpcError as error:
                raise map_error(error, worker, what) from None
            finally:
                call.cancel()
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
