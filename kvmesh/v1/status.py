"""Failures and their gRPC status: the one mapping, for the workers and the control plane.

| raised                                                | status                          |
|-------------------------------------------------------|---------------------------------|
| `Failure(code, message, field=, retry_after_ms=)`     | its own                         |
| an exception whose class names `status_name`          | that code (InvalidParameterError|
|   (`field` attribute: the request field at fault)     | INVALID_ARGUMENT, CapacityError |
|                                                       | RESOURCE_EXHAUSTED, ...)        |
| a kv_transfer error (matched by `.code`)              | see TRANSFER_CODES              |
| TimeoutError (a wait ran out)                         | DEADLINE_EXCEEDED               |
| anything else                                         | INTERNAL                        |

A failed call to another kvmesh server keeps its code, its field and its retry delay
(`from_call`); UNAVAILABLE and CANCELLED (`LOST_CODES`) mean the server is gone or went away.
INVALID_ARGUMENT travels with a `google.rpc.BadRequest` naming the field (sampling fields as
`sampling.<name>`), a retry delay with a `RetryInfo` and the retry trailers (see
`kvmesh.v1.wire`).
"""

from __future__ import annotations

import re

import grpc

from kvmesh.v1 import generation_pb2, wire
from kvmesh.v1.transfer import TransferCode

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
SAMPLING_FIELDS = frozenset(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")

# kv_transfer error `.code` (a TransferCode) -> status: callers need not import kv_transfer
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


class Failure(Exception):
    """A call ends with this status; the message names the field or the fact. `field` is the
    request field at fault (sent as a BadRequest detail), `retry_after_ms` the delay a client
    should wait before retrying (sent as RetryInfo and trailers)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_ms: int | None = None,
        *,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.field = field

    def status(self) -> grpc.Status:
        return wire.failure_status(
            self.code, self.message, field=self.field, retry_after_ms=self.retry_after_ms
        )

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """End the call with this status (raises, as `context.abort` does)."""
        await wire.abort(context, self.status())


def failure_of(
    error: BaseException,
    *,
    exhausted_retry_ms: int | None = None,
    internal: str = "internal error",
) -> Failure:
    """The Failure an exception raised while serving a call stands for (see the table);
    `exhausted_retry_ms` is the retry delay given with a RESOURCE_EXHAUSTED that names none,
    `internal` what an INTERNAL's message starts with."""
    failure = _classify(error, internal)
    if failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.field is None:
        failure.field = _leading_field(failure.message)
    if failure.field is not None and failure.field in SAMPLING_FIELDS:
        failure.field = f"sampling.{failure.field}"
    if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and failure.retry_after_ms is None:
        failure.retry_after_ms = exhausted_retry_ms
    return failure


def _classify(error: BaseException, internal: str) -> Failure:
    if isinstance(error, Failure):
        return error
    name = getattr(error, "status_name", None)
    if isinstance(name, str) and name in grpc.StatusCode.__members__:
        field = getattr(error, "field", None)
        return Failure(grpc.StatusCode[name], str(error), field=field if field else None)
    transfer_code = getattr(error, "code", None)
    if isinstance(transfer_code, TransferCode):
        return Failure(TRANSFER_CODES[transfer_code], f"kv transfer: {error}")
    if isinstance(error, TimeoutError):
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
    return Failure(grpc.StatusCode.INTERNAL, f"{internal}: {error}")


def _leading_field(message: str) -> str | None:
    match = _LEADING_FIELD.match(message)
    return None if match is None else match.group(1)


def from_call(error: grpc.aio.AioRpcError, where: str) -> Failure:
    """A failed call to another server as the caller fails in turn: same code, the field and
    the retry delay kept, the message prefixed with `where` (INVALID_ARGUMENT keeps the
    server's message as it is: it names the client's field)."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Failure(code, details, field=wire.field_of(error))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Failure(code, f"{where}: {details}", wire.retry_delay_ms(error))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Failure(code, f"{where} exceeded the request deadline")
    if code in LOST_CODES:
        return Failure(code, f"{where} failed: {details}")
    return Failure(code, f"{where}: {details}")
