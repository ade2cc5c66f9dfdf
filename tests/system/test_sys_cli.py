"""`kvmesh up` as a command (gRPC-stream transfer), `kvmesh generate --target`, `--demo`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

from sys_harness import GREEDY, free_port, sample, total

from kvmesh.cli.supervisor import Supervisor
from kvmesh.models.tiny import tiny_model_path

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
PROMPTS = [[5, 9, 2], list(range(3, 40))]


def _generate(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*KVMESH, "generate", "--target", endpoint, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _generate_json(endpoint: str, prompt: list[int]) -> dict[str, Any]:
    ids = ",".join(map(str, prompt))
    done = _generate(endpoint, "--prompt-ids", ids, "--max-tokens", str(GREEDY["max_tokens"]),
                     "--temperature", "0", "--ignore-eos", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    line: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return line


def test_up_generate_parity_over_grpc_transfer_and_sigterm(offline: Any) -> None:
    port, http_port = free_port(), free_port()
    supervisor = Supervisor(grace=20.0)
    try:
        argv = [*KVMESH, "up", "--port", str(port), "--http-port", str(http_port),
                "--transfer-backend", "grpc", "--model", str(tiny_model_path())]  # fmt: skip
        up = supervisor.start("up", argv)
        deadline = time.monotonic() + 240
        endpoint = supervisor.wait_for(up, r"front door (\S+)", deadline).group(1)
        assert endpoint == f"127.0.0.1:{port}"
        http = supervisor.wait_for(up, r"OpenAI-compatible API on (\S+)", deadline).group(1)
        assert http == f"http://127.0.0.1:{http_port}/v1"
        control = supervisor.wait_for(up, r"control plane metrics http://(\S+)/metrics", deadline)
        metrics = supervisor.wait_for(up, r"prefill-0: \S+ \(metrics (\S+)\)", deadline).group(1)

        lines = [_generate_json(endpoint, p) for p in PROMPTS]
        assert [line["token_ids"] for line in lines] == offline(PROMPTS)
        for line in lines:
            assert line["finish_reason"] == "length"
            assert line["usage"]["completion_tokens"] == GREEDY["max_tokens"]
            assert line["usage"]["prompt_tokens"] in (3, 37)
        assert sample(metrics, "kvmesh_kv_transfer_bytes_total", backend="grpc") > 0
        ok = sample(control.group(1), "kvmesh_control_requests_total", status="OK")
        tokens = total(control.group(1), "kvmesh:generation_tokens_total")
        assert (ok, tokens) == (len(PROMPTS), len(PROMPTS) * GREEDY["max_tokens"])

        bad = _generate(endpoint, "hello", "--top-p", "0")
        assert bad.returncode == 2 and "top_p" in bad.stderr

        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=30) == 0
        supervisor.wait_for(up, "kvmesh up: stopped", time.monotonic() + 5)
    finally:
        supervisor.close()


def test_demo_runs_one_request_and_exits_zero() -> None:
    argv = [*KVMESH, "up", "--demo", "--max-tokens", "8", "--model", str(tiny_model_path())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout and "prefill" in done.stdout and "stopped" in done.stdout
