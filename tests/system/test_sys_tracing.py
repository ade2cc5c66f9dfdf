"""Traces and logs of a real `kvmesh up` (tiny model, shared-memory transfer) seen by a real
OTLP/gRPC receiver on loopback: one trace per request from the caller's span through the
control plane, prefill, the KV transfer and decode; GenAI attributes and no prompt text; a
failed request's span is ERROR; JSON log lines carry level, request id and trace id."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
from otlp_receiver import Receiver, Span, SpanKind, StatusCode

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Client, KvmeshError

SECRET = "do-not-record-this-prompt"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def traceparent(span_id: str, trace_id: str = CALLER_TRACE) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def traced(
    shm_system: tuple[LocalSystem, str], otlp: tuple[Receiver, dict[str, str]]
) -> tuple[LocalSystem, Receiver]:
    return shm_system[0], otlp[0]


def request_span(spans: list[Span], parent: str) -> Span:
    (root,) = [s for s in spans if s.parent_id == parent]
    return root


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id]


def one(spans: list[Span], name: str, kind: int) -> Span:
    (found,) = [s for s in spans if s.name == name and s.kind == kind]
    return found


def wait_trace(receiver: Receiver, trace_id: str, names: set[str]) -> list[Span]:
    """The trace once it has a span of each of `names` ("NAME" or "NAME KIND", kinds as
    CLIENT / SERVER) and every worker call's SERVER span."""

    def complete() -> bool:
        spans = receiver.trace(trace_id)
        have = {s.name for s in spans} | {f"{s.name} {KINDS.get(s.kind)}" for s in spans}
        calls = {s.name for s in spans if s.kind == SpanKind.SPAN_KIND_CLIENT}
        return names <= have and all(f"{c} SERVER" in have for c in calls)

    receiver.wait(complete)
    return receiver.trace(trace_id)


KINDS = {SpanKind.SPAN_KIND_CLIENT: "CLIENT", SpanKind.SPAN_KIND_SERVER: "SERVER"}


def no_text(spans: list[Span], text: str) -> None:
    for span in spans:
        values = [span.name, *span.attributes.values()]
        values += [v for _, attrs in span.events for v in attrs.values()]
        assert all(text not in str(v) for v in values), span


