"""`kvmesh serve control` as a real process: it serves health, and drains on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)  # bounds the blocking readline below
def test_serve_control_answers_health_and_exits_cleanly_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli.main", "serve", "control", "--port", "0",
         "--reflection", "--drain-seconds", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once serving
        assert "listening on" in line, process.stderr.read() if process.stderr else ""
        address = line.split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            generation = stub.Check(
                health_pb2.HealthCheckRequest(service="kvmesh.v1.GenerationService"), timeout=5
            )
            assert generation.status == health_pb2.HealthCheckResponse.NOT_SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
