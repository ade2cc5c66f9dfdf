"""Process supervision: ready lines, bounded stop, and no orphans when the supervisor dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvmesh.cli.supervisor import ChildFailed, Supervisor

# Prints a ready line, then ignores SIGTERM and sleeps (a child that will not stop by itself).
STUBBORN = textwrap.dedent(
    """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("READY pid", flush=True)
    time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of a dead parent is reaped by init quickly; read its state
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1].startswith("Z")


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < end:
        alive = [p for p in alive if not _gone(p)]
        time.sleep(0.05)
    return alive


def test_ready_line_and_bounded_stop_of_a_child_ignoring_sigterm() -> None:
    supervisor = Supervisor(grace=1.0)
    try:
        child = supervisor.start("stubborn", [sys.executable, "-c", STUBBORN])
        match = supervisor.wait_for(child, r"READY (\w+)", time.monotonic() + 30)
        assert match.group(1) == "pid"
        start = time.monotonic()
        code = supervisor.stop(child, grace=0.5)
        assert code == -signal.SIGKILL
        assert time.monotonic() - start < 5
    finally:
        supervisor.close()


def test_wait_for_reports_an_exited_child_with_its_output() -> None:
    supervisor = Supervisor(grace=1.0)
    try:
        child = supervisor.start(
            "crash", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
        )
        with pytest.raises(ChildFailed, match="exited with 3") as failure:
            supervisor.wait_for(child, "never printed", time.monotonic() + 30)
        assert "boom" in str(failure.value)
    finally:
        supervisor.close()


def test_children_die_when_the_supervisor_is_killed() -> None:
    """SIGKILL of the supervising process: the watchdog stops its children (even stubborn)."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from kvmesh.cli.supervisor import Supervisor
        s = Supervisor(grace=1.0)
        for name in ("a", "b"):
            c = s.start(name, [sys.executable, "-c", {STUBBORN!r}])
            s.wait_for(c, "READY", time.monotonic() + 30)
            print(c.pid, flush=True)
        print("ALL", flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        for line in parent.stdout:
            if line.strip() == "ALL":
                break
            pids.append(int(line))
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        parent.kill()
        parent.wait()
        assert _wait_gone(pids, 10.0) == []
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
