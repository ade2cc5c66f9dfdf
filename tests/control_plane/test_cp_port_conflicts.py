"""`kvmesh serve control` and busy ports: every port is bound before anything serves, a busy
one is exit 2 with "kvmesh serve control: FLAG: cannot bind HOST:PORT: reason" (no traceback),
and a port another control plane serves is never shared (no SO_REUSEPORT)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.ports import held_port

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]
ENV = {**os.environ, "KVMESH_CLUSTER_TOKEN": "c" * 32, "PYTHONUNBUFFERED": "1"}
FLAGS = ("--port", "--internal-port", "--metrics-port", "--http-port")


def _control(**ports: int) -> list[str]:
    """`kvmesh serve control` on free ports but those in `ports` (flag without dashes)."""
    argv = [*KVMESH, "serve", "control", "--port", "0", "--internal-port", "0"]
    for name, port in ports.items():
        argv += [f"--{name.replace('_', '-')}", str(port)]
    return argv


@pytest.fixture
def busy_port() -> Iterator[int]:
    with held_port() as port:
        yield port


@pytest.mark.parametrize("flag", FLAGS)
def test_a_busy_port_is_exit_2_naming_its_flag(busy_port: int, flag: str) -> None:
    """Each port flag on a busy port: one line naming the flag and the address, exit 2."""
    argv = _control(**{flag[2:].replace("-", "_"): busy_port})
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=ENV)
    expected = f"kvmesh serve control: {flag}: cannot bind 127.0.0.1:{busy_port}: "
    assert done.returncode == 2, done.stderr[-800:]
    assert expected in done.stderr, done.stderr[-800:]
    assert "Traceback" not in done.stderr and "listening on" not in done.stdout


def test_a_second_control_plane_on_a_served_port_is_refused() -> None:
    """A control plane on the front-door port of another one exits 2 instead of sharing it."""
    first = subprocess.Popen(
        _control(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
        start_new_session=True,
    )  # fmt: skip
    try:
        port = _listening_port(first, time.monotonic() + 30)
        done = subprocess.run(
            _control(port=port), capture_output=True, text=True, timeout=30, env=ENV
        )
        assert done.returncode == 2, done.stdout[-800:]
        assert f"--port: cannot bind 127.0.0.1:{port}: " in done.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)


def _listening_port(process: subprocess.Popen[str], deadline: float) -> int:
    """The front-door port `process` reports on its "listening on" line."""
    assert process.stdout is not None
    while time.monotonic() < deadline:
        match = re.search(r"listening on \S+:(\d+)", process.stdout.readline())
        if match:
            return int(match.group(1))
        assert process.poll() is None, "the control plane exited"
    raise AssertionError("the control plane never listened")
