"""GenerationService (gRPC): a thin adapter over the FrontDoor's request path."""

from __future__ import annotations

from collections.abc import AsyncIterator
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


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, door: FrontDoor) -> None:
        self._door = door

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            async for response in self._door.generate(request, context.time_remaining()):
                yield response
        except RpcFailure as failure:
            await abort_with(context, failure)

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        try:
            return generation_pb2.AbortResponse(aborted=await self._door.abort(request.request_id))
        except RpcFailure as failure:
            await abort_with(context, failure)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        try:
            return self._door.model_info()
        except RpcFailure as failure:
            await abort_with(context, failure)
