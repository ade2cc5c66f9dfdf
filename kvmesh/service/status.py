"""Exceptions → precise gRPC status codes, once, at the edge of a worker's calls.

The mapping itself is `kvmesh.v1.status` (shared with the control plane): InvalidParameterError
(field named) → INVALID_ARGUMENT, CapacityError → RESOURCE_EXHAUSTED (with a retry delay),
EngineDeadError → UNAVAILABLE, kv_transfer errors by `.code`, TimeoutError →
DEADLINE_EXCEEDED, anything else INTERNAL (logged).
"""

from __future__ import annotations

import logging

import grpc

from kvmesh.v1.status import Failure, failure_of

LOG = logging.getLogger("kvmesh.service")
CAPACITY_RETRY_MS = 200  # retry delay suggested with a worker's RESOURCE_EXHAUSTED


class ServiceError(Failure):
    """A failure with a chosen status code; the message names the field or fact."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)


def worker_failure(error: BaseException) -> Failure:
    """The status a worker answers `error` with."""
    return failure_of(
        error, exhausted_retry_ms=CAPACITY_RETRY_MS, internal="internal error in the worker"
    )


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and message for an exception raised while serving a call."""
    failure = worker_failure(error)
    return failure.code, failure.message


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the status for `error`, with its BadRequest / RetryInfo detail
    (raises, as context.abort does)."""
    failure = worker_failure(error)
    if failure.code == grpc.StatusCode.INTERNAL:
        LOG.error("a call failed: %s", failure.message, exc_info=error)
    await failure.abort(context)
