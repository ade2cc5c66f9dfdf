"""The span of one request at the front door, with the OpenTelemetry GenAI attributes.

The transport's SERVER span (the gRPC instrumentation's for Generate, the ASGI middleware's
for HTTP, each a child of the caller's W3C `traceparent`) becomes the request span: it is
renamed `{gen_ai.operation.name} {gen_ai.request.model}` ("chat m", "text_completion m") and
carries `gen_ai.request.*` when the request is admitted, `gen_ai.usage.*` and
`gen_ai.response.*` when it ends. Without a current SERVER span (the door used in-process) a
span of its own is started; each prompt of an HTTP batch (one run each) has its own, an
INTERNAL child of the HTTP span. Every worker call, and the releases, run under it.

A request that ends with any status but OK gets status ERROR, `error.type` (the gRPC status
name) and `rpc.grpc.status_code`. Prompt and output text are recorded (as
`gen_ai.input.messages` / `gen_ai.output.messages`, JSON) only when message capture is enabled:
`--trace-message-content`, or `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import trace

from control_plane.run import DEFAULT_MAX_TOKENS, MAX_TOKENS_UP_TO_CONTEXT
from kvmesh.telemetry.tracing import mark_failed
from kvmesh.v1 import generation_pb2

TRACER = trace.get_tracer("kvmesh.control_plane")
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
SERVER = trace.SpanKind.SERVER
FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


def capture_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment enables recording prompt and output text."""
    return (os.environ if env is None else env).get(CAPTURE_ENV, "").lower() == "true"


def operation(request: generation_pb2.GenerateRequest) -> str:
    return "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"


def request_attributes(
    request: generation_pb2.GenerateRequest, request_id: str, model: str
) -> dict[str, Any]:
    """`gen_ai.request.*` (effective values: unset fields are the engine defaults; no
    `max_tokens` when only the model's context bounds the output)."""
    s = request.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation(request),
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": round(s.temperature, 6) if s.HasField("temperature") else 1.0,
        "gen_ai.request.top_p": round(s.top_p, 6) if s.HasField("top_p") else 1.0,
        "gen_ai.response.id": request_id,
        "kvmesh.request_id": request_id,
    }
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens != MAX_TOKENS_UP_TO_CONTEXT:  # bounded by the model's context alone: omitted
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if s.HasField("top_k"):
        attributes["gen_ai.request.top_k"] = s.top_k
    if s.HasField("seed"):
        attributes["gen_ai.request.seed"] = s.seed
    if s.HasField("n") and s.n != 1:
        attributes["gen_ai.request.choice.count"] = s.n
    return attributes


def input_messages(request: generation_pb2.GenerateRequest) -> list[dict[str, Any]]:
    which = request.WhichOneof("prompt")
    if which == "chat":
        pairs = [(m.role, m.content) for m in request.chat.messages]
    elif which == "text":
        pairs = [("user", request.text)]
    else:
        return []
    return [{"role": role, "parts": [{"type": "text", "content": text}]} for role, text in pairs]


class RequestSpan:
    """The request span of one run (see the module docstring)."""

    def __init__(
        self,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        model: str,
        capture: bool,
        nested: bool = False,
    ) -> None:
        """`nested`: one of several runs of one transport request (an HTTP batch), whose
        request span is its own INTERNAL child of the transport's span."""
        name = f"{operation(request)} {model}".strip()
        current = trace.get_current_span()
        self.owned = nested or not (
            current.is_recording() and getattr(current, "kind", None) is SERVER
        )
        if self.owned:
            current = TRACER.start_span(name, kind=trace.SpanKind.INTERNAL if nested else SERVER)
        else:
            current.update_name(name)
        self.span = current
        self.capture = capture
        self.span.set_attributes(request_attributes(request, request_id, model))
        if capture:
            self.span.set_attribute("gen_ai.input.messages", json.dumps(input_messages(request)))
        self.finish_reasons: dict[int, str] = {}
        self.output_tokens = 0
        self.texts: dict[int, list[str]] = {}
        self.failure = ""

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.span.add_event(name, attributes)

    def observe(self, response: generation_pb2.GenerateResponse) -> None:
        """Account one response relayed to the client."""
        if self.capture and response.text:
            self.texts.setdefault(response.index, []).append(response.text)
        if response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
            reason = FINISH_REASONS.get(response.finish_reason, "unknown")
            self.finish_reasons[response.index] = reason
            self.output_tokens += response.usage.completion_tokens

    def end(self, status: grpc.StatusCode, input_tokens: int, cached_tokens: int) -> None:
        """Record the outcome; ends the span when it is the door's own."""
        span = self.span
        if span.is_recording():
            reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
            span.set_attributes({
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": self.output_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "kvmesh.usage.cached_tokens": cached_tokens,
                "rpc.grpc.status_code": status.value[0],
            })  # fmt: skip
            if self.capture:
                span.set_attribute("gen_ai.output.messages", json.dumps(self._outputs()))
            if status != grpc.StatusCode.OK:
                mark_failed(span, status.name, self.failure or status.name)
        if self.owned:
            span.end()

    def _outputs(self) -> list[dict[str, Any]]:
        return [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": "".join(self.texts.get(i, []))}],
                "finish_reason": self.finish_reasons.get(i, ""),
            }
            for i in sorted(set(self.texts) | set(self.finish_reasons))
        ]


def mark_refused(code: grpc.StatusCode, message: str) -> None:
    """A request refused before it ran: its transport span (when any) gets status ERROR."""
    span = trace.get_current_span()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    mark_failed(span, code.name, message)
