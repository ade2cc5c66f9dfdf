"""kvmesh.v1.wire's status helpers round-trip through a real failed call's trailers, and the
retry delay is read in the standard order (pushback trailer, RetryInfo, retry-after-ms)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmesh.client_retry import RetryPolicy
from kvmesh.v1 import wire

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def failed_call(status: grpc.Status, *extra: tuple[str, str]) -> grpc.aio.AioRpcError:
    """The error a client sees for `status` (its trailers as the server sent them)."""
    metadata = grpc.aio.Metadata(*status.trailing_metadata, *extra)
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), metadata, status.details)


def test_field_and_retry_delay_round_trip() -> None:
    bad = failed_call(wire.failure_status(grpc.StatusCode.INVALID_ARGUMENT, "n: x", field="n"))
    assert wire.field_of(bad) == "n" and wire.retry_delay_ms(bad) is None
    full = failed_call(wire.failure_status(EXHAUSTED, "full", retry_after_ms=120))
    assert wire.retry_delay_ms(full) == 120 and wire.field_of(full) is None


def test_retry_delay_sources_and_a_negative_pushback() -> None:
    info_only = wire.failure_status(EXHAUSTED, "full", retry_after_ms=300)
    details_only = grpc.aio.Metadata(
        *((k, v) for k, v in info_only.trailing_metadata if k == "grpc-status-details-bin")
    )
    error = grpc.aio.AioRpcError(EXHAUSTED, grpc.aio.Metadata(), details_only, "full")
    assert wire.retry_delay_ms(error) == 300  # from the RetryInfo detail alone
    legacy = grpc.aio.AioRpcError(
        EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(("retry-after-ms", "40")), "full"
    )
    assert wire.retry_delay_ms(legacy) == 40
    refused = grpc.aio.AioRpcError(
        EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(("grpc-retry-pushback-ms", "-1")), "no"
    )
    assert wire.retry_delay_ms(refused) is None  # "do not retry"
    assert wire.retry_pushback_ms(refused) == -1  # told apart from no delay at all
    assert RetryPolicy().start(5.0).delay(refused) is None
    gone = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
    )
    assert wire.retry_pushback_ms(gone) is None and RetryPolicy().start(5.0).delay(gone) == 0.1
    for_good = failed_call(wire.failure_status(grpc.StatusCode.UNAVAILABLE, "bye"),
                           ("grpc-retry-pushback-ms", "-1"))  # fmt: skip
    assert RetryPolicy().start(5.0).delay(for_good) is None  # whatever the code
    holder = any_pb2.Any()
    holder.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=-1)))
    proto = status_pb2.Status(code=EXHAUSTED.value[0], message="no", details=[holder])
    barely = failed_call(rpc_status.to_status(proto))
    assert wire.retry_pushback_ms(barely) == -1  # negative however short, never 0


def test_retries_stop_at_each_bound() -> None:
    full = failed_call(wire.failure_status(EXHAUSTED, "full", retry_after_ms=100))
    retries = RetryPolicy(max_retries=2).start(None)
    assert [retries.delay(full) for _ in range(3)] == [0.1, 0.1, None]
    assert RetryPolicy(max_wait_seconds=0.15).start(None).delay(full) == 0.1
    waits = RetryPolicy(max_retries=5, max_wait_seconds=0.15).start(None)
    assert [waits.delay(full), waits.delay(full)] == [0.1, None]
    assert RetryPolicy().start(0.05).delay(full) is None  # would pass the deadline
    bad = failed_call(wire.failure_status(grpc.StatusCode.INVALID_ARGUMENT, "x: y", field="x"))
    assert RetryPolicy().start(None).delay(bad) is None
    gone = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
    )
    backoff = RetryPolicy(unavailable_backoff_seconds=0.1).start(None)
    assert [backoff.delay(gone), backoff.delay(gone), backoff.delay(gone)] == [0.1, 0.2, None]
    draining = failed_call(
        wire.failure_status(grpc.StatusCode.UNAVAILABLE, "draining; retry", retry_after_ms=300)
    )
    paced = RetryPolicy(unavailable_backoff_seconds=0.1).start(None)
    assert [paced.delay(draining), paced.delay(draining)] == [0.3, 0.3]  # the server's delay
