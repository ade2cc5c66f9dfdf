"""One attempt of a request through the workers, in the order of docs/PROTOCOL.md.

Disaggregated: route (prefix affinity on the prompt's token ids, or on a text or chat prompt's
leading characters) → ledger.open → PrefillAhead and Reserve at once (the prefill computes
while the decode worker reserves; both prepare a text or chat prompt themselves) → the
reservation named to the prefill worker as PrefillAhead's second message, and the Decode stream
opened (it waits for the KV, whose final frame carries the first token).
Colocated: ledger.open → ColocatedService.Generate stream (the worker prepares the prompt).
Responses go to the run's queue; failures raise RpcFailure (final) or WorkerLost (the caller
may retry).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from control_plane.cluster import Cluster
from control_plane.ledger import WorkerRef
from control_plane.registry import WorkerRecord
from control_plane.releases import BackgroundReleases
from control_plane.routing import NoRouteError, common_backend, order_colocated, order_pairs
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
            await self._colocated(run, self._route_colocated(run, colocated))
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

    def _prefill_stub(self, worker: WorkerRecord) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self._cluster.channels.get(worker.address))

    def _decode_stub(self, worker: WorkerRecord) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self._cluster.channels.get(worker.address))

    def _open(self, run: Run) -> int:
        run.generation = self._cluster.ledger.open(run.request_id, run.deadline).generation
        return run.generation

    async def _disaggregated(
        self, run: Run, prefills: list[WorkerRecord], decodes: list[WorkerRecord]
    ) -> None:
        engine = engine_request(run)  # None: a text or chat prompt, prepared by both workers
        prefill, candidates = self._route(run, engine, prefills, decodes)
        generation = self._open(run)
        self._cluster.ledger.expect(run.request_id, generation, ref(prefill))
        run.timings.queue = self._cluster.clock() - run.arrival
        method = self._prefill_stub(prefill).PrefillAhead
        messages: asyncio.Queue[worker_pb2.PrefillRequest | None] = asyncio.Queue()
        start = worker_pb2.PrefillRequest(generation=generation, **prompt_fields(run, engine))
        messages.put_nowait(start)
        with contextlib.ExitStack() as decoding:
            decoding.callback(messages.put_nowait, None)  # the request stream ends, always
            with self._streaming(run, prefill, "prefill", method, drain(messages)) as ahead:
                decode, reservation = await self._reserve(run, engine, generation, candidates)
                engine = reservation.request if reservation.HasField("request") else engine
                assert engine is not None
                run.timings.prompt_tokens = len(engine.prompt_ids)
                run.event("routed", prefill=prefill.worker_id, decode=decode.worker_id)
                self._grant(run, generation, prefill, decode, reservation, messages)
                stub = self._decode_stub(decode)
                request = decode_request(run, generation, reservation)
                call = decoding.enter_context(
                    self._streaming(run, decode, "decode", stub.Decode, request)
                )
                first = asyncio.ensure_future(call.read())  # read as it arrives, relayed after
                first.add_done_callback(_retrieve)
                try:
                    await self._prefilled(run, generation, prefill, ahead)
                except BaseException:
                    first.cancel()
                    raise
            # The prefill worker's part is done: its loss no longer concerns this request.
            self._cluster.ledger.decoding(run.request_id, generation)
            await self._relay(run, decode, "decode", call, first)

    def _route(
        self,
        run: Run,
        engine: worker_pb2.EngineRequest | None,
        prefills: list[WorkerRecord],
        decodes: list[WorkerRecord],
    ) -> tuple[WorkerRecord, list[WorkerRecord]]:
        """The prefill worker (prefix affinity, before any worker call) and the decode
        workers to try in order, avoiding those this request already lost."""
        pairs = order_pairs(
            prefills,
            decodes,
            [] if engine is None else engine.prompt_ids,
            run.max_tokens(),
            run.request.cache_salt,
            self._cluster.config.routing,
            text=prompt_text(run.request),
        )
        pairs.sort(key=lambda pair: sum(w.worker_id in run.avoid for w in pair))
        prefill = pairs[0][0]
        return prefill, [d for p, d in pairs if p is prefill]

    def _route_colocated(self, run: Run, workers: list[WorkerRecord]) -> WorkerRecord:
        """The colocated worker: prefix affinity unless overloaded, then by load, avoiding
        those this request already lost."""
        engine = engine_request(run)
        ordered = order_colocated(
            workers,
            [] if engine is None else engine.prompt_ids,
            run.request.cache_salt,
            self._cluster.config.routing,
            text=prompt_text(run.request),
        )
        return avoid_last(ordered, run.avoid)[0]

    async def _reserve(
        self,
        run: Run,
        engine: worker_pb2.EngineRequest | None,
        generation: int,
        decodes: list[WorkerRecord],
    ) -> tuple[WorkerRecord, worker_pb2.ReserveResponse]:
        """The first of the candidates, in order, that reserves the request's blocks. One no
        longer registered (its lease lapsed, or it was replaced, while an earlier one answered)
        is skipped as refused: its loss was announced before the run called it, so nothing
        would end a run that went on with it, nor release what it reserved."""
        ledger, config = self._cluster.ledger, self._cluster.config
        exhausted, refused = False, []
        for decode in dict.fromkeys(decodes):
            if not self._cluster.registry.is_current(decode.worker_id, decode.epoch):
                refused.append(f"{decode.worker_id}: no longer registered")
                continue
            ledger.expect(run.request_id, generation, ref(decode))
            lease = min(config.reservation_lease_seconds, run.timeout())
            request = worker_pb2.ReserveRequest(
                generation=generation, lease_seconds=lease, **prompt_fields(run, engine)
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

    def _grant(
        self,
        run: Run,
        generation: int,
        prefill: WorkerRecord,
        decode: WorkerRecord,
        reservation: worker_pb2.ReserveResponse,
        messages: asyncio.Queue[worker_pb2.PrefillRequest | None],
    ) -> None:
        """Name the reservation to the prefill worker, which may now write into it."""
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
        messages.put_nowait(worker_pb2.PrefillRequest(target=target))
        messages.put_nowait(None)

    async def _prefilled(
        self, run: Run, generation: int, prefill: WorkerRecord, ahead: Any
    ) -> None:
        """Wait for PrefillAhead's answer: the KV landed on the decode side."""
        try:
            response = await ahead
        except grpc.aio.AioRpcError as error:
            raise map_error(error, prefill, "prefill") from None
        self._cluster.ledger.transferred(run.request_id, generation, ref(prefill))
        timings = run.timings
        timings.queue += response.queue_seconds
        timings.prefill = response.prefill_seconds
        timings.transfer = response.transfer_seconds
        timings.cached_tokens = response.cached_tokens
        run.prompt_logprobs = list(response.prompt_logprobs)
        run.prompt_text = response.prompt_text

    async def _colocated(self, run: Run, worker: WorkerRecord) -> None:
        run.event("routed", colocated=worker.worker_id)
        request = worker_pb2.ColocatedRequest(**prompt_fields(run, engine_request(run)))
        generation = self._open(run)
        self._cluster.ledger.decoding(run.request_id, generation, ref(worker))
        run.timings.queue = self._cluster.clock() - run.arrival
        stub = worker_pb2_grpc.ColocatedServiceStub(self._cluster.channels.get(worker.address))
        with self._streaming(run, worker, "generate", stub.Generate, request) as call:
            await self._relay(run, worker, "generate", call, colocated=True)

    @contextlib.contextmanager
    def _streaming(
        self, run: Run, worker: WorkerRecord, what: str, method: Any, request: Any
    ) -> Iterator[Any]:
        """A worker call with a stream (of responses, or of requests: `request` an async
        iterator), opened now (under the run's deadline and trace context, counted as a call
        in flight) and cancelled when the block ends."""
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
        `first` is the stream's first read, when it was started earlier. While the queue is
        full the worker's stream is not read (flow control holds the worker back)."""
        try:
            response = await (call.read() if first is None else first)
            while response is not grpc.aio.EOF:  # type: ignore[attr-defined]
                if colocated and run.timings.ttft is None:
                    run.timings.queue += response.queue_seconds
                    run.timings.prefill = response.prefill_seconds
                    run.timings.prompt_tokens = response.prompt_tokens
                run.streamed = True  # it reaches the client: a retry would send it again
                await run.push(run.response(response))  # waits while the client is behind
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