def test_grpc_request_is_one_trace_from_the_caller_span(traced: Any) -> None:
    system, receiver = traced
    caller = "00f067aa0ba902b7"
    with Client(system.endpoint) as client:
        result = client.complete(
            SECRET, max_tokens=6, temperature=0.0, top_p=0.5, ignore_eos=True,
            metadata=(("traceparent", traceparent(caller)),),
        )  # fmt: skip
    model = client_model(system)
    release = {"/kvmesh.v1.DecodeService/Release", "/kvmesh.v1.PrefillService/Release"}
    decode = "/kvmesh.v1.DecodeService/Decode CLIENT"
    expected = {"kv_transfer shm", f"text_completion {model}", decode}
    receiver.wait(lambda: bool(release & {s.name for s in receiver.trace(CALLER_TRACE)}))
    spans = wait_trace(receiver, CALLER_TRACE, expected)
    assert {"kvmesh-control", "kvmesh-prefill", "kvmesh-decode"} <= {s.service for s in spans}

    root = request_span(spans, caller)  # the caller's span is the parent of our root
    assert (root.service, root.kind, root.name) == ("kvmesh-control", SpanKind.SPAN_KIND_SERVER,
                                                   f"text_completion {model}")  # fmt: skip
    completion = result.completions[0]
    usage = completion.usage
    assert usage is not None
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.model"] == model
    assert root.attributes["gen_ai.request.max_tokens"] == 6
    assert root.attributes["gen_ai.request.temperature"] == 0.0
    assert root.attributes["gen_ai.request.top_p"] == 0.5
    assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == len(completion.token_ids) == 6
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["gen_ai.response.id"] == result.request_id
    assert root.status == StatusCode.STATUS_CODE_UNSET
    assert {"admitted", "routed"} <= {name for name, _ in (root.events)}

    calls = {s.name for s in children(spans, root) if s.kind == SpanKind.SPAN_KIND_CLIENT}
    assert {
        "/kvmesh.v1.DecodeService/Reserve",
        "/kvmesh.v1.PrefillService/PrefillAhead",
        "/kvmesh.v1.DecodeService/Decode",
    } <= calls
    assert "/kvmesh.v1.PrefillService/Prepare" not in calls  # the workers tokenize
    assert release & calls  # the releases are in the request's trace
    for name in ("/kvmesh.v1.PrefillService/PrefillAhead", "/kvmesh.v1.DecodeService/Decode"):
        client_span = one(spans, name, SpanKind.SPAN_KIND_CLIENT)
        server_span = one(spans, name, SpanKind.SPAN_KIND_SERVER)
        assert server_span.parent_id == client_span.span_id
        assert server_span.attributes["kvmesh.request_id"] == result.request_id

    prefill = one(spans, "/kvmesh.v1.PrefillService/PrefillAhead", SpanKind.SPAN_KIND_SERVER)
    assert prefill.service == "kvmesh-prefill"
    chunks = [attrs for name, attrs in prefill.events if name == "prefill_chunk"]
    assert chunks and chunks[-1]["kvmesh.prefill.computed_tokens"] == usage.prompt_tokens
    transfer = one(spans, "kv_transfer shm", SpanKind.SPAN_KIND_INTERNAL)
    assert transfer.parent_id == prefill.span_id
    t = {k.removeprefix("kvmesh.transfer."): v for k, v in transfer.attributes.items()}
    assert t["backend"] == "shm" and t["state"] == "COMPLETED" and t["bytes"] > 0
    assert t["blocks"] >= 1 and t["parts"] >= 1 and t["duration_seconds"] >= 0

    decode = one(spans, "/kvmesh.v1.DecodeService/Decode", SpanKind.SPAN_KIND_SERVER)
    assert decode.service == "kvmesh-decode"
    assert {"kv_received", "first_token"} <= {name for name, _ in decode.events}
    assert decode.attributes["kvmesh.tokens_generated"] >= 5  # the first came from prefill
    no_text(spans, SECRET)

    lines = [json.loads(line) for line in system.control.tail if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == result.request_id]
    assert mine and all(line["trace_id"] == CALLER_TRACE for line in mine)
    assert {"level", "logger", "message", "time"} <= set(mine[-1]) and mine[-1]["level"] == "INFO"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_http_request_continues_the_caller_trace(traced: Any, stream: bool) -> None:
    system, receiver = traced
    trace_id = f"0af7651916cd43dd8448eb211c80319{int(stream)}"
    caller = "b7ad6b7169203331"
    body = {"prompt": SECRET, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(
        f"{system.http_url}/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json", "traceparent": traceparent(caller, trace_id)},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    if stream:  # the last data event before [DONE] carries the usage
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        answer = json.loads(events[-2])
    else:
        answer = json.loads(text)
    model = client_model(system)
    spans = wait_trace(receiver, trace_id, {f"text_completion {model}", "kv_transfer shm"})
    root = request_span(spans, caller)
    assert root.kind == SpanKind.SPAN_KIND_SERVER and root.service == "kvmesh-control"
    assert root.attributes["gen_ai.response.id"] == answer["id"]
    assert root.attributes["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert {"kvmesh-prefill", "kvmesh-decode"} <= {s.service for s in spans}
    no_text(spans, SECRET)


def test_client_sends_the_current_span_as_traceparent(traced: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    system, receiver = traced
    tracer = TracerProvider().get_tracer("app")
    with tracer.start_as_current_span("app") as app, Client(system.endpoint) as client:
        client.complete("hello", max_tokens=2)
    context = app.get_span_context()
    trace_id, span_id = format(context.trace_id, "032x"), format(context.span_id, "016x")
    receiver.wait(lambda: any(s.parent_id == span_id for s in receiver.trace(trace_id)))
    assert request_span(receiver.trace(trace_id), span_id).service == "kvmesh-control"


def test_failed_request_marks_its_spans_error(traced: Any) -> None:
    system, receiver = traced
    trace_id, caller = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"
    with Client(system.endpoint) as client, pytest.raises(KvmeshError) as failure:
        client.complete([10**6], max_tokens=2, metadata=(("traceparent", traceparent(caller,
                        trace_id)),))  # fmt: skip
    code = failure.value.code.name
    receiver.wait(lambda: any(s.parent_id == caller for s in receiver.trace(trace_id)))
    root = request_span(receiver.trace(trace_id), caller)
    assert root.status == StatusCode.STATUS_CODE_ERROR
    assert root.attributes["error.type"] == code and code in root.status_message


def client_model(system: LocalSystem) -> str:
    with Client(system.endpoint) as client:
        return str(client.model_info().model_name)


def post(system: LocalSystem, body: dict[str, Any], trace_id: str, caller: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{system.http_url}/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json", "traceparent": traceparent(caller, trace_id)},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def finished_line(system: LocalSystem, request_id: str) -> dict[str, Any]:
    """The control plane's JSON 'request ID finished' line of `request_id` (waited for)."""
    control = system.control
    assert control is not None
    deadline = time.monotonic() + 10.0
    while True:
        lines = [json.loads(line) for line in list(control.tail) if line.startswith("{")]
        found = [x for x in lines if x["message"].startswith(f"request {request_id} finished")]
        if found or time.monotonic() > deadline:
            (line,) = found
            return line
        time.sleep(0.05)


def test_http_request_log_line_carries_its_request_id(traced: Any) -> None:
    """The HTTP door's request runs in other tasks than the one that admitted it; its
    'finished' line still carries the request id (the response's `id`) and the trace id."""
    system, receiver = traced
    trace_id, caller = "7c4e1f0a9b2d43e58f6a7b8c9d0e1f21", "1a2b3c4d5e6f7081"
    answer = post(system, {"prompt": "log me", "max_tokens": 2}, trace_id, caller)
    receiver.wait(lambda: any(s.parent_id == caller for s in receiver.trace(trace_id)))
    line = finished_line(system, answer["id"])
    assert (line.get("request_id"), line.get("trace_id")) == (answer["id"], trace_id)


def test_http_batch_prompts_each_get_a_request_span(traced: Any) -> None:
    """A completion batch is one run per prompt (ids `<id>-<i>`): each has its own request
    span, a child of the HTTP span, with its own id and usage; together they add up to the
    response's usage (one span's attributes must not be overwritten by every prompt's run)."""
    system, receiver = traced
    trace_id, caller = "8d5f2a1b0c3e44f69a7b8c9d0e1f2a32", "2b3c4d5e6f708192"
    prompts = ["short", "a rather longer prompt than the first one"]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    answer = post(system, body, trace_id, caller)
    ids = {f"{answer['id']}-{i}" for i in range(len(prompts))}

    def requests() -> list[Span]:
        return [s for s in receiver.trace(trace_id) if "gen_ai.response.id" in s.attributes]

    receiver.wait(lambda: len(requests()) == len(prompts))
    spans = requests()
    assert {s.attributes["gen_ai.response.id"] for s in spans} == ids
    (http,) = [s for s in receiver.trace(trace_id) if s.parent_id == caller]
    assert all(s.parent_id == http.span_id for s in spans)
    usage = answer["usage"]
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in spans) == usage["prompt_tokens"]
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in spans) == 6
    for request_id in ids:
        line = finished_line(system, request_id)
        assert (line.get("request_id"), line.get("trace_id")) == (request_id, trace_id)
