"""`kvmesh bench transfer` end to end (real peer processes, 1 MiB): the gRPC stream beside gRPC
alone (`grpc_raw`) and gloo, with the memcpy rate, ISA, dtype and checksums reported."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transfer_reports_grpc_beside_grpc_alone_and_gloo() -> None:
    command = [sys.executable, "-m", "kvmesh.cli.main", "bench", "transfer", "--mib", "1"]
    command += ["--repeat", "1", "--rows", "grpc,grpc_raw,gloo", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bytes"] == 1 << 20 and report["dtype"] == "bfloat16" and report["isa"]
    assert set(report["gbps"]) == {"memcpy", "grpc", "grpc_raw", "gloo"}
    assert all(rate > 0 for rate in report["gbps"].values())
    assert report["checksums"] == {"grpc": True, "grpc_raw": False, "gloo": True}
    assert report["grpc_stream_vs_raw"] > 0
    assert report["targets"] == {"grpc": 0.25, "gloo": 0.25}


def test_bench_transfer_refuses_an_unknown_row() -> None:
    command = [sys.executable, "-m", "kvmesh.cli.main", "bench", "transfer", "--rows", "grpc,ftp"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--rows" in out.stderr and "ftp" in out.stderr
