"""The blocking client against a real scripted gRPC server: a negative RetryInfo delay means
"do not retry" (the call fails at once, typed, as a negative pushback trailer does, on
UNAVAILABLE too, which is otherwise retried), and
`Stream.cancel()` is never lost to a retry (a cancel during the backoff raises Cancelled; one
that lands while the retried call starts cancels that call); leaving a Stream's loop early
cancels its call at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmesh.client import Cancelled, Client, ResourceExhausted, Stream, Unavailable
from kvmesh.client_retry import RetryPolicy
from kvmesh.v1 import generation_pb2, generation_pb2_grpc

Handler = Callable[[int, grpc.ServicerContext], Iterator[generation_pb2.GenerateResponse]]
RETRY = RetryPolicy(max_retries=3, max_wait_seconds=10.0, unavailable_backoff_seconds=2.0)


class Scripted(generation_pb2_grpc.GenerationServiceServicer):
    """Generate and GetModelInfo answered by `handler(attempt, context)`, attempts counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.attempts = 0

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.attempts += 1
        yield from self.handler(self.attempts, context)

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.attempts += 1
        for _ in self.handler(self.attempts, context):
            pass
        return generation_pb2.ModelInfo(model_name="scripted")


def serve(handler: Handler) -> tuple[grpc.Server, Scripted, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = Scripted(handler)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"


def negative_retry_info(attempt: int, context: grpc.ServicerContext) -> Iterator[Any]:
    """RESOURCE_EXHAUSTED whose only retry delay is a RetryInfo of -0.5 s (no trailers)."""
    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=-500_000_000))
    holder = any_pb2.Any()
    holder.Pack(info)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    proto = status_pb2.Status(code=code.value[0], message="full", details=[holder])
    context.abort_with_status(rpc_status.to_status(proto))
    yield from ()


def unavailable_for_good(attempt: int, context: grpc.ServicerContext) -> Iterator[Any]:
    """UNAVAILABLE with a pushback trailer of -1: the server says "do not retry"."""
    context.set_trailing_metadata((("grpc-retry-pushback-ms", "-1"),))
    context.abort(grpc.StatusCode.UNAVAILABLE, "going away for good")
    yield from ()


def unavailable_then_slow(attempt: int, context: grpc.ServicerContext) -> Iterator[Any]:
    """The first attempt is UNAVAILABLE; later ones stream a token each 20 ms until cancelled."""
    if attempt == 1:
        context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker yet")
    for token in range(100):
        if not context.is_active():
            break
        yield generation_pb2.GenerateResponse(request_id="r", token_ids=[token])
        time.sleep(0.02)


@pytest.fixture
def scripted() -> Iterator[Callable[[Handler], tuple[Scripted, str]]]:
    servers: list[grpc.Server] = []

    def start(handler: Handler) -> tuple[Scripted, str]:
        server, servicer, address = serve(handler)
        servers.append(server)
        return servicer, address

    yield start
    for server in servers:
        server.stop(None)


def test_negative_retry_info_is_not_retried(scripted: Any) -> None:
    """Unary and streaming calls alike: ResourceExhausted after one attempt."""
    servicer, address = scripted(negative_retry_info)
    with Client(address, timeout=5.0, retry=RETRY) as client:
        with pytest.raises(ResourceExhausted):
            client.model_info()
        assert servicer.attempts == 1
        with pytest.raises(ResourceExhausted) as info:
            list(client.generate([1, 2, 3]))
        assert servicer.attempts == 2 and info.value.retry_after_ms is None


def test_negative_pushback_on_unavailable_is_not_retried(scripted: Any) -> None:
    """The pushback rule holds whatever the code: UNAVAILABLE, retried with a backoff when the
    server sent no delay, fails after one attempt when its delay is negative."""
    servicer, address = scripted(unavailable_for_good)
    with Client(address, timeout=5.0, retry=RETRY) as client:
        with pytest.raises(Unavailable):
            client.model_info()
        assert servicer.attempts == 1
        with pytest.raises(Unavailable):
            list(client.generate([1, 2, 3]))
        assert servicer.attempts == 2


def test_cancel_during_the_backoff_raises_cancelled(scripted: Any) -> None:
    """The 2 s backoff is cut short by cancel(): Cancelled, not the earlier UNAVAILABLE, and no
    retry is started."""
    servicer, address = scripted(unavailable_then_slow)
    with Client(address, timeout=10.0, retry=RETRY) as client:
        stream = client.generate([1, 2, 3])
        threading.Timer(0.2, stream.cancel).start()
        began = time.monotonic()
        with pytest.raises(Cancelled):
            list(stream)
        assert time.monotonic() - began < 1.5
    assert servicer.attempts == 1


def test_cancel_while_the_retry_starts_cancels_the_new_call(scripted: Any) -> None:
    """cancel() landing after the retried call started but before the stream took it (the
    window a lock-free swap loses) still cancels it: Cancelled long before its 100 tokens."""
    _, address = scripted(unavailable_then_slow)
    policy = RetryPolicy(max_retries=2, unavailable_backoff_seconds=0.0)
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request = generation_pb2.GenerateRequest(request_id="r", text="hi")
    holder: dict[str, Stream] = {}
    starts = []

    def start(timeout: float | None) -> Any:
        call = stub.Generate(request, timeout=timeout)
        starts.append(call)
        if "stream" in holder:  # the retry: the user's cancel() lands now
            holder["stream"].cancel()
        return call

    try:
        holder["stream"] = stream = Stream("r", start, 10.0, policy)
        received = []
        with pytest.raises(Cancelled):
            for chunk in stream:
                received.append(chunk)
        assert len(starts) == 2 and len(received) < 100  # the server may never see the retry
    finally:
        channel.close()


def streaming_until_cancelled(ended: threading.Event) -> Handler:
    """Stream a token each 20 ms (100 in all, 2 s); `ended` is set when the call ended."""

    def handler(attempt: int, context: grpc.ServicerContext) -> Iterator[Any]:
        context.add_callback(ended.set)
        for token in range(100):
            yield generation_pb2.GenerateResponse(request_id="r", token_ids=[token])
            time.sleep(0.02)

    return handler


def test_breaking_out_of_the_loop_cancels_the_request(scripted: Any) -> None:
    """A caller that keeps the Stream but leaves its loop early cancels the call at once (it
    used to run on, all 100 tokens, until the Stream was garbage collected)."""
    ended = threading.Event()
    _, address = scripted(streaming_until_cancelled(ended))
    with Client(address, timeout=10.0) as client:
        stream = client.generate([1, 2, 3])
        for chunk in stream:
            assert chunk.token_ids == (0,)
            break
        assert ended.wait(1.0)
        assert stream.request_id  # still held: the cancel did not wait for garbage collection