async def drain(
    queue: asyncio.Queue[worker_pb2.PrefillRequest | None],
) -> AsyncIterator[worker_pb2.PrefillRequest]:
    """A request stream fed through `queue`, ended by None."""
    while (message := await queue.get()) is not None:
        yield message


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


def decode_request(
    run: Run, generation: int, reservation: worker_pb2.ReserveResponse
) -> worker_pb2.DecodeRequest:
    """The Decode call for a reservation (fenced by its epoch, generation and transfer id)."""
    return worker_pb2.DecodeRequest(
        request_id=run.request_id,
        epoch=reservation.epoch,
        generation=generation,
        transfer_id=reservation.transfer_id,
    )


def prompt_fields(run: Run, engine: worker_pb2.EngineRequest | None) -> dict[str, Any]:
    """The prompt fields of a worker call that prepares what it is not given: `request` (the
    prepared request) or `prompt` (the client's, for a text or chat prompt)."""
    return {"prompt": client_request(run)} if engine is None else {"request": engine}


def prompt_text(request: generation_pb2.GenerateRequest) -> list[str]:
    """A text or chat prompt's parts for routing (the text; each message's role and content);
    empty for token ids."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return [request.text]
    if which == "chat":
        return [part for m in request.chat.messages for part in (m.role, m.content)]
    return []


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
