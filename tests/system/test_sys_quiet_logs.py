"""Ordinary events log no ERROR and no traceback in any process of a real `kvmesh up` (tracing
to a real OTLP receiver, JSON logs): a client cancelling its stream, a client deadline, an Abort,
an HTTP client disconnecting mid-stream, a refused request."""

from __future__ import annotations

import json
import queue
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from sys_harness import idle, wait_until

from kvmesh.cli.up import LocalSystem
from kvmesh.client import Aborted, Cancelled, Client, DeadlineExceeded, InvalidArgument

LONG: dict[str, Any] = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}


def new_lines(system: LocalSystem) -> dict[str, list[str]]:
    """Each child's output lines printed since the last call (never blocks)."""
    children = [system.control, *(w.child for w in system.workers)]
    lines: dict[str, list[str]] = {}
    for child in children:
        assert child is not None
        got = lines.setdefault(child.name, [])
        while True:
            try:
                line = child.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:  # the child exited: keep the end visible to the next reader
                child.lines.put(None)
                break
            got.append(line)
    return lines


def noisy(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return "Traceback" in line
    return isinstance(record, dict) and (record.get("level") == "ERROR" or "exc_info" in record)


def cancel_after_first(client: Client, **options: Any) -> None:
    stream = client.generate("hello there", **LONG, **options)
    chunks = iter(stream)
    next(chunks)
    stream.cancel()
    with pytest.raises(Cancelled):
        list(chunks)


def abort_after_first(client: Client, request_id: str) -> None:
    stream = client.generate("hello there", request_id=request_id, **LONG)
    chunks = iter(stream)
    next(chunks)
    assert client.abort(request_id) is True
    with pytest.raises(Aborted):
        list(chunks)


def http_disconnect(url: str, model: str) -> None:
    """A streamed completion whose client hangs up after its first events."""
    body = json.dumps({"model": model, "prompt": "hello there", "stream": True, **LONG}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as s:
        s.sendall(head.encode() + body)
        received = b""
        while received.count(b"data:") < 3:
            received += s.recv(4096)


def test_ordinary_events_log_no_error(shm_system: tuple[LocalSystem, str]) -> None:
    system, endpoint = shm_system
    new_lines(system)  # what earlier tests printed
    with Client(endpoint, timeout=60) as client:
        for i in range(3):
            cancel_after_first(client)
            abort_after_first(client, f"quiet-abort-{i}")
        with pytest.raises(DeadlineExceeded):
            client.complete("hello there", timeout=0.3, **LONG)
        with pytest.raises(InvalidArgument):
            client.complete("hello there", max_tokens=4, temperature=-1.0)
        http_disconnect(system.http_url, client.model_info().model_name)
    wait_until(lambda: idle(system), 5.0, "every request ended")
    time.sleep(0.5)  # a late log line would come now
    found = {name: [x for x in lines if noisy(x)] for name, lines in new_lines(system).items()}
    assert not any(found.values()), {name: lines[:4] for name, lines in found.items() if lines}
