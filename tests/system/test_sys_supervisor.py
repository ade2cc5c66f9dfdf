"""Process supervision: ready lines (whatever bytes come before them), bounded stop, no
orphans when the supervisor dies, and a child that exits by itself handled at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvmesh.cli.supervisor import LINES_KEPT, ChildFailed, Supervisor

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


def test_output_that_is_not_utf8_is_read_on_and_the_ready_line_seen() -> None:
    """A byte that is not UTF-8 (a Latin-1 path, a native library's message) is replaced; the
    reader goes on, so 200 KB of later output (past the pipe's 64 KiB) and the ready line come
    through (before, the reader thread died and the child blocked writing to a full pipe)."""
    script = textwrap.dedent(
        """
        import sys, time
        sys.stdout.buffer.write(b"model dir /data/caf\\xe9\\n"); sys.stdout.flush()
        for _ in range(1000):
            print("y" * 200, flush=True)
        print("READY", flush=True)
        time.sleep(600)
        """
    )
    supervisor = Supervisor(grace=1.0)
    try:
        child = supervisor.start("latin1", [sys.executable, "-c", script])
        assert supervisor.wait_for(child, "caf\ufffd$", time.monotonic() + 30)
        supervisor.wait_for(child, "READY", time.monotonic() + 30)
        assert child.alive()
    finally:
        supervisor.close()


def test_output_nobody_reads_after_the_ready_line_is_bounded() -> None:
    """A child that logs on after its ready line (`kvmesh up` stops reading a child there):
    its unread lines are the newest LINES_KEPT, not all it ever printed; the latest is still
    seen by a later wait, and the output tail kept for error reports."""
    script = textwrap.dedent(
        f"""
        import time
        print("READY", flush=True)
        for i in range({3 * LINES_KEPT}):
            print(f"log line {{i}}")
        print("LAST", flush=True)
        time.sleep(600)
        """
    )
    supervisor = Supervisor(grace=1.0)
    try:
        child = supervisor.start("chatty", [sys.executable, "-c", script])
        supervisor.wait_for(child, "READY", time.monotonic() + 30)
        deadline = time.monotonic() + 30
        while not (child.tail and child.tail[-1] == "LAST"):
            assert time.monotonic() < deadline, "the child's output was not read"
            time.sleep(0.01)
        assert child.lines.qsize() <= LINES_KEPT
        oldest = supervisor.poll(child, r"log line (\d+)")
        assert oldest is not None and int(oldest.group(1)) >= 2 * LINES_KEPT - 1
        supervisor.wait_for(child, "^LAST$", time.monotonic() + 5)
        assert child.output_tail().endswith(f"log line {3 * LINES_KEPT - 1}\nLAST")
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


# -- restarts (kvmesh.cli.restarts) ---------------------------------------------------------

SERVES = 'import time; print("KVMESH_READY {}", flush=True); time.sleep(600)'
CRASHES = 'print("boom", flush=True); raise SystemExit(3)'


def _spy_on_the_watchdog(supervisor: Supervisor) -> list[str]:
    """The lines the supervisor tells its watchdog from now on (still sent on to it)."""
    told: list[str] = []
    tell = supervisor._tell_watchdog

    def spy(line: str) -> None:
        told.append(line)
        tell(line)

    supervisor._tell_watchdog = spy  # type: ignore[method-assign]
    return told


def _registered(told: list[str]) -> set[int]:
    groups: set[int] = set()
    for line in told:
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    return groups


# Starts a sleeper in its process group (the sleeper keeps the output pipe open), then crashes.
LEAVES_A_SLEEPER = textwrap.dedent(
    """
    import subprocess, sys
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(sleeper.pid, flush=True)
    raise SystemExit(3)
    """
)


def test_a_child_that_exits_by_itself_is_unregistered_and_its_group_killed_at_once() -> None:
    """Once a child's exit is seen (`alive()` false, or its output ended), what is left of its
    group is killed and the watchdog forgets the group: once the child is reaped its pid may
    name an unrelated process group, which the watchdog would kill at its EOF (before, a child
    that exited by itself stayed registered, and its leftovers ran until the shutdown)."""
    supervisor = Supervisor(grace=1.0)
    told = _spy_on_the_watchdog(supervisor)
    try:
        crashed = supervisor.start("decode-0", [sys.executable, "-c", LEAVES_A_SLEEPER])
        sleeper = int(supervisor.wait_for(crashed, r"^(\d+)$", time.monotonic() + 30).group(1))
        end = time.monotonic() + 30
        while crashed.alive():  # as `kvmesh up`'s restarts notice a death
            assert time.monotonic() < end
            time.sleep(0.05)
        assert _wait_gone([sleeper], 5.0) == []
        assert f"-{crashed.pid}" in told
        quick = supervisor.start("prefill-0", [sys.executable, "-c", CRASHES])
        with pytest.raises(ChildFailed, match="exited with 3"):  # its output ended
            supervisor.wait_for(quick, "never printed", time.monotonic() + 30)
        assert f"-{quick.pid}" in told
        restarted = supervisor.start("decode-0", [sys.executable, "-c", SERVES])
        supervisor.wait_for(restarted, "KVMESH_READY", time.monotonic() + 30)
        assert _registered(told) == {restarted.pid}
        assert supervisor.stop(crashed) == 3  # nothing signalled: it was handled already
    finally:
        supervisor.close()
    assert _registered(told) == set()


HEALTH = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.%s)
    print('KVMESH_READY {"address": "127.0.0.1:%%d"}' %% port, flush=True)
    time.sleep(600)
    """
)


class ScriptSystem:
    """The part of LocalSystem the Keeper uses, with scripts for workers (no health address:
    only deaths count)."""

    def __init__(self, supervisor: Supervisor, scripts: dict[str, str]) -> None:
        from kvmesh.cli.up import Worker

        self.supervisor, self.scripts = supervisor, scripts
        self.control = None
        self.endpoint = ""
        self.workers = [Worker("decode", self._start(name)) for name in scripts]
        self.started: list[str] = list(scripts)

    def _start(self, name: str):  # type: ignore[no-untyped-def]
        return self.supervisor.start(name, [sys.executable, "-c", self.scripts[name]])

    def worker(self, name: str):  # type: ignore[no-untyped-def]
        return next((w for w in self.workers if w.child.name == name), None)

    def restart_worker(self, name: str) -> None:
        from kvmesh.cli.up import Worker

        self.started.append(name)
        self.workers = [Worker("decode", self._start(name)) if w.child.name == name else w
                        for w in self.workers]  # fmt: skip

    def poll_ready(self, name: str) -> bool:
        worker = self.worker(name)
        ready = self.supervisor.poll(worker.child, r"KVMESH_READY (\{.*\})")
        if ready is not None:
            worker.ready = json.loads(ready.group(1))
        return ready is not None

    def wait_ready(self) -> None:
        for worker in self.workers:
            line = self.supervisor.wait_for(worker.child, r"KVMESH_READY (\{.*\})",
                                            time.monotonic() + 30)  # fmt: skip
            worker.ready = json.loads(line.group(1))


def keep(system: ScriptSystem, policy: object, until: object, seconds: float) -> list[str]:
    from kvmesh.cli.restarts import Keeper

    lines: list[str] = []
    keeper = Keeper(system, policy, log=lines.append)  # type: ignore[arg-type]
    end = time.monotonic() + seconds
    try:
        while not until(keeper) and time.monotonic() < end:  # type: ignore[operator]
            keeper.check()
            time.sleep(0.05)
    finally:
        keeper.probe.close()
    assert until(keeper), lines  # type: ignore[operator]
    return lines


def test_restart_policy_backs_off_exponentially_up_to_its_bound() -> None:
    from kvmesh.cli.restarts import RestartPolicy

    policy = RestartPolicy(backoff_initial=0.5, backoff_max=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="crash_loop_limit"):
        RestartPolicy(crash_loop_limit=0)


def test_a_killed_worker_is_restarted_under_its_name_and_logged() -> None:
    from kvmesh.cli.restarts import RestartPolicy

    supervisor = Supervisor(grace=1.0)
    try:
        system = ScriptSystem(supervisor, {"decode-0": SERVES, "decode-1": SERVES})
        first = system.worker("decode-0").child
        supervisor.wait_for(first, "KVMESH_READY", time.monotonic() + 30)
        supervisor.kill(first)
        policy = RestartPolicy(backoff_initial=0.2)
        lines = keep(system, policy, lambda k: k.watches["decode-0"].ready_at is not None
                     and k.watches["decode-0"].restarts == 1, 30)  # fmt: skip
        assert system.started == ["decode-0", "decode-1", "decode-0"]
        assert system.worker("decode-0").child.pid != first.pid
        assert any("decode-0 exited with -9; restarting it in 0.2 s" in line for line in lines)
        assert any("decode-0 is back" in line for line in lines)
        assert system.worker("decode-1").child.alive()  # untouched
    finally:
        supervisor.close()


def test_a_crash_looping_worker_is_given_up_after_the_limit() -> None:
    from kvmesh.cli.restarts import RestartPolicy

    supervisor = Supervisor(grace=1.0)
    try:
        system = ScriptSystem(supervisor, {"decode-0": CRASHES})
        policy = RestartPolicy(backoff_initial=0.05, backoff_max=0.2, crash_loop_limit=3)
        start = time.monotonic()
        lines = keep(system, policy, lambda k: k.watches["decode-0"].given_up, 30)
        assert system.started == ["decode-0"] * 4  # the first start and 3 restarts
        assert time.monotonic() - start >= 0.05 + 0.1 + 0.2  # the backoffs were waited
        assert "crash loop" in lines[-1] and "not restarting" in lines[-1]
    finally:
        supervisor.close()


def test_a_draining_child_gets_its_bound_and_a_silent_one_the_wedge_bound() -> None:
    """NOT_SERVING (draining) is left alone for `draining_seconds`; no answer at all (SIGSTOP)
    only for `wedged_seconds`; both are then killed and restarted."""
    from kvmesh.cli.restarts import RestartPolicy

    supervisor = Supervisor(grace=1.0)
    try:
        system = ScriptSystem(supervisor, {"draining": HEALTH % "NOT_SERVING",
                                           "stopped": HEALTH % "SERVING"})  # fmt: skip
        system.wait_ready()
        os.killpg(system.worker("stopped").child.pid, signal.SIGSTOP)
        policy = RestartPolicy(wedged_seconds=0.5, draining_seconds=3.0, probe_timeout=0.3,
                               backoff_initial=0.1)  # fmt: skip
        start = time.monotonic()
        lines = keep(system, policy, lambda k: k.watches["stopped"].restarts == 1, 20)
        assert time.monotonic() - start < 3.0
        assert any("stopped not answering its health check" in line for line in lines)
        lines = keep(system, policy, lambda k: k.watches["draining"].restarts >= 1, 20)
        assert time.monotonic() - start >= 3.0
        assert any("draining NOT_SERVING for" in line for line in lines)
    finally:
        supervisor.close()


DRAINS_THEN_EXITS = HEALTH.replace("time.sleep(600)", "time.sleep(1.5); server.stop(0); "
                                   "time.sleep(2.0); sys.exit(0)")  # fmt: skip


def test_a_drained_child_whose_port_closed_exits_by_itself_unkilled() -> None:
    """A worker whose drain ended stops its server, then takes a while to exit (closing its
    engine): no answer then is the end of its drain, not a wedge; it exits 0 by itself."""
    from kvmesh.cli.restarts import RestartPolicy

    supervisor = Supervisor(grace=1.0)
    try:
        system = ScriptSystem(supervisor, {"drainer": DRAINS_THEN_EXITS % "NOT_SERVING"})
        system.wait_ready()
        first = system.worker("drainer").child
        policy = RestartPolicy(wedged_seconds=0.5, draining_seconds=10.0, probe_timeout=0.3,
                               backoff_initial=0.1)  # fmt: skip
        lines = keep(system, policy, lambda k: first.process.poll() is not None, 20)
        assert first.process.returncode == 0, lines
        assert not any("killing it" in line for line in lines), lines
    finally:
        supervisor.close()


SLEEPS = "import time; time.sleep(600)"  # never prints a ready line


def test_a_control_restart_that_misses_its_deadline_kills_what_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted control plane that never becomes ready within `startup_seconds` is killed
    before the next try (before, it kept the ports every later try needed, so they all failed
    to bind until the crash-loop limit gave the control plane up)."""
    from kvmesh.cli import up
    from kvmesh.cli.restarts import Keeper, RestartPolicy

    monkeypatch.setattr(up, "kvmesh_argv", lambda: [sys.executable, "-c", SLEEPS])
    policy = RestartPolicy(
        backoff_initial=0.05, backoff_max=0.1, startup_seconds=1.0, crash_loop_limit=3
    )
    system = up.LocalSystem(up.UpConfig(port=0, restart=policy))
    try:
        system.endpoint, system.internal_endpoint = "127.0.0.1:1", "127.0.0.1:2"
        system.control_metrics = "127.0.0.1:3"
        system.control = system.supervisor.start("control", [sys.executable, "-c", "exit(1)"])
        system.control.process.wait()
        lines: list[str] = []
        keeper = Keeper(system, policy, log=lines.append)
        watch = keeper.watches["control"]
        end = time.monotonic() + 30
        while not (watch.restarts >= 1 and watch.restart_at is not None):  # the try failed
            assert time.monotonic() < end, lines
            keeper.check()
            time.sleep(0.05)
        assert [c.name for c in system.supervisor.children if c.alive()] == [], lines
    finally:
        system.stop()


def test_stopping_kvmesh_up_stops_every_child_when_its_watchdog_is_gone() -> None:
    """The watchdog killed from outside (the OOM killer, an operator): `stop` still stops the
    control plane and every worker (before, telling the dead watchdog raised BrokenPipeError
    and the workers outlived `kvmesh up`)."""
    from kvmesh.cli.up import LocalSystem, UpConfig, Worker

    system = LocalSystem(UpConfig(port=0))
    supervisor = system.supervisor
    system.control = supervisor.start("control", [sys.executable, "-c", SLEEPS])
    system.workers = [
        Worker(role, supervisor.start(f"{role}-0", [sys.executable, "-c", SLEEPS]))
        for role in ("prefill", "decode")
    ]
    supervisor._watchdog.kill()
    supervisor._watchdog.wait()
    try:
        system.stop()
    finally:
        alive = [w.child for w in system.workers if w.child.alive()]
        for child in alive:
            os.killpg(child.pid, signal.SIGKILL)
    assert alive == [] and not system.control.alive()
