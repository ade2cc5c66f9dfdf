"""A transfer peer process driven by JSON lines on stdin (used by tests and benchmarks).

`python -m kv_transfer.peer '{"backend": "shm", "store": {...}, "receive": true}'` builds a
`BlockStore` from the spec (random contents from `seed`), starts a receiver when asked, prints
`{"address": ...}`, then answers one JSON line per command:
`expect`, `wait`, `cancel`, `connect`, `send`, `start`, `digest`, `quit`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import xxhash

from kv_transfer import get_backend
from kv_transfer.blocks import BlockStore
from kv_transfer.errors import TransferError
from kv_transfer.registered import shared_tensors
from kv_transfer.state import TransferRequest, TransferResult


def make_store(spec: dict[str, Any]) -> BlockStore:
    """Random block-major cache (+ float32 scales when `scales`) from a seeded generator; in
    a shared region (registered memory) unless `shared` is false."""
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    shape = (
        spec["num_blocks"],
        spec["layers"],
        2,
        spec["block_size"],
        spec["heads"],
        spec["head_dim"],
    )
    cache = torch.randn(shape, generator=gen).to(getattr(torch, spec.get("dtype", "bfloat16")))
    scales = torch.rand(shape[:5], generator=gen) if spec.get("scales") else None
    model_id = spec.get("model_id", "test-model")
    if not spec.get("shared", True):
        return BlockStore(cache, scales, model_id=model_id)
    shared, shared_scales, region = shared_tensors(
        tuple(shape), cache.dtype, None if scales is None else tuple(shape[:5])
    )
    shared.copy_(cache)
    if shared_scales is not None and scales is not None:
        shared_scales.copy_(scales)
    return BlockStore(shared, shared_scales, model_id=model_id, region=region)


def digest(store: BlockStore, ids: list[int]) -> str:
    """xxh3_128 of the blocks' bytes (scales then KV), in the given order."""
    h = xxhash.xxh3_128()
    index = torch.tensor(ids, dtype=torch.int64)
    if store.scales is not None:
        h.update(store.scales.index_select(0, index).numpy().tobytes())
    h.update(store.cache.index_select(0, index).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def result_json(result: TransferResult) -> dict[str, Any]:
    error = result.error
    return {
        "state": result.state.name,
        "error": type(error).__name__ if error else None,
        "message": str(error) if error else None,
        "seconds": result.seconds,
        "bytes": result.num_bytes,
    }


def serve(config: dict[str, Any]) -> None:
    backend = get_backend(config["backend"])
    store = make_store(config["store"])
    receiver = backend.Receiver(store, **config.get("receiver_options", {}))
    sender = None
    handles: dict[str, Any] = {}
    reply({"address": receiver.address})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            sender = _command(cmd, backend, store, receiver, sender, handles)
        except TransferError as exc:
            reply({"error": type(exc).__name__, "field": getattr(exc, "field", None)})
    receiver.close()


def _command(
    cmd: dict[str, Any], backend: Any, store: BlockStore, receiver: Any, sender: Any, handles: dict
) -> Any:
    """Run one command and reply; returns the (possibly new) sender."""
    op = cmd["op"]
    if op == "maps":  # shared-memory segments this process still maps
        with open(f"/proc/{os.getpid()}/maps") as maps:
            reply({"maps": sorted({ln.split()[5] for ln in maps if "kvmesh_" in ln})})
    elif op == "expect":
        req = TransferRequest(bytes.fromhex(cmd["tid"]), cmd["epoch"])
        handles[cmd["tid"]] = receiver.expect(req, cmd["dst"], time.monotonic() + cmd["seconds"])
        reply({"ok": True})
    elif op == "wait":
        reply(result_json(handles[cmd["tid"]].wait()))
    elif op == "state":  # without waiting: a receive handle has .state, a send handle .record
        handle = handles[cmd["tid"]]
        state = handle.record.state if hasattr(handle, "record") else handle.state
        reply({"state": state.name})
    elif op == "cancel":
        handles[cmd["tid"]].cancel()
        reply({"ok": True})
    elif op == "connect":
        sender = backend.Sender(store, cmd["address"], **cmd.get("options", {}))
        reply({"ok": True})
    elif op in ("send", "start"):
        assert sender is not None
        req = TransferRequest(bytes.fromhex(cmd["tid"]), cmd["epoch"])
        deadline = time.monotonic() + cmd["seconds"]
        if op == "start":
            handles[cmd["tid"]] = sender.start(req, cmd["src"], cmd["dst"], deadline=deadline)
            reply({"ok": True})
        else:
            reply(result_json(sender.send(req, cmd["src"], cmd["dst"], deadline=deadline)))
    elif op == "unary":  # gRPC only: the whole block set as one message (baseline)
        req = TransferRequest(bytes.fromhex(cmd["tid"]), cmd["epoch"])
        plan = sender.plan(req, cmd["src"], cmd["dst"])
        start = time.monotonic()
        sender.send_unary(plan, start + cmd["seconds"])
        reply({"state": "COMPLETED", "seconds": time.monotonic() - start})
    elif op == "digest":
        reply({"digest": digest(store, cmd["ids"])})
    return sender


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
