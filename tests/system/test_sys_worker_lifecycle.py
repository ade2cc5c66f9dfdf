"""A worker's life at its edges: a drain keeps the port open (health NOT_SERVING, new work
refused UNAVAILABLE "draining", in-flight streams finish, exit 0, and `kvmesh up`'s keeper gives
it the draining bound); a stop signal while the model loads ends the worker without serving;
a busy port fails before the model loads, naming its flag, leaving nothing behind; a control
plane back after a long outage has its workers again within seconds."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sys_harness import CONTROL_ARGS, live_workers, wait_until

from kvmesh.cli.restarts import RestartPolicy
from kvmesh.cli.up import LocalSystem, UpConfig
from kvmesh.client import Client, KvmeshError
from kvmesh.models.tiny import tiny_model_path
from kvmesh.security.credentials import bearer_metadata
from tests.ports import held_port

PROMPT = [(7 * i) % 500 + 1 for i in range(40)]
MAX_MODEL_LEN = 2048
DRAIN_ARGS = ("--num-kv-blocks", "256", "--drain-seconds", "20", "--max-model-len", "2048")
KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
TOKEN_ENV = {**os.environ, "KVMESH_CLUSTER_TOKEN": "t" * 32, "PYTHONUNBUFFERED": "1"}


def _stream(endpoint: str, max_tokens: int, out: dict[str, Any]) -> None:
    """Stream one greedy request, recording its token count, first token time and error."""
    out["tokens"] = 0
    try:
        with Client(endpoint, timeout=120) as client:
            chunks = client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0)
            for chunk in chunks:
                out["tokens"] += len(chunk.token_ids)
                out.setdefault("first", time.monotonic())
    except KvmeshError as error:
        out["error"] = error


def _seconds_of_tokens(endpoint: str, seconds: float) -> int:
    """How many tokens one stream produces in about `seconds` (within the model length)."""
    started = time.monotonic()
    _stream(endpoint, 200, {})
    rate = 200 / (time.monotonic() - started)
    return int(min(MAX_MODEL_LEN - len(PROMPT) - 8, max(200, rate * seconds)))


def _health(address: str) -> str:
    """The worker's overall health status by name, or "error CODE" when the call fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError as error:
            return f"error {error.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _new_work(address: str, token: str) -> grpc.RpcError | None:
    """Call PrefillService.Prepare (empty bytes) with the cluster token; its error, if any."""
    with grpc.insecure_channel(address) as channel:
        prepare = channel.unary_unary("/kvmesh.v1.PrefillService/Prepare", None, None)
        try:
            prepare(b"", timeout=5.0, metadata=bearer_metadata(token))
        except grpc.RpcError as error:
            return error
    return None


