"""Wire-level contract shared by every kvmesh gRPC server and client (handwritten).

- `DecodeCheck`: a server interceptor that parses each unary request itself, so a request that
  is not a valid protobuf message, or has a string field that is not UTF-8, ends with
  INVALID_ARGUMENT and a plain message naming the field where it can be found (grpc's own
  deserialization failure is UNKNOWN, with a Python class name in the message). A streamed
  request's messages are parsed as the handler reads them: an undecodable one raises
  `UndecodableMessage` there, which the handler's status mapping answers INVALID_ARGUMENT
  naming the field.
- Rich status: `failure_status` builds the `grpc.Status` of a failure with the standard
  `google.rpc` details — `BadRequest` naming the field, `RetryInfo` with the retry delay — and
  the `grpc-retry-pushback-ms` / `retry-after-ms` trailers; `field_of`, `retry_delay_ms` and
  `retry_pushback_ms` read them back from a failed call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf import any_pb2, descriptor, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRFC A6: the client-side retry pushback trailer
RETRY_AFTER_KEY = "retry-after-ms"  # kvmesh's original trailer, kept for older clients
MAX_SCANNED_FIELDS = 10_000  # bound of the walk that locates a string with bad UTF-8
Metadata = Sequence[tuple[str, str | bytes]]


# -- rich status -------------------------------------------------------------------------------


def failure_status(
    code: grpc.StatusCode,
    message: str,
    *,
    field: str | None = None,
    retry_after_ms: int | None = None,
) -> grpc.Status:
    """The status of a failed call: code and message, a `BadRequest` field violation when
    `field` is given, a `RetryInfo` plus the pushback trailers when `retry_after_ms` is."""
    details = []
    metadata: list[tuple[str, str | bytes]] = []
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(retry_after_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        metadata += [(PUSHBACK_KEY, str(retry_after_ms)), (RETRY_AFTER_KEY, str(retry_after_ms))]
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    proto = status_pb2.Status(code=code.value[0], message=message, details=packed)
    status = rpc_status.to_status(proto)
    return _Status(status.code, status.details, (*status.trailing_metadata, *metadata))


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Metadata) -> None:
        self.code, self.details = code, details
        self.trailing_metadata = tuple(trailing_metadata)


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """End the call with `status` (raises, as `context.abort` does)."""
    await context.abort(status.code, status.details, status.trailing_metadata)


def status_details(error: grpc.RpcError) -> list[any_pb2.Any]:
    """The `google.rpc.Status` details of a failed call ([] when it carries none)."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:  # details that disagree with the call's code or message
        return []
    return list(status.details) if status is not None else []


def field_of(error: grpc.RpcError) -> str | None:
    """The first field a failed call's `BadRequest` detail names, or None."""
    for holder in status_details(error):
        if holder.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            holder.Unpack(bad)
            if bad.field_violations:
                return str(bad.field_violations[0].field)
    return None


def retry_delay_ms(error: grpc.RpcError) -> int | None:
    """The server's retry delay of a failed call: the pushback trailer, else `RetryInfo`,
    else the `retry-after-ms` trailer; None when it gave none (a negative delay, from any of
    them, means "do not retry", also None; `retry_pushback_ms` tells the two apart)."""
    delay = retry_pushback_ms(error)
    return delay if delay is not None and delay >= 0 else None


def retry_pushback_ms(error: grpc.RpcError) -> int | None:
    """The server's retry delay of a failed call as sent, read in `retry_delay_ms`'s order:
    negative means "do not retry" (whatever the status code); None when it gave none or the
    first one present is not an integer."""
    metadata: Any = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    found: dict[str, str] = {}
    for key, value in metadata:
        if key in (PUSHBACK_KEY, RETRY_AFTER_KEY) and isinstance(value, str):
            found[key] = value
    if PUSHBACK_KEY in found:
        return _integer(found[PUSHBACK_KEY])
    for holder in status_details(error):
        if holder.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            holder.Unpack(info)
            return _milliseconds(info.retry_delay)
    return _integer(found[RETRY_AFTER_KEY]) if RETRY_AFTER_KEY in found else None


