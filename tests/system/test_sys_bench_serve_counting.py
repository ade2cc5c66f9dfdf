"""What `kvmesh bench serve`'s clients time and count, against a real colocated system (gRPC and
the OpenAI-compatible HTTP door) on the tiny chat-template model: every streamed chunk with a
choice is one timestamp, as vLLM's benchmark times it (a chunk whose token decodes to no text
yet is still a token), and input tokens are the server's prompt tokens (vLLM's `prompt_tokens`
of the usage), not the ids drawn before a chat template or the characters of a text prompt.
The HTTP client's `--timeout` bounds a whole request, as the gRPC deadline does (against a
loopback server trickling its stream)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sys_harness import local_system

from kvmesh.cli.up import LocalSystem
from kvmesh.loadgen import backends, workloads
from kvmesh.loadgen.backends import GrpcBackend, OpenAIBackend
from kvmesh.loadgen.metrics import Slo, summarize


@pytest.fixture(scope="module")
def chat_system(tiny_model: str) -> Iterator[LocalSystem]:
    with local_system(model=tiny_model, http_port=0, colocated=1, prefill=0, decode=0) as (
        started,
        _,
    ):
        yield started


def test_chat_times_every_chunk_and_counts_the_servers_prompt_tokens(
    chat_system: LocalSystem, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    seen: list[list[dict[str, Any]]] = []  # the events each request's stream carried
    real_events = backends._events

    async def spied(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
        seen.append([])
        async for event in real_events(lines):
            seen[-1].append(event)
            yield event

    monkeypatch.setattr(backends, "_events", spied)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    # random ids through the byte-level tokenizer: many tokens decode to no text on their own
    requests = workloads.as_text(workloads.build("w1", 1024, 8, 0, 0.05), tokenizer)

    async def run() -> list[backends.RequestRecord]:
        backend = OpenAIBackend(f"{chat_system.http_url}/v1", 60.0, "chat")
        try:
            return [await backend.send(i, r) for i, r in enumerate(requests)]
        finally:
            await backend.close()

    records = asyncio.run(run())
    assert len(seen) == len(records)
    for record, events in zip(records, seen, strict=True):
        chunks = [e for e in events if e.get("choices")]
        usage = next(e["usage"] for e in events if e.get("usage"))
        assert record.ok, (record.error, [c["choices"][0]["delta"] for c in chunks])
        assert len(record.chunk_times) == len(chunks)  # the first token's chunk gives TTFT
        assert record.output_tokens == usage["completion_tokens"] == record.expected_output
        assert record.prompt_len == usage["prompt_tokens"]  # chat template included
    summary = summarize(records, 1.0, Slo())
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["input_tokens"] == sum(
        next(e["usage"] for e in events if e.get("usage"))["prompt_tokens"] for events in seen
    )


def test_text_prompts_count_tokens_not_characters_over_grpc_and_http(
    chat_system: LocalSystem, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3, "héllo wörld, ünïcödé ☃ " * 2]
    trace.write_text("".join(json.dumps({"prompt": p, "output_len": 3}) + "\n" for p in prompts))
    requests = workloads.build("trace", 1024, trace=str(trace))

    async def run(make: Callable[[], Any]) -> list[backends.RequestRecord]:
        backend = make()  # a gRPC channel belongs to the loop that opens it
        try:
            return [await backend.send(i, r) for i, r in enumerate(requests)]
        finally:
            await backend.close()

    from kvmesh.client import Client

    with Client(chat_system.endpoint) as client:  # the server's own count of each prompt
        usages = [client.complete(p, max_tokens=1).usage for p in prompts]
    expected = [u.prompt_tokens for u in usages if u is not None]
    assert expected[1] > len(prompts[1])  # a byte tokenizer: a token per UTF-8 byte or more
    http = f"{chat_system.http_url}/v1"
    for door, make in (("grpc", lambda: GrpcBackend(chat_system.endpoint, 60.0)),
                       ("http", lambda: OpenAIBackend(http, 60.0))):  # fmt: skip
        records = asyncio.run(run(make))
        assert all(r.ok for r in records)
        assert [r.prompt_len for r in records] == expected, door
        assert summarize(records, 1.0, Slo())["input_tokens"] == sum(expected)


class Trickles(BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose completion streams an event every 0.2 s, 6 in all."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # /v1/models
        body = json.dumps({"data": [{"id": "trickle"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        try:
            for _ in range(6):
                time.sleep(0.2)
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client gave up
            pass


def test_http_timeout_is_the_whole_requests_deadline() -> None:
    """Each gap (0.2 s) is within the 0.5 s `--timeout`, the stream (1.2 s) is not: the request
    is cut at the deadline and fails DEADLINE_EXCEEDED, as over gRPC (before, httpx bounded each
    read only, and the request counted as completed)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickles)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def run() -> tuple[backends.RequestRecord, float]:
        backend = OpenAIBackend(f"http://127.0.0.1:{server.server_port}/v1", 0.5)
        try:
            await backend.served_model()
            record = await backend.send(0, workloads.BenchRequest([1, 2, 3], 6, 3))
            return record, time.perf_counter() - record.sent
        finally:
            await backend.close()

    try:
        record, took = asyncio.run(run())
    finally:
        server.shutdown()
        server.server_close()
    assert not record.ok and record.error is not None
    assert record.error.startswith("DEADLINE_EXCEEDED"), record.error
    assert 1 <= len(record.chunk_times) < 6 and took < 1.0
