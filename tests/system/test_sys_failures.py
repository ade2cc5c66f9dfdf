"""kill -9 of workers and of the control plane: clean statuses, no hang, nothing leaked."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from sys_harness import idle, live_workers, local_system, used_blocks, wait_until

from kvmesh.cli.up import LocalSystem, Worker
from kvmesh.client import Client, KvmeshError

LONG: dict[str, Any] = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}
ENDED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED}
LEASE_BOUND = 15.0  # worker lease (2 s) + reservation lease (5 s) + margin


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[LocalSystem, str]]:
    with local_system(transfer_backend="shm", prefill=1, decode=2) as started:
        yield started


def _stream_in_background(
    endpoint: str, prompt: Any, **sampling: Any
) -> tuple[threading.Event, dict[str, Any]]:
    """Consume one long request on a thread; `first` is set at its first token."""
    first = threading.Event()
    outcome: dict[str, Any] = {}

    def consume() -> None:
        try:
            with Client(endpoint, timeout=60) as client:
                for _ in client.generate(prompt, **{**LONG, **sampling}):
                    first.set()
            outcome["result"] = "completed"
        except KvmeshError as error:
            outcome["result"] = error
        first.set()

    outcome["thread"] = threading.Thread(target=consume, daemon=True)
    outcome["thread"].start()
    return first, outcome


def _finish(outcome: dict[str, Any], seconds: float) -> Any:
    outcome["thread"].join(seconds)
    assert not outcome["thread"].is_alive(), "the request hung"
    return outcome["result"]


def _holder(system: LocalSystem, role: str) -> Worker:
    blocks = used_blocks(system)
    return max((w for w in system.workers if w.role == role and w.child.alive()),
               key=lambda w: blocks.get(w.child.name, 0))  # fmt: skip


def _serves(endpoint: str) -> None:
    with Client(endpoint, timeout=60) as client:
        assert client.complete([1, 2, 3, 4], max_tokens=4, temperature=0).finish_reason


def test_decode_killed_mid_stream(system: tuple[LocalSystem, str]) -> None:
    local, endpoint = system
    first, outcome = _stream_in_background(endpoint, list(range(1, 100)))
    assert first.wait(60)
    victim = _holder(local, "decode")
    local.supervisor.kill(victim.child)
    result = _finish(outcome, LEASE_BOUND)
    assert isinstance(result, KvmeshError) and result.code in ENDED, result
    wait_until(lambda: idle(local), LEASE_BOUND, "survivors hold no blocks")
    wait_until(lambda: live_workers(local, "decode") == 1, LEASE_BOUND, "decode death noticed")
    _serves(endpoint)


def test_prefill_killed_mid_transfer(system: tuple[LocalSystem, str]) -> None:
    local, endpoint = system
    prefill = next(w for w in local.workers if w.role == "prefill" and w.child.alive())
    prompt = [(5 * i) % 900 + 1 for i in range(1800)]  # a prefill long enough to land in
    _first, outcome = _stream_in_background(endpoint, prompt, max_tokens=100)
    wait_until(lambda: sum(used_blocks(local).values()) > 0, 30, "the request holds blocks")
    local.supervisor.kill(prefill.child)
    result = _finish(outcome, LEASE_BOUND + 60)
    if isinstance(result, KvmeshError):
        assert result.code in ENDED, result
    wait_until(lambda: idle(local), LEASE_BOUND, "survivors hold no blocks")
    wait_until(lambda: live_workers(local, "prefill") == 0, LEASE_BOUND, "death noticed")
    local.start_worker("prefill", time.monotonic() + 120)  # the next test needs one again
    wait_until(lambda: live_workers(local, "prefill") == 1, 30, "new prefill registered")
    _serves(endpoint)


def test_control_plane_restart(system: tuple[LocalSystem, str]) -> None:
    local, endpoint = system
    first, outcome = _stream_in_background(endpoint, list(range(1, 50)))
    assert first.wait(60)
    assert local.control is not None
    local.supervisor.kill(local.control)
    result = _finish(outcome, LEASE_BOUND)
    assert isinstance(result, KvmeshError) and result.code in ENDED, result
    local.start_control(time.monotonic() + 60)
    with Client(endpoint) as client:
        wait_until(client.serving, 30, "workers re-registered with the new control plane")
    _serves(endpoint)
    wait_until(lambda: idle(local), LEASE_BOUND, "no blocks held after the restart")