def _milliseconds(delay: duration_pb2.Duration) -> int:
    """`delay` in ms; a negative one stays negative (-1 at least) however short."""
    ms = int(delay.ToMilliseconds())
    return min(ms, -1) if delay.seconds < 0 or delay.nanos < 0 else ms


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


# -- clients -----------------------------------------------------------------------------------


def client_options(
    max_message_bytes: int, max_reconnect_backoff_ms: int | None = None
) -> list[tuple[str, int]]:
    """The options of every kvmesh gRPC channel (clients, the control plane's channels to
    workers, the agents' to the control plane, KV senders): messages up to
    `max_message_bytes`; keepalive pings while a call is open, also while no data flows (a long
    prefill), so a peer that froze or a connection that went half-open fails its calls
    UNAVAILABLE within about 15 s, even calls without a deadline (`server_options` accepts a
    ping every 5 s); gRPC's reconnect backoff capped at `max_reconnect_backoff_ms` when given
    (its own cap is 120 s)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.ping_timeout_ms", 5_000),  # grpc's own bound on a ping: else 1 minute
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet call
    ]
    if max_reconnect_backoff_ms is not None:
        options.append(("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms))
    return options


# -- servers -----------------------------------------------------------------------------------


def server_options(
    max_message_bytes: int, max_connection_idle_seconds: float
) -> list[tuple[str, int]]:
    """The options of every kvmesh grpc.aio server (control plane doors, worker ports):
    messages up to `max_message_bytes`; keepalive pings, so a dead peer is noticed; a
    connection without calls for `max_connection_idle_seconds` closed with GOAWAY (calls in
    flight are never cut; clients reconnect on their next call); no SO_REUSEPORT, so a busy
    port fails to bind instead of being shared with its holder."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_connection_idle_ms", round(max_connection_idle_seconds * 1000)),
        ("grpc.so_reuseport", 0),
    ]


# -- request decoding ----------------------------------------------------------------------------


class UndecodableMessage(DecodeError):
    """A streamed request's message that is not a valid protobuf message (or has a string field
    that is not UTF-8): INVALID_ARGUMENT naming `field` (read by the status mapping through
    `status_name` and `field`)."""

    status_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class DecodeCheck(grpc.aio.ServerInterceptor):
    """Parse unary requests in the handler, answering undecodable ones INVALID_ARGUMENT; parse
    streamed requests' messages as the handler reads them (`UndecodableMessage`)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(
                request_deserializer=None,
                stream_stream=_stream_in_out(parse, handler.stream_stream),
            )
        if handler.request_streaming:
            return handler._replace(
                request_deserializer=None, stream_unary=_stream_in(parse, handler.stream_unary)
            )
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=None, unary_stream=_streaming(parse, handler.unary_stream)
            )
        return handler._replace(
            request_deserializer=None, unary_unary=_unary(parse, handler.unary_unary)
        )


def _unary(parse: Callable[[bytes], Any], behaviour: Any) -> Any:
    async def checked(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await decoded(parse, raw, context), context)

    return checked


def _streaming(parse: Callable[[bytes], Any], behaviour: Any) -> Any:
    async def checked(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in responses_of(behaviour(await decoded(parse, raw, context), context)):
            yield response

    return checked


def _stream_in(parse: Callable[[bytes], Any], behaviour: Any) -> Any:
    async def checked(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(parsed_messages(parse, raws), context)

    return checked


def _stream_in_out(parse: Callable[[bytes], Any], behaviour: Any) -> Any:
    async def checked(
        raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in responses_of(behaviour(parsed_messages(parse, raws), context)):
            yield response

    return checked


async def parsed_messages(
    parse: Callable[[bytes], Any], raws: AsyncIterator[bytes]
) -> AsyncIterator[Any]:
    """The messages of a request stream, parsed; `UndecodableMessage` for one that is not."""
    async for raw in raws:
        try:
            message = parse(raw)
        except DecodeError as error:
            raise UndecodableMessage(*_undecodable(parse, raw, error)) from None
        yield message


async def responses_of(result: Any) -> AsyncIterator[Any]:
    """What a unary-stream behaviour returned, as responses: an async generator's, or none
    from a coroutine that writes with `context.write` (awaited)."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


