"""The front door's request span over real gRPC (fake workers): a child of the caller's
`traceparent`, GenAI attributes, prompt and output text only when capture is enabled, ERROR
on a refused request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest
from cp_harness import control_plane, status_of, text_request
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.v1 import generation_pb2

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
METADATA = (("traceparent", f"00-{TRACE_ID}-{CALLER}-01"),)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans of this process (an SDK provider is installed when none is)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()  # later spans are dropped


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
