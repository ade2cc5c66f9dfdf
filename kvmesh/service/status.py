"""Exceptions → precise gRPC status codes, once, at the edge.

| exception                                   | code                |
|---------------------------------------------|---------------------|
| InvalidParameterError (field named)         | INVALID_ARGUMENT    |
| CapacityError, ServiceError(RESOURCE_...)   | RESOURCE_EXHAUSTED  |
| kv_transfer errors (by their TransferCode)   | see TRANSFER_CODES  |
| EngineDeadError (the engine thread stopped) | UNAVAILABLE         |
| TimeoutError (an engine wait ran out)       | DEADLINE_EXCEEDED   |
| anything else                               | INTERNAL (logged)   |

INVALID_ARGUMENT carries a `google.rpc.BadRequest` detail naming the field (sampling fields as
`sampling.<name>`), RESOURCE_EXHAUSTED a `RetryInfo` and the retry trailers (see kvmesh.v1.wire).
"""

from __future__ import annotations

import logging
import re

import grpc

from kvmesh.engine.async_engine import EngineDeadError
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.memory.errors import CapacityError
from kvmesh.v1 import generation_pb2, wire
from kvmesh.v1.transfer import TransferCode

LOG = logging.getLogger("kvmesh.service")
SAMPLING_FIELDS = frozenset(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
CAPACITY_RETRY_MS = 200  # retry delay suggested with a worker's RESOURCE_EXHAUSTED
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")

# kv_transfer.errors.TransferError.code -> status (kvmesh never imports kv_transfer)
TRANSFER_CODES = {
    TransferCode.TRANSFER_ERROR: grpc.StatusCode.ABORTED,
    TransferCode.LAYOUT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    TransferCode.STALE_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    TransferCode.UNKNOWN_TRANSFER: grpc.StatusCode.FAILED_PRECONDITION,
    TransferCode.BAD_STATE: grpc.StatusCode.FAILED_PRECONDITION,
    TransferCode.ILLEGAL_TRANSITION: grpc.StatusCode.INTERNAL,
    TransferCode.BAD_FRAME: grpc.StatusCode.INVALID_ARGUMENT,
    TransferCode.CHECKSUM: grpc.StatusCode.DATA_LOSS,
    TransferCode.CANCELLED: grpc.StatusCode.ABORTED,
    TransferCode.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferCode.PEER: grpc.StatusCode.UNAVAILABLE,
    TransferCode.AUTH: grpc.StatusCode.PERMISSION_DENIED,
    TransferCode.UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
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
    if isinstance(transfer_code, TransferCode):
        return TRANSFER_CODES[transfer_code], f"kv transfer: {error}"
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error in the worker: {error}"


def field_of(error: BaseException, code: grpc.StatusCode, message: str) -> str | None:
    """The request field an INVALID_ARGUMENT names (None for other codes)."""
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    if isinstance(error, InvalidParameterError):
        name = error.field
    else:
        match = _LEADING_FIELD.match(message)
        if match is None:
            return None
        name = match.group(1)
    return f"sampling.{name}" if name in SAMPLING_FIELDS else name


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status for `error`, with its BadRequest / RetryInfo detail
    (raises, as context.abort does)."""
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        LOG.error("a call failed: %s", message, exc_info=error)
    retry = CAPACITY_RETRY_MS if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    field = field_of(error, code, message)
    await wire.abort(context, wire.failure_status(code, message, field=field, retry_after_ms=retry))
