"""The front door's request span over real gRPC (fake workers): a child of the caller's
`traceparent`, GenAI attributes, prompt and output text only when capture is enabled, ERROR
on a refused request, complete before it ends whatever ended the request."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Literal

import grpc
import pytest
from cp_harness import Harness, control_plane, status_of, text_request
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from control_plane.run import RELAY_BUFFER
from kvmesh.v1 import generation_pb2
from tests.spans import in_memory_spans

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
METADATA = (("traceparent", f"00-{TRACE_ID}-{CALLER}-01"),)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    with in_memory_spans() as memory:
        yield memory


def request_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    """Spans whose parent is the caller's span (the front door's request spans)."""
    return [
        s for s in exporter.get_finished_spans()
        if s.parent is not None and format(s.parent.span_id, "016x") == CALLER
    ]  # fmt: skip


def run_request(
    exporter: InMemorySpanExporter, capture: bool, chat: bool = False
) -> generation_pb2.Usage:
    """One request (a prompt text, or a conversation) through fake workers; its usage."""
    exporter.clear()

    async def run() -> generation_pb2.Usage:
        async with control_plane(trace_message_content=capture) as cp:
            await cp.add("p0", "prefill")
            await cp.add("d0", "decode")
            request = text_request("secret prompt", request_id="traced-1")
            if chat:
                message = generation_pb2.ChatMessage(role="user", content="secret prompt")
                request.chat.messages.append(message)
            call = cp.generation.Generate(request, timeout=5, metadata=METADATA)
            code, _, responses = await status_of(call)
            assert code == grpc.StatusCode.OK
            return responses[-1].usage

    return asyncio.run(run())


def test_request_span_continues_the_caller_trace_without_text(
    exporter: InMemorySpanExporter,
) -> None:
    usage = run_request(exporter, capture=False)
    (span,) = request_spans(exporter)
    assert span.kind is trace.SpanKind.SERVER and span.name == "text_completion tiny"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.response.id"] == "traced-1"
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens == 13
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 4
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert not any("secret" in str(v) for v in attributes.values())
    assert "gen_ai.input.messages" not in attributes
    worker_calls = [
        s for s in exporter.get_finished_spans()
        if s.kind is trace.SpanKind.CLIENT and "ControlService" not in s.name
    ]  # fmt: skip
    assert {s.name.rsplit("/", 1)[1] for s in worker_calls} >= {
        "Reserve",
        "PrefillAhead",
        "Decode",
        "Release",
    }
    assert all(s.parent and s.parent.span_id == span.context.span_id for s in worker_calls)


def test_message_capture_records_prompt_and_output_text(exporter: InMemorySpanExporter) -> None:
    run_request(exporter, capture=True, chat=True)
    (span,) = request_spans(exporter)
    assert span.name == "chat tiny"
    attributes = dict(span.attributes or {})
    inputs = json.loads(str(attributes["gen_ai.input.messages"]))
    assert inputs == [{"role": "user", "parts": [{"type": "text", "content": "secret prompt"}]}]
    (output,) = json.loads(str(attributes["gen_ai.output.messages"]))
    assert output["role"] == "assistant" and output["finish_reason"] == "length"


def test_refused_request_marks_the_span_error(exporter: InMemorySpanExporter) -> None:
    exporter.clear()

    async def run() -> None:
        async with control_plane() as cp:
            request = generation_pb2.GenerateRequest(request_id="bad\n")
            call = cp.generation.Generate(request, timeout=5, metadata=METADATA)
            code, _, _ = await status_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())
    (span,) = request_spans(exporter)
    assert span.status.status_code is trace.StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "INVALID_ARGUMENT"


def post_json(url: str, body: dict[str, object]) -> int:
    """POST `body` as JSON with the caller's `traceparent`; the HTTP status."""
    headers = {"content-type": "application/json", **dict(METADATA)}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "INVALID_ARGUMENT"),
        ({"model": "other", "prompt": "hi"}, 404, "NOT_FOUND"),
    ],
)
def test_a_request_the_http_door_refuses_marks_its_span_error(
    exporter: InMemorySpanExporter, body: dict[str, object], status: int, code: str
) -> None:
    """Refused while its body is read (before any run): the HTTP SERVER span is ERROR with the
    gRPC code it is counted under, as the gRPC door's span of a refused request is."""
    exporter.clear()

    async def run() -> None:
        async with control_plane(http_port=0) as cp:
            await cp.add("c0", "colocated")
            url = f"{cp.server.http.url}/v1/completions"
            assert await asyncio.to_thread(post_json, url, body) == status

    asyncio.run(run())
    (span,) = request_spans(exporter)
    attributes = dict(span.attributes or {})
    assert span.kind is trace.SpanKind.SERVER and span.name == "POST /v1/completions"
    assert span.status.status_code is trace.StatusCode.ERROR
    assert attributes["error.type"] == code
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode[code].value[0]


def traced_colocated(
    exporter: InMemorySpanExporter, request: generation_pb2.GenerateRequest, cached: int = 0
) -> tuple[dict[str, object], generation_pb2.Usage]:
    """One request through a colocated worker that reports `cached` prompt tokens cached: the
    request span's attributes and the usage the client was told."""
    exporter.clear()

    async def run() -> generation_pb2.Usage:
        async with control_plane() as cp:
            worker = await cp.add("c0", "colocated")
            worker.cached_tokens = cached
            call = cp.generation.Generate(request, timeout=5, metadata=METADATA)
            code, _, responses = await status_of(call)
            assert code == grpc.StatusCode.OK
            return responses[-1].usage

    usage = asyncio.run(run())
    (span,) = request_spans(exporter)
    return dict(span.attributes or {}), usage