async def decoded(
    parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext
) -> Any:
    """The request parsed from `raw`, or the call ended with INVALID_ARGUMENT."""
    try:
        return parse(raw)
    except DecodeError as error:
        field, text = _undecodable(parse, raw, error)
    await abort(context, failure_status(grpc.StatusCode.INVALID_ARGUMENT, text, field=field))
    raise AssertionError("unreachable")


def _undecodable(parse: Callable[[bytes], Any], raw: bytes, error: DecodeError) -> tuple[str, str]:
    """The field at fault in `raw`, which `parse` refused, and the message naming it."""
    message_type = _descriptor_of(parse)
    name = message_type.full_name if message_type is not None else "request message"
    field = bad_utf8_field(message_type, raw) if "UTF-8" in str(error) else None
    if field is not None:
        return field, f"{field}: not valid UTF-8"
    return "request", f"request: not a valid {name} (the wire format is corrupt)"


def _descriptor_of(parse: Callable[[bytes], Any]) -> descriptor.Descriptor | None:
    owner = getattr(parse, "__self__", None)
    found = getattr(owner, "DESCRIPTOR", None)
    return found if isinstance(found, descriptor.Descriptor) else None


def bad_utf8_field(message_type: descriptor.Descriptor | None, data: bytes) -> str | None:
    """The path (`chat.messages[1].content`) of the first string field of `data` that is not
    valid UTF-8, or None (also for input too malformed to walk)."""
    if message_type is None:
        return None
    budget = [MAX_SCANNED_FIELDS]
    try:
        return _walk(message_type, memoryview(data), "", budget)
    except (IndexError, ValueError):
        return None


def _walk(
    message_type: descriptor.Descriptor, data: memoryview, prefix: str, budget: list[int]
) -> str | None:
    pos = 0
    seen: dict[int, int] = {}
    while pos < len(data):
        budget[0] -= 1
        if budget[0] < 0:
            return None
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            chunk, pos = data[pos : pos + size], pos + size
            found = _check_chunk(message_type, number, chunk, prefix, seen, budget)
            if found is not None:
                return found
        else:
            return None
    return None


def _check_chunk(
    message_type: descriptor.Descriptor,
    number: int,
    chunk: memoryview,
    prefix: str,
    seen: dict[int, int],
    budget: list[int],
) -> str | None:
    field = message_type.fields_by_number.get(number)
    if field is None:
        return None
    index = seen.get(number, 0)
    seen[number] = index + 1
    repeated = bool(field.is_repeated)
    oneof = field.containing_oneof  # named as the front door names it: prompt.text
    group = f"{oneof.name}." if oneof is not None and not oneof.name.startswith("_") else ""
    name = f"{prefix}{group}{field.name}" + (f"[{index}]" if repeated else "")
    if field.type == descriptor.FieldDescriptor.TYPE_STRING:
        try:
            bytes(chunk).decode("utf-8")
        except UnicodeDecodeError:
            return name
    elif field.type == descriptor.FieldDescriptor.TYPE_MESSAGE and field.message_type:
        return _walk(field.message_type, chunk, f"{name}.", budget)
    return None


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


__all__ = [
    "PUSHBACK_KEY",
    "RETRY_AFTER_KEY",
    "DecodeCheck",
    "UndecodableMessage",
    "abort",
    "failure_status",
    "field_of",
    "retry_delay_ms",
    "retry_pushback_ms",
]
