"""Exceptions → precise gRPC status codes, once, at the edge.

| exception                                   | code                |
|---------------------------------------------|---------------------|
| InvalidParameterError (field named)         | INVALID_ARGUMENT    |
| CapacityError, ServiceError(RESOURCE_...)   | RESOURCE_EXHAUSTED  |
| kv_transfer errors (matched by `.code`)      | see TRANSFER_CODES  |
| EngineDeadError (the engine thread stopped) | UNAVAILABLE         |
| TimeoutError (an engine wait ran out)       | DEADLINE_EXCEEDED   |
| anything else                               | INTERNAL            |
"""

from __future__ import annotations

import grpc

from kvmesh.engine.async_engine import EngineDeadError
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.memory.errors import CapacityError

# kv_transfer.errors.TransferError.code -> status (matched by name: kvmesh never imports it)
TRANSFER_CODES = {
    "layout_mismatch": grpc.StatusCode.FAILED_PRECONDITION,
    "stale_epoch": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_transfer": grpc.StatusCode.FAILED_PRECONDITION,
    "bad_state": grpc.StatusCode.FAILED_PRECONDITION,
    "bad_frame": grpc.StatusCode.INVALID_ARGUMENT,
    "checksum": grpc.StatusCode.DATA_LOSS,
    "cancelled": grpc.StatusCode.ABORTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "peer": grpc.StatusCode.UNAVAILABLE,
    "auth": grpc.StatusCode.PERMISSION_DENIED,
    "unavailable": grpc.StatusCode.FAILED_PRECONDITION,
}


class ServiceError(Exception):
    """A failure with a chosen status code; the message names the field or fact."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and message for an exception raised while serving a call."""
    if isinstance(error, ServiceError):
        return error.code, error.message
    if isinstance(error, InvalidParameterError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    transfer_code = getattr(error, "code", None)
    if isinstance(transfer_code, str) and transfer_code in TRANSFER_CODES:
        return TRANSFER_CODES[transfer_code], f"kv transfer: {error}"
    if isinstance(transfer_code, str) and transfer_code == "transfer_error":
        return grpc.StatusCode.ABORTED, f"kv transfer: {error}"
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status for `error` (raises, as context.abort does)."""
    code, message = status_of(error)
    await context.abort(code, message)
