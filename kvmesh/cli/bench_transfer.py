"""`kvmesh bench transfer`: KV transfer bandwidth per backend beside a plain memory copy.

The same block set (`--mib` of bfloat16 blocks) moves from a sender process to a receiver
process (`kv_transfer.peer`) over each backend; the baseline is one torch copy of the same bytes
in this process. The gRPC stream is also compared with sending the bytes as ONE message.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BLOCK = {"layers": 8, "block_size": 16, "heads": 4, "head_dim": 128}  # 256 KiB bf16 blocks
BLOCK_BYTES = 8 * 2 * 16 * 4 * 128 * 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("transfer", help="KV transfer bandwidth per backend vs memcpy")
    parser.add_argument("--mib", type=int, default=256, help="block set size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="runs per backend (best is kept)")
    parser.add_argument("--backends", default="shm,gloo,grpc", help="comma-separated backends")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


class _Peer:
    def __init__(self, backend: str, store: dict[str, Any], **config: Any) -> None:
        arg = json.dumps({"backend": backend, "store": store, **config})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kv_transfer.peer", arg],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.address = self.read()["address"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def read(self, timeout: float = 300) -> dict[str, Any]:
        return json.loads(self._lines.get(timeout=timeout))

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def _memcpy_gbps(nbytes: int, repeat: int) -> float:
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _backend_gbps(backend: str, blocks: int, repeat: int, op: str = "send") -> float:
    store = {**BLOCK, "num_blocks": blocks, "dtype": "bfloat16"}
    options: dict[str, Any] = {}
    receiver_options: dict[str, Any] = {}
    if op == "unary":
        limit = blocks * BLOCK_BYTES + (1 << 20)
        options = receiver_options = {"max_message_bytes": limit}
    receiver = _Peer(backend, {**store, "seed": 1}, receiver_options=receiver_options)
    sender = _Peer(backend, {**store, "seed": 2})
    try:
        assert sender.call("connect", address=receiver.address, options=options) == {"ok": True}
        ids = list(range(blocks))
        best = float("inf")
        for _ in range(repeat + 1):  # the first run warms up connections and pages
            tid = os.urandom(16).hex()
            receiver.call("expect", tid=tid, epoch=1, dst=ids, seconds=600)
            result = sender.call(op, tid=tid, epoch=1, src=ids, dst=ids, seconds=600)
            if result.get("state") != "COMPLETED":
                raise RuntimeError(f"{backend} {op}: {result}")
            best = min(best, result["seconds"])
        return blocks * BLOCK_BYTES / best / 1e9
    finally:
        sender.close()
        receiver.close()


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)  # every process single-threaded: same footing as the peers
    blocks = max(1, (args.mib << 20) // BLOCK_BYTES)
    nbytes = blocks * BLOCK_BYTES
    rows: dict[str, float] = {"memcpy": _memcpy_gbps(nbytes, args.repeat)}
    for backend in [b for b in args.backends.split(",") if b]:
        rows[backend] = _backend_gbps(backend, blocks, args.repeat)
        if backend == "grpc":
            rows["grpc_unary"] = _backend_gbps("grpc", blocks, args.repeat, op="unary")
    report = {
        "bytes": nbytes,
        "gbps": {k: round(v, 3) for k, v in rows.items()},
        "vs_memcpy": {k: round(v / rows["memcpy"], 3) for k, v in rows.items() if k != "memcpy"},
    }
    if "grpc" in rows and "grpc_unary" in rows:
        report["grpc_stream_vs_unary"] = round(rows["grpc"] / rows["grpc_unary"], 2)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"KV transfer of {nbytes / 2**20:.0f} MiB ({blocks} blocks of {BLOCK_BYTES >> 10} KiB)")
    for name, gbps in rows.items():
        ratio = report["vs_memcpy"].get(name, 1.0)  # type: ignore[attr-defined]
        print(f"  {name:<12} {gbps:7.2f} GB/s   {ratio:5.2f}x memcpy")
    if "grpc_stream_vs_unary" in report:
        print(f"  gRPC stream vs one message: {report['grpc_stream_vs_unary']:.2f}x")
    return 0