def test_colocated_cached_tokens_reach_the_span_and_the_log(
    exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A colocated worker reports cached prompt tokens on its last response: the span's
    `kvmesh.usage.cached_tokens` and the request's finish log line say what the client is told."""
    caplog.set_level("INFO", logger="kvmesh.control_plane")
    attributes, usage = traced_colocated(exporter, text_request(request_id="cached-1"), 32)
    assert usage.cached_tokens == 32
    assert attributes["kvmesh.usage.cached_tokens"] == 32
    finished = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert any("cached-1 finished OK" in m and "(32 cached)" in m for m in finished), finished


@pytest.mark.parametrize(("max_tokens", "reported"), [(None, 16), (5, 5), (-1, None)])
def test_max_tokens_attribute_is_the_effective_bound_and_omitted_up_to_context(
    exporter: InMemorySpanExporter, max_tokens: int | None, reported: int | None
) -> None:
    """`gen_ai.request.max_tokens`: the request's bound, 16 when unset, absent for -1 (bounded
    by the model's context alone)."""
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens)
    request = text_request(request_id="bounded-1", sampling=sampling)
    attributes, _ = traced_colocated(exporter, request)
    assert attributes.get("gen_ai.request.max_tokens") == reported


async def blocked_then_cancelled(cp: Harness) -> None:
    """Read the first response, stop reading until the server's write blocks (the relay
    buffer full), then cancel; returns once the run finished."""
    await cp.add("p0", "prefill")
    decode = await cp.add("d0", "decode")
    decode.tokens, decode.text = 2000, "x" * 10_000  # 20 MB: more than any window
    call = cp.generation.Generate(text_request(request_id="gone-1"), timeout=20, metadata=METADATA)
    assert (await asyncio.wait_for(call.read(), 5)).token_ids
    door = cp.server.front_door

    async def blocked() -> None:
        while (run := door._runs.get("gone-1")) is None or run.queue.qsize() < RELAY_BUFFER:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(blocked(), 10)
    call.cancel()
    await asyncio.wait_for(door.wait_idle(5.0), 6)
    await decode.wait_empty(1.0)


def test_a_cancel_while_the_write_is_blocked_still_completes_the_span(
    exporter: InMemorySpanExporter,
) -> None:
    """A client that stops reading and then cancels (the server blocked writing to it): the
    request span ends CANCELLED (status ERROR, `error.type`) with its usage attributes."""
    exporter.clear()

    async def run() -> None:
        async with control_plane() as cp:
            await blocked_then_cancelled(cp)

    asyncio.run(run())
    (span,) = request_spans(exporter)
    attributes = dict(span.attributes or {})
    assert span.status.status_code is trace.StatusCode.ERROR
    assert attributes["error.type"] == "CANCELLED"
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert attributes["gen_ai.usage.input_tokens"] == 11  # "hello world"
    assert "gen_ai.usage.output_tokens" in attributes
    (decode,) = worker_call_spans(exporter, "Decode")
    assert decode.status.status_code is trace.StatusCode.ERROR
    assert dict(decode.attributes or {})["rpc.grpc.status_code"] == 1  # CANCELLED


def worker_call_spans(exporter: InMemorySpanExporter, method: str) -> list[ReadableSpan]:
    """The CLIENT spans of the control plane's calls of `method` on workers."""
    return [
        s for s in exporter.get_finished_spans()
        if s.kind is trace.SpanKind.CLIENT and s.name.endswith(f"Service/{method}")
        and "ControlService" not in s.name
    ]  # fmt: skip


class Gate(asyncio.Event):
    """A worker's gate that records its waiter (the worker's handler) being cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def wait(self) -> Literal[True]:
        try:
            return await super().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.mark.parametrize("method", ["Reserve", "PrefillAhead"])
def test_a_cancelled_request_cancels_the_worker_call_in_flight_and_ends_its_span(
    exporter: InMemorySpanExporter, method: str
) -> None:
    """The client cancels while a unary-response worker call (Reserve, PrefillAhead) is in
    flight: the call is cancelled on the worker (its handler stops, nothing completes after
    the control plane's Release), and its CLIENT span ends CANCELLED, a child of the request
    span."""
    exporter.clear()

    async def run() -> None:
        async with control_plane() as cp:
            prefill = await cp.add("p0", "prefill")
            decode = await cp.add("d0", "decode")
            gate = Gate()
            if method == "Reserve":
                decode.reserve_gate, started = gate, decode.reserve_started
            else:
                prefill.prefill_gate, started = gate, prefill.prefill_started
            request = text_request(request_id="cancel-1")
            call = cp.generation.Generate(request, timeout=20, metadata=METADATA)
            await asyncio.wait_for(started.wait(), 5)
            call.cancel()
            await asyncio.wait_for(gate.cancelled.wait(), 5)  # the worker's handler stopped
            await asyncio.wait_for(cp.server.front_door.wait_idle(5.0), 6)
            gate.set()  # a handler still running would complete now
            await asyncio.sleep(0.2)
            await decode.wait_empty(1.0)
            await prefill.wait_empty(1.0)

    asyncio.run(run())
    (request_span,) = request_spans(exporter)
    (span,) = worker_call_spans(exporter, method)
    attributes = dict(span.attributes or {})
    assert span.status.status_code is trace.StatusCode.ERROR
    assert attributes["error.type"] == "CANCELLED"
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert attributes["rpc.system"] == "grpc" and attributes["rpc.method"] == method
    assert span.parent is not None and span.parent.span_id == request_span.context.span_id
