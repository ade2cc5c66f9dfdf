"""`kvmesh up` and its environment: the API keys the control plane reads from it
(KVMESH_API_KEY, KVMESH_API_KEY_FILE) are the ones its own client presents, KVMESH_NUM_THREADS
sets the threads per worker, and stopping twice is harmless."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.cli.main import build_parser
from kvmesh.cli.supervisor import Supervisor
from kvmesh.cli.up import config_from_args
from kvmesh.models.tiny import tiny_model_path

KVMESH = [sys.executable, "-m", "kvmesh.cli.main"]


def test_demo_presents_the_api_key_of_the_environment() -> None:
    """`kvmesh up --demo` with KVMESH_API_KEY set: the door requires it and the demo passes."""
    env = {**os.environ, "KVMESH_API_KEY": "k" * 32}
    env.pop("KVMESH_API_KEY_FILE", None)
    argv = [*KVMESH, "up", "--demo", "--max-tokens", "4", "--model", str(tiny_model_path()),
            "--threads", "1", "--startup-timeout", "150"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


def test_num_threads_variable_sets_the_threads_per_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVMESH_NUM_THREADS is the default of --threads; the flag wins; a bad value is named."""
    parse = build_parser().parse_args
    monkeypatch.setenv("KVMESH_NUM_THREADS", "3")
    assert config_from_args(parse(["up"])).worker_threads() == 3
    assert config_from_args(parse(["up", "--threads", "2"])).worker_threads() == 2
    monkeypatch.setenv("KVMESH_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="KVMESH_NUM_THREADS"):
        config_from_args(parse(["up"]))


def test_supervisor_close_twice_leaves_other_descriptors_alone() -> None:
    """A second `close` neither fails nor closes a descriptor that reused the watchdog's."""
    supervisor = Supervisor(grace=1.0)
    watch_fd = supervisor._watch_fd
    supervisor.close()
    read_end, write_end = os.pipe()  # the lowest free numbers: the watchdog's comes back
    try:
        supervisor.close()
        for fd in (read_end, write_end):
            os.fstat(fd)  # still open (EBADF had `close` closed the number again)
        assert watch_fd in (read_end, write_end)  # the case this test is about
    finally:
        os.close(read_end)
        os.close(write_end)