def test_a_draining_worker_answers_health_refuses_new_work_and_finishes_its_streams() -> None:
    """SIGTERM to a colocated worker under `kvmesh up`'s keeper (wedge bound 1 s): health reads
    NOT_SERVING, Prepare is UNAVAILABLE "draining", the in-flight stream (longer than the wedge
    bound) completes and the worker exits 0 by itself, not SIGKILLed as wedged."""
    policy = RestartPolicy(
        wedged_seconds=1.0, draining_seconds=30.0, probe_timeout=0.5, backoff_initial=0.5
    )
    config = UpConfig(
        model=str(tiny_model_path()), prefill=0, decode=0, colocated=1, port=0, restart=policy,
        startup_timeout=240.0, drain_seconds=2.0, control_args=CONTROL_ARGS,
        worker_args=DRAIN_ARGS,
    )  # fmt: skip
    with LocalSystem(config) as system:
        endpoint = system.endpoint
        worker = system.workers[0]
        address, token = worker.ready["address"], system.env["KVMESH_CLUSTER_TOKEN"]
        count = _seconds_of_tokens(endpoint, 4.0)
        out: dict[str, Any] = {}
        streaming = threading.Thread(target=_stream, args=(endpoint, count, out), daemon=True)
        streaming.start()
        deadline = time.monotonic() + 30
        while "first" not in out and streaming.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "first" in out, out
        os.killpg(worker.child.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert worker.child.alive(), "the drain ended before the checks"
        status, refused = _health(address), _new_work(address, token)
        code = worker.child.process.wait(40)
        streaming.join(30)
    assert status == "NOT_SERVING"
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in (refused.details() or "")
    assert out.get("error") is None and out["tokens"] == count, out
    assert code == 0


OUTAGE_SECONDS = 30.0  # a rescheduled control plane pod; gRPC's own backoff reached ~16 s steps


def test_workers_reregister_within_seconds_after_a_long_control_plane_outage() -> None:
    """The control plane killed and started again (same ports) only after 30 s: its worker
    registers again within a few seconds, as after a quick restart. The agent's channel used
    gRPC's default reconnect backoff (growing to 120 s; a call made meanwhile fails without
    trying), so the worker found the new control plane only at its next reconnect attempt:
    about 12 s here, up to 2 minutes after a longer outage, every request refused meanwhile."""
    config = UpConfig(
        model=str(tiny_model_path()), prefill=0, decode=0, colocated=1, port=0,
        startup_timeout=240.0, drain_seconds=2.0, control_args=CONTROL_ARGS,
        worker_args=DRAIN_ARGS,
    )  # fmt: skip
    with LocalSystem(config) as system:
        assert system.control is not None
        system.supervisor.kill(system.control)
        time.sleep(OUTAGE_SECONDS)
        system.start_control(time.monotonic() + 60)
        took = wait_until(lambda: _live_colocated(system) == 1, 60, "the worker re-registered")
        with Client(system.endpoint, timeout=30) as client:
            client.complete(PROMPT, max_tokens=2, temperature=0)
    assert took < 6.0, f"the worker re-registered {took:.1f} s after the control plane was back"


def _live_colocated(system: LocalSystem) -> float:
    try:
        return live_workers(system, "colocated")
    except OSError:  # its metrics port not answering yet
        return -1.0


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (killed, with their group, if still running at the end)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _start(
    argv: list[str], started: list[subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `argv` in its own session; its output lines are collected by a thread."""
    process = subprocess.Popen(
        argv, env=TOKEN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    started.append(process)
    lines: list[str] = []
    threading.Thread(target=_collect, args=(process, lines), daemon=True).start()
    return process, lines


def _collect(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stdout is not None
    lines.extend(process.stdout)


def test_sigterm_while_the_model_loads_ends_the_worker_without_serving(
    processes: list[subprocess.Popen[str]],
) -> None:
    """A worker signalled while it loads its model exits 0 once the load ends, never printing
    its ready line (nor serving or registering)."""
    argv = [*KVMESH, "serve", "colocated", "--model", str(tiny_model_path()), "--port", "0",
            "--num-threads", "1", "--control", f"127.0.0.1:{_unused_port()}"]  # fmt: skip
    process, lines = _start(argv, processes)
    deadline = time.monotonic() + 60
    while not any("kvmesh.engine.loader" in line for line in lines):
        assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    code = process.wait(60)
    time.sleep(0.2)  # the reader thread takes the last lines
    output = "".join(lines)
    assert "KVMESH_READY" not in output, output[-1500:]
    assert code == 0, output[-1500:]


def _unused_port() -> int:
    """A port nothing listens on (a --control that is never reached)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    with held_port() as port:
        yield port


@pytest.mark.parametrize(
    ("flag", "backend"),
    [("--port", "shm"), ("--metrics-port", "shm"), ("--transfer-port", "grpc"),
     ("--transfer-port", "gloo")],
)  # fmt: skip
def test_a_busy_worker_port_fails_before_the_model_loads(
    busy_port: int, flag: str, backend: str
) -> None:
    """`kvmesh serve decode` with a busy port: exit 2 with "kvmesh serve decode: FLAG: cannot
    bind HOST:PORT: reason", before the model loads, no traceback, no socket folder left (a
    busy --transfer-port used to start the worker without that KV receiver)."""
    before = set(glob.glob("/tmp/kvmesh-*"))
    argv = [*KVMESH, "serve", "decode", "--model", str(tiny_model_path()), "--num-threads", "1",
            "--transfer-backend", backend, flag, str(busy_port)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=TOKEN_ENV)
    leaked = set(glob.glob("/tmp/kvmesh-*")) - before
    expected = f"kvmesh serve decode: {flag}: cannot bind 127.0.0.1:{busy_port}: "
    assert done.returncode == 2, done.stderr[-800:]
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr[-800:]
    assert "kvmesh.engine.loader" not in done.stdout + done.stderr
    assert not leaked
