"""GenerationService (gRPC): a thin adapter over the FrontDoor's request path."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc

from control_plane.front_door import FrontDoor
from control_plane.run import RpcFailure
from kvmesh.v1 import generation_pb2, generation_pb2_grpc


async def abort_with(context: grpc.aio.ServicerContext, failure: RpcFailure) -> NoReturn:
    """End the call with the failure's status: a BadRequest detail naming its field, and with
    a retry delay a RetryInfo detail plus the `grpc-retry-pushback-ms` and `retry-after-ms`
    trailers."""
    await failure.abort(context)
    raise AssertionError("unreachable")


def writer(
    context: grpc.aio.ServicerContext,
) -> Callable[[generation_pb2.GenerateResponse], Awaitable[None]]:
    """`context.write`, the response headers sent on their own before the first response: a
    write cut short (a client that is not reading) then leaves no headers pending, and the call
    can still end with its status."""
    headers_sent = False

    async def write(response: generation_pb2.GenerateResponse) -> None:
        nonlocal headers_sent
        if not headers_sent:
            await context.send_initial_metadata(())
            headers_sent = True
        await context.write(response)

    return write


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, door: FrontDoor) -> None:
        self._door = door

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Serve one request, its responses written with `context.write` inside the front
        door's bounds: a client that stops reading cannot hold the run past its deadline, and
        a client cancel lands in the request path, which finishes the run (its span complete)
        before the call ends. An async generator that yields nothing, as the tracing
        interceptor wraps streaming handlers as async generators."""
        owner = self._door.owner(context.invocation_metadata())
        try:
            await self._door.serve(request, writer(context), context.time_remaining(), owner)
        except RpcFailure as failure:
            await abort_with(context, failure)
        return
        yield  # an async generator: every response was written above

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        owner = self._door.owner(context.invocation_metadata())
        try:
            aborted = await self._door.abort(request.request_id, owner)
            return generation_pb2.AbortResponse(aborted=aborted)
        except RpcFailure as failure:
            await abort_with(context, failure)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        try:
            return self._door.model_info()
        except RpcFailure as failure:
            await abort_with(context, failure)
