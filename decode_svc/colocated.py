"""Colocated role: one engine does prefill and decode (small deployments; the baseline).

Serves ColocatedService.Generate, which takes the client's request and prepares it here (or a
prepared one), plus PrefillService.Prepare / Release (the control plane releases through the
same call it uses for prefill workers).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc

from kvmesh.service.server import WorkerServer
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.telemetry.metrics import WorkerMetrics
from kvmesh.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:  # the engine loads with the runtime, not with `kvmesh serve colocated --help`
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.service.runtime import WorkerRuntime

COLOCATED_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["ColocatedService"].full_name
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
# The calls a draining colocated worker refuses (UNAVAILABLE "draining").
NEW_WORK = {
    COLOCATED_SERVICE: ("Generate",),
    PREFILL_SERVICE: ("Prepare", "Prefill", "PrefillAhead"),
}


class ColocatedServicer(worker_pb2_grpc.ColocatedServiceServicer):
    def __init__(self, runtime: WorkerRuntime, metrics: WorkerMetrics) -> None:
        self.runtime = runtime
        self.metrics = metrics

    async def Generate(
        self, request: worker_pb2.ColocatedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        from kvmesh.engine import disagg
        from kvmesh.service.streaming import responses

        arrival = time.monotonic()
        try:
            prepared = request.request
            if request.HasField("prompt"):
                prepared = await self.runtime.prepare_request(request.prompt)
            engine_request = self.runtime.request_from(prepared, prefill_only=False)
            added = [arrival]

            def add(engine: LLMEngine) -> None:
                disagg.add_request(engine, engine_request)
                added[0] = time.monotonic()  # on the engine thread: the prefill starts now

            stream = await self.runtime.engine.open_stream(engine_request.request_id, add)
        except Exception as exc:
            self.metrics.request_done(status_of(exc)[0])
            await abort_with(context, exc)
            return
        code = grpc.StatusCode.CANCELLED  # unless the stream finishes or fails
        try:
            first = await anext(stream)
            # when the engine sampled the first token: what follows is "first decode"
            sampled = first.metrics.first_token_time or time.monotonic()
            outputs = responses(
                stream,
                sampled,
                first,
                queue_seconds=added[0] - arrival,
                prefill_seconds=sampled - added[0],
                tokenizer=self.runtime.core.tokenizer,
            )
            prompt_tokens = len(engine_request.seqs[0].prompt_ids)
            async for response in outputs:
                response.prompt_tokens, prompt_tokens = prompt_tokens, 0
                yield response
            if stream.finished:
                code = grpc.StatusCode.OK
        except Exception as exc:
            code = status_of(exc)[0]
            await abort_with(context, exc)
        finally:
            stream.close()  # aborts the request unless it finished
            self.metrics.request_done(code)


class ColocatedPrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    """Prepare and Release for a colocated worker; Prefill needs a prefill worker."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    async def Prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        return await self.runtime.serve_prepare(request, context)

    async def Detokenize(
        self, request: worker_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DetokenizeResponse:
        return await self.runtime.serve_detokenize(request, context)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        error = ServiceError(grpc.StatusCode.UNIMPLEMENTED, "a colocated worker does not ship KV")
        await abort_with(context, error)
        raise error

    async def PrefillAhead(
        self,
        request_iterator: AsyncIterator[worker_pb2.PrefillRequest],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        error = ServiceError(grpc.StatusCode.UNIMPLEMENTED, "a colocated worker does not ship KV")
        await abort_with(context, error)
        raise error

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        released = await self.runtime.engine.abort(request.request_id)
        return worker_pb2.ReleaseResponse(released=released)


class ColocatedRole:
    """RoleServices of a colocated worker: no transfer endpoints, nothing held across calls."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.transfer_endpoints: dict[str, str] = {}

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        return []

    async def release(self, request_id: str, reason: str, generation: int = 0) -> bool:
        return await self.runtime.engine.abort(request_id)  # holds no generations

    async def close(self) -> None:
        return None


async def install(
    runtime: WorkerRuntime, server: WorkerServer, args: object, metrics: WorkerMetrics | None
) -> ColocatedRole:
    """Add the colocated worker's services to `server`."""
    server.add(
        worker_pb2_grpc.add_ColocatedServiceServicer_to_server,
        ColocatedServicer(runtime, metrics or WorkerMetrics("colocated")),
        COLOCATED_SERVICE,
        NEW_WORK[COLOCATED_SERVICE],
    )
    server.add(
        worker_pb2_grpc.add_PrefillServiceServicer_to_server,
        ColocatedPrefillServicer(runtime),
        PREFILL_SERVICE,
        NEW_WORK[PREFILL_SERVICE],
    )
    return ColocatedRole(runtime)


def run(argv: Sequence[str] | None = None) -> int:
    """`kvmesh serve colocated ...`"""
    from kvmesh.service.process import serve_role

    return serve_role("colocated", argv, install)
