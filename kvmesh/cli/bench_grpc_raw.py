"""The `grpc_raw` row of `kvmesh bench transfer`: what gRPC's Python binding alone moves here.

A peer process driven by JSON lines on stdin, like `kv_transfer.peer`, on the same footing as
the `grpc` row's peers (a `grpc.aio` server on uvloop receiving on its event loop thread, a
synchronous channel sending one client stream of fresh 2 MiB `bytes` messages to a raw-bytes
method, glibc's thresholds raised as the backend does) but with none of the KV work: no
header, no gather out of a cache, no xxh3, no scatter into one; the receiver only counts
bytes. The `grpc` row over this one is how much of gRPC's ceiling the transfer reaches.

`python -m kvmesh.cli.bench_grpc_raw` prints `{"address": ...}`, then answers `connect`
(`address`), `expect` (nothing to reserve), `send` (`bytes`: streams that many; replies
`state` and `seconds`) and `quit`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from kv_transfer.backends.grpc_stream import new_event_loop
from kv_transfer.heap import keep_frames_in_heap
from kv_transfer.interface import DEFAULT_FRAME_BYTES
from kv_transfer.peer import reply
from kvmesh.v1 import wire

keep_frames_in_heap()
METHOD = "/kvmesh.bench.RawBytes/Push"
MESSAGE_BYTES = 8 << 20  # the backend's default message limit


async def _count(messages: AsyncIterator[bytes], context: Any) -> bytes:
    total = 0
    async for message in messages:
        total += len(message)
    return total.to_bytes(8, "little")


def _serve(ready: threading.Event, port: list[int]) -> None:
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    server = grpc.aio.server(options=wire.server_options(MESSAGE_BYTES, 300.0))
    handler = grpc.stream_unary_rpc_method_handler(_count)  # bytes in, bytes out
    service, method = METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port.append(server.add_insecure_port("127.0.0.1:0"))
    loop.run_until_complete(server.start())
    ready.set()
    loop.run_forever()


def _messages(nbytes: int, frame: int) -> Iterator[bytes]:
    """Fresh messages of `frame` bytes (the last one shorter), as the sender makes each frame."""
    for offset in range(0, nbytes, frame):
        yield bytes(min(frame, nbytes - offset))


def _send(push: Any, nbytes: int) -> dict[str, Any]:
    """Stream `nbytes`; COMPLETED when the receiver counted exactly that many, else FAILED
    (a failed call names its status code)."""
    start = time.perf_counter()
    try:
        answer = push(_messages(nbytes, DEFAULT_FRAME_BYTES), timeout=600)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        return {"state": "FAILED", "error": str(code)}
    seconds = time.perf_counter() - start
    received = int.from_bytes(answer, "little")
    state = "COMPLETED" if received == nbytes else "FAILED"
    return {"state": state, "seconds": seconds, "bytes": received}


def main() -> None:
    ready, port = threading.Event(), list[int]()
    threading.Thread(target=_serve, args=(ready, port), daemon=True).start()
    if not ready.wait(10):
        raise SystemExit("grpc_raw: the server did not start")
    reply({"address": f"127.0.0.1:{port[0]}"})
    push = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "connect":
            channel = grpc.insecure_channel(
                command["address"], options=wire.client_options(MESSAGE_BYTES)
            )
            push = channel.stream_unary(METHOD, None, None)  # bytes both ways
            reply({"ok": True})
        elif op == "expect":
            reply({"ok": True})
        elif op == "send" and push is not None:
            reply(_send(push, int(command["bytes"])))
        else:
            reply({"error": f"unknown or out-of-order op {op!r}"})


if __name__ == "__main__":
    main()
