"""`kvmesh serve control` as a real process: it serves health, and drains on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.config import ControlConfig
from control_plane.limits import RequestLimits
from control_plane.main import TUNABLES, build_parser, config_from_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)  # bounds the blocking readline below
def test_serve_control_answers_health_and_exits_cleanly_on_sigterm() -> None:
    env = {**os.environ, "KVMESH_CLUSTER_TOKEN": "t" * 32}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli.main", "serve", "control", "--port", "0",
         "--internal-port", "0", "--reflection", "--drain-seconds", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        internal = process.stdout.readline()
        assert "internal ControlService on" in internal, process.stderr and process.stderr.read()
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


def test_every_flag_sets_its_config_field() -> None:
    argv = ["--host", "0.0.0.0", "--port", "7000", "--internal-port", "7001",
            "--reflection", "--metrics-port", "9100", "--insecure-no-auth",
            "--transfer-backends", "shm,,grpc", "--max-inflight", "3", "--lease-seconds", "2",
            "--heartbeat-interval", "0.25", "--reservation-lease", "7",
            "--max-request-seconds", "60", "--drain-seconds", "4",
            "--drain-token-seconds", "0.1", "--retry-after-ms", "50",
            "--max-message-bytes", "2048", "--worker-max-message-bytes", "4096",
            "--max-http-body-bytes", "8192", "--max-prompt-bytes", "100",
            "--max-connection-idle-seconds", "30", "--max-n", "2"]  # fmt: skip
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.host, config.port, config.reflection, config.metrics_port) == (
        "0.0.0.0", 7000, True, 9100
    )  # fmt: skip
    assert (config.internal_port, config.security.token) == (7001, None)
    assert config.transfer_backends == ("shm", "grpc")
    tunables = {name: getattr(config, name) for name, _ in TUNABLES.values()}
    assert tunables == {
        "max_inflight": 3, "lease_seconds": 2.0, "heartbeat_interval_seconds": 0.25,
        "reservation_lease_seconds": 7.0, "max_request_seconds": 60.0, "drain_seconds": 4.0,
        "drain_token_seconds": 0.1,
        "retry_after_ms": 50, "max_message_bytes": 2048, "worker_max_message_bytes": 4096,
        "max_http_body_bytes": 8192, "max_connection_idle_seconds": 30.0,
    }  # fmt: skip
    assert (config.limits.max_prompt_bytes, config.limits.max_n) == (100, 2)
    assert config.limits.max_messages == RequestLimits().max_messages
    assert config.reap_interval_seconds == 0.5


def test_out_of_range_flag_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    from control_plane.main import run

    assert run(["--heartbeat-interval", "5", "--insecure-no-auth"]) == 2
    assert "heartbeat_interval_seconds is out of range" in capsys.readouterr().err
    assert run(["--max-n", "0", "--insecure-no-auth"]) == 2
    assert "max_n must be at least 1" in capsys.readouterr().err


def test_a_heartbeat_interval_over_a_third_of_the_lease_is_refused_naming_it() -> None:
    """The lease must outlast one heartbeat lost without an answer: the heartbeat that renewed
    it, the lost one and its retry, three intervals, fit in it."""
    argv = ["--lease-seconds", "3", "--heartbeat-interval", "1.5", "--insecure-no-auth"]
    with pytest.raises(ValueError, match=r"^heartbeat_interval_seconds is out of range: .*third"):
        config_from_args(build_parser().parse_args(argv))
    for lease, interval in ((3.0, 1.0), (0.3, 0.1), (2.0, 0.5)):
        config = ControlConfig(
            lease_seconds=lease, heartbeat_interval_seconds=interval, reap_interval_seconds=0.1
        )
        assert config.heartbeat_interval_seconds == interval
