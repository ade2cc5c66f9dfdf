"""`kvmesh bench transfer`: KV transfer bandwidth per backend beside a plain memory copy.

The same block set (`--mib` of bfloat16 blocks) moves from a sender process to a receiver
process (`kv_transfer.peer`) over each backend; the baseline is one torch copy of the same bytes
in this process. Shared memory runs in both modes, registered (one copy into the receiver's
cache) and staging (slots), each also with payload checksums (`+xxh3`) to show what integrity
costs; gloo and gRPC run with their default checksums on. The gRPC stream is also compared
with sending the bytes as ONE message, and with `grpc_raw`: the same bytes through gRPC alone
(`kvmesh.cli.bench_grpc_raw`: no header, gather, hash or scatter), the ceiling of gRPC's Python
binding on this machine.
Every peer pair is connected and warmed up first; then each of `--repeat` rounds times one
memcpy and one transfer per backend back to back, so a round's ratios share the machine's load.
The report keeps each row's best run and the range of its per-round ratios.
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
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (best is kept)")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated rows of {', '.join(ROWS)}"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


# row -> (backend, sender options); a row's receiver cache is in shared memory for shm
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "shm": ("shm", {"mode": "registered", "checksum": False}),
    "shm+xxh3": ("shm", {"mode": "registered", "checksum": True}),
    "shm_staging": ("shm", {"mode": "staging", "checksum": False}),
    "shm_staging+xxh3": ("shm", {"mode": "staging", "checksum": True}),
    "gloo": ("gloo", {}),
    "grpc": ("grpc", {}),
    "grpc_unary": ("grpc", {}),
    "grpc_raw": ("grpc_raw", {"checksum": False}),  # the option only labels the report
}
TARGETS = {"shm": 0.85, "grpc": 0.25, "gloo": 0.25}  # vs memcpy of the same bytes


class _Peer:
    def __init__(self, backend: str, store: dict[str, Any], **config: Any) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = ["kvmesh.cli.bench_grpc_raw"]  # gRPC alone: no cache, no options
        if backend != "grpc_raw":
            spec = json.dumps({"backend": backend, "store": store, **config})
            command = ["kv_transfer.peer", spec]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *command],
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


def _memcpy_seconds(src: Any, dst: Any) -> float:
    """One warm copy: an untimed copy first faults in the pages a host that reclaims idle
    memory (proactive reclaim in VMs) took back since the previous round; the baseline is
    what memory moves at, not the page faults (which the transfer rows still pay)."""
    dst.copy_(src)
    return _timed(lambda: dst.copy_(src))


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Pair:
    """A connected receiver/sender pair for one row; `op` is "send" or "unary" (gRPC)."""

    def __init__(self, row: str, blocks: int) -> None:
        backend, options = ROWS[row]
        op = "unary" if row == "grpc_unary" else "send"
        store = {**BLOCK, "num_blocks": blocks, "dtype": "bfloat16"}
        receiver_options: dict[str, Any] = {}
        if op == "unary":
            limit = blocks * BLOCK_BYTES + (1 << 20)
            options = {**options, "max_message_bytes": limit}
            receiver_options = {"max_message_bytes": limit}
        self.name, self.op, self.ids = row, op, list(range(blocks))
        self.nbytes = blocks * BLOCK_BYTES
        self.receiver = _Peer(backend, {**store, "seed": 1}, receiver_options=receiver_options)
        self.sender = _Peer(backend, {**store, "seed": 2})
        if self.sender.call("connect", address=self.receiver.address, options=options) != {
            "ok": True
        }:
            raise RuntimeError(f"{backend}: connect failed")

    def seconds(self) -> float:
        tid = os.urandom(16).hex()
        self.receiver.call("expect", tid=tid, epoch=1, dst=self.ids, seconds=600)
        result = self.sender.call(
            self.op, tid=tid, epoch=1, src=self.ids, dst=self.ids, seconds=600, bytes=self.nbytes
        )
        if result.get("state") != "COMPLETED":
            raise RuntimeError(f"{self.name} {self.op}: {result}")
        return float(result["seconds"])

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)  # every process single-threaded: same footing as the peers
    blocks = max(1, (args.mib << 20) // BLOCK_BYTES)
    nbytes = blocks * BLOCK_BYTES
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    _memcpy_seconds(src, dst)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {sorted(ROWS)}")
    pairs: dict[str, _Pair] = {}
    try:
        for row in rows:
            pairs[row] = _Pair(row, blocks)
        for pair in pairs.values():  # warm-up: connections, pages, buffers
            pair.seconds()
        times: dict[str, list[float]] = {"memcpy": [], **{name: [] for name in pairs}}
        for _ in range(args.repeat):
            times["memcpy"].append(_memcpy_seconds(src, dst))
            for name, pair in pairs.items():
                times[name].append(pair.seconds())
    finally:
        for pair in pairs.values():
            pair.close()
    report = _report(nbytes, times)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"KV transfer of {nbytes / 2**20:.0f} MiB ({blocks} blocks of {BLOCK_BYTES >> 10} KiB), "
        f"bfloat16, best of {args.repeat} rounds, ISA {report['isa']}, "
        f"load average {report['load_average']}"
    )
    for name, gbps in report["gbps"].items():
        if name == "memcpy":
            print(f"  {name:<12} {gbps:7.2f} GB/s")
            continue
        lo, hi = report["vs_memcpy_range"][name]
        ratio = report["vs_memcpy"][name]
        target = f"  (target {TARGETS[name]:.2f}x)" if name in TARGETS else ""
        print(
            f"  {name:<17} {gbps:7.2f} GB/s   {ratio:5.2f}x memcpy "
            f"(rounds {lo:.2f}-{hi:.2f}x){target}"
        )
    if "grpc_stream_vs_unary" in report:
        print(f"  gRPC stream vs one message: {report['grpc_stream_vs_unary']:.2f}x")
    if "grpc_stream_vs_raw" in report:
        print(f"  gRPC stream vs gRPC alone (grpc_raw): {report['grpc_stream_vs_raw']:.2f}x")
    return 0


def _report(nbytes: int, times: dict[str, list[float]]) -> dict[str, Any]:
    from kvmesh_kernels.cpu_build import isa_text, machine

    best = {name: nbytes / min(ts) / 1e9 for name, ts in times.items()}
    rounds = {
        name: [m / t for m, t in zip(times["memcpy"], ts, strict=True)]
        for name, ts in times.items()
        if name != "memcpy"
    }
    report: dict[str, Any] = {
        "bytes": nbytes,
        "dtype": "bfloat16",
        "isa": isa_text(machine()),
        "load_average": round(os.getloadavg()[0], 2),
        "memcpy_gbps": round(best["memcpy"], 3),
        "gbps": {k: round(v, 3) for k, v in best.items()},
        "vs_memcpy": {k: round(v / best["memcpy"], 3) for k, v in best.items() if k != "memcpy"},
        "vs_memcpy_range": {k: [round(min(r), 3), round(max(r), 3)] for k, r in rounds.items()},
        "targets": {k: v for k, v in TARGETS.items() if k in best},
        "checksums": {row: ROWS[row][1].get("checksum", True) for row in best if row in ROWS},
    }
    if "shm" in best and "shm_staging" in best:
        report["registered_vs_staging"] = round(best["shm"] / best["shm_staging"], 2)
    if "grpc" in best and "grpc_unary" in best:
        report["grpc_stream_vs_unary"] = round(best["grpc"] / best["grpc_unary"], 2)
    if "grpc" in best and "grpc_raw" in best:
        report["grpc_stream_vs_raw"] = round(best["grpc"] / best["grpc_raw"], 2)
    return report
