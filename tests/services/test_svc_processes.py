"""Worker processes: ready line, registration with a real control plane, Generate through the
front door in both modes, drain on SIGTERM."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from svc_harness import LoopThread, svc_loop, svc_model_dir, wait_until

from control_plane.config import ControlConfig
from control_plane.server import ControlServer
from kvmesh import LLM, SamplingParams
from kvmesh.security import Security
from kvmesh.service.server import READY_PREFIX
from kvmesh.v1 import generation_pb2, generation_pb2_grpc

__all__ = ["svc_loop", "svc_model_dir"]
ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(30, 75))


TOKEN = "svc-processes-cluster-token"


def spawn(module: str, model: Path, control: str, *extra: str) -> subprocess.Popen[str]:
    """A worker process given the cluster token in its environment."""
    code = f"import sys; from {module} import run; sys.exit(run(sys.argv[1:]))"
    args = ["--model", str(model), "--control", control, "--num-kv-blocks", "48"]
    args += ["--max-model-len", "256", "--num-threads", "1", "--metrics-port", "0", *extra]
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONPATH": f"{ROOT}:{ROOT}/kernels",
           "KVMESH_CLUSTER_TOKEN": TOKEN}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def ready_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    """The worker's KVMESH_READY line, read with a deadline."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 0.2)
        if readable:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                info: dict[str, Any] = json.loads(line[len(READY_PREFIX) :])
                return info
    proc.kill()
    pytest.fail(f"worker not ready within {timeout}s (exit code {proc.poll()})")


def stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def control(svc_loop: LoopThread) -> Any:
    async def start() -> ControlServer:  # grpc.aio binds to the loop it is created on
        config = ControlConfig(host="127.0.0.1", port=0, internal_port=0, drain_seconds=1.0,
                               security=Security(token=TOKEN))  # fmt: skip
        server = ControlServer(config)
        await server.start()
        return server

    server = svc_loop.run(start())
    yield server
    svc_loop.run(server.stop())


def generate(address: str, rid: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            request_id=rid,
            token_ids=generation_pb2.TokenIds(ids=PROMPT),
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=6),
        )
        return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


@pytest.mark.slow
def test_workers_register_serve_and_drain(
    control: ControlServer, svc_model_dir: Path, svc_loop: LoopThread
) -> None:
    llm = LLM(str(svc_model_dir), num_kv_blocks=48, max_model_len=256, num_threads=1)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))
    procs = [
        spawn(
            "prefill_svc.main", svc_model_dir, control.internal_address, "--transfer-backend", "shm"
        ),
        spawn(
            "decode_svc.main", svc_model_dir, control.internal_address, "--transfer-backend", "shm"
        ),
    ]
    try:
        infos = [ready_line(p) for p in procs]
        assert [i["role"] for i in infos] == ["prefill", "decode"]
        assert "shm" in infos[1]["transfer_endpoints"]
        registry = control.cluster.registry
        wait_until(lambda: len(registry.alive()) == 2, 10.0, "both workers registered")
        assert generate(control.address, "disagg") == expected[0].outputs[0].token_ids
    finally:
        codes = [stop(p) for p in procs]
    assert codes == [0, 0]
