"""Restarts for `kvmesh up`: a dead or wedged child is started again, with backoff.

Contract (`Keeper.check`, called every `POLL_SECONDS` by `kvmesh up`):
- A child that exited is started again after a delay of `backoff_initial` x 2^(failures - 1)
  (at most `backoff_max`); the worker keeps its name (`decode-0`), gets a new id and epoch.
- A child whose gRPC health does not answer within `probe_timeout` for longer than
  `wedged_seconds` (SIGSTOP, a hung event loop), or answers NOT_SERVING (it drains) for longer
  than `draining_seconds`, is killed (SIGKILL), then restarted like a dead one. A draining child
  that stops answering (its drain ended, its server stopped: it is exiting) keeps the draining
  bound, counted from its first NOT_SERVING. A restarted
  worker that prints no ready line within `startup_seconds` is killed too.
- A child up and healthy for `stable_seconds` has its failure count reset; after
  `crash_loop_limit` failures in a row it is given up on (logged, never started again).
- The control plane is restarted on its own public, internal and HTTP addresses (workers
  re-register by themselves); every restarted child gets the same cluster token environment and
  TLS flags as the first one (`LocalSystem.start_control` / `start_worker`).
- Health checks need no token (health is open on every port); under TLS they use the system's
  certificates (`UpConfig.probe_credentials`), so mutual TLS on the worker ports is passed.
Every decision is printed on one `kvmesh up:` line.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.cli.supervisor import ChildFailed

if TYPE_CHECKING:
    from kvmesh.cli.supervisor import Child
    from kvmesh.cli.up import LocalSystem

POLL_SECONDS = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    crash_loop_limit: int = 5
    stable_seconds: float = 60.0
    wedged_seconds: float = 10.0
    draining_seconds: float = 45.0  # > the default 30 s drain cap plus the exit
    probe_timeout: float = 1.0
    startup_seconds: float = 180.0

    def __post_init__(self) -> None:
        checks = {
            "backoff_initial": 0 < self.backoff_initial <= self.backoff_max,
            "crash_loop_limit": self.crash_loop_limit >= 1,
            "wedged_seconds": self.wedged_seconds > 0,
            "draining_seconds": self.draining_seconds >= self.wedged_seconds,
            "probe_timeout": self.probe_timeout > 0,
            "startup_seconds": self.startup_seconds > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"restart policy: {bad[0]} is out of range")

    def delay(self, failures: int) -> float:
        """Seconds before restart number `failures` (1-based)."""
        return float(min(self.backoff_max, self.backoff_initial * 2 ** (failures - 1)))


@dataclass
class Watch:
    """What the keeper knows of one child slot (a worker name, or the control plane)."""

    name: str
    failures: int = 0
    started_at: float = 0.0
    ready_at: float | None = None  # None while a restarted worker has not printed ready
    unhealthy_since: float | None = None  # since when it has not answered SERVING
    draining: bool = False  # its last answer was NOT_SERVING (alive, draining)
    restart_at: float | None = None  # set while dead and waiting for its restart
    given_up: bool = False
    restarts: int = 0


class HealthProbe:
    """gRPC health checks of the overall service ("") of each address, one channel each.
    Health needs no token on any port; with `credentials` the channels use TLS (presenting a
    client certificate where the ports require one)."""

    def __init__(self, timeout: float, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.timeout = timeout
        self.credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}

    def check(self, address: str) -> bool | None:
        """True: SERVING; False: answered otherwise (NOT_SERVING while draining); None: no
        answer within the timeout (or refused)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._open(address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        except grpc.RpcError:
            return None
        return bool(response.status == SERVING)

    def _open(self, address: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.credentials)

    def forget(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for address in list(self._channels):
            self.forget(address)


class Keeper:
    """Restarts the children of a LocalSystem under a RestartPolicy (see the module doc)."""

    def __init__(
        self,
        system: LocalSystem,
        policy: RestartPolicy,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """`credentials`: TLS of the health checks (None: plaintext)."""
        self.system = system
        self.policy = policy
        self.clock = clock
        self.log = log or _print
        self.probe = HealthProbe(policy.probe_timeout, credentials)
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        now = clock()
        self.watches: dict[str, Watch] = {}
        for name in self._names():
            self.watches[name] = Watch(name, started_at=now, ready_at=now)

    def start(self) -> None:
        """Run `check` every POLL_SECONDS on a daemon thread until `stop`."""
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-up-keeper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread (a restart under way finishes first, bounded) and its probes."""
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout)
        self.probe.close()

    def _loop(self) -> None:
        while self._running.is_set():
            self.check()
            time.sleep(POLL_SECONDS)

    def _names(self) -> list[str]:
        control = ["control"] if self.system.control is not None else []
        return [*control, *(w.child.name for w in self.system.workers)]

    def check(self) -> None:
        """One pass over every child: notice deaths and wedges, restart the due ones."""
        for name in self._names():
            watch = self.watches.setdefault(name, Watch(name, started_at=self.clock()))
            if not watch.given_up:
                self._check_one(watch)

    def _child(self, name: str) -> Child | None:
        if name == "control":
            return self.system.control
        worker = self.system.worker(name)
        return worker.child if worker is not None else None

    def _address(self, name: str) -> str:
        if name == "control":
            return self.system.endpoint
        worker = self.system.worker(name)
        return str(worker.ready.get("address", "")) if worker is not None else ""

    def _check_one(self, watch: Watch) -> None:
        now = self.clock()
        child = self._child(watch.name)
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                self._restart(watch)
            return
        if child is None or not child.alive():
            code = None if child is None else child.process.returncode
            self._failed(watch, f"exited with {code}")
            return
        if watch.ready_at is None:
            self._poll_ready(watch, now)
            return
        if now - watch.ready_at >= self.policy.stable_seconds:
            watch.failures = 0
        self._check_health(watch, child, now)

    def _poll_ready(self, watch: Watch, now: float) -> None:
        try:
            ready = self.system.poll_ready(watch.name)
        except ChildFailed as error:
            self._failed(watch, str(error).splitlines()[0])
            return
        if ready:
            watch.ready_at, watch.unhealthy_since = now, None
            self.log(f"kvmesh up: {watch.name} is back ({self._address(watch.name)})")
        elif now - watch.started_at > self.policy.startup_seconds:
            self._kill(watch, f"printed no ready line in {self.policy.startup_seconds:.0f} s")

    def _check_health(self, watch: Watch, child: Child, now: float) -> None:
        address = self._address(watch.name)
        status = self.probe.check(address) if address else True
        if status is True:
            watch.unhealthy_since = None
            return
        # not answering after NOT_SERVING: its drain ended and it exits (its port closed)
        watch.draining = status is False or (status is None and watch.draining)
        if watch.unhealthy_since is None:
            watch.unhealthy_since = now
            return
        bound = self.policy.draining_seconds if watch.draining else self.policy.wedged_seconds
        if now - watch.unhealthy_since > bound:
            what = "NOT_SERVING" if watch.draining else "not answering its health check"
            self._kill(watch, f"{what} for {now - watch.unhealthy_since:.1f} s")

    def _kill(self, watch: Watch, why: str) -> None:
        child = self._child(watch.name)
        self.log(f"kvmesh up: {watch.name} {why}; killing it")
        if child is not None:
            self.system.supervisor.kill(child)
        self._failed(watch, "killed")

    def _failed(self, watch: Watch, why: str) -> None:
        self.probe.forget(self._address(watch.name))
        watch.failures += 1
        if watch.failures > self.policy.crash_loop_limit:
            watch.given_up = True
            self.log(f"kvmesh up: {watch.name} {why}; it failed {watch.failures - 1} times in "
                     f"a row (crash loop), not restarting it")  # fmt: skip
            return
        delay = self.policy.delay(watch.failures)
        watch.restart_at = self.clock() + delay
        self.log(f"kvmesh up: {watch.name} {why}; restarting it in {delay:.1f} s "
                 f"(failure {watch.failures} of {self.policy.crash_loop_limit})")  # fmt: skip

    def _restart(self, watch: Watch) -> None:
        watch.restart_at, watch.unhealthy_since = None, None
        watch.started_at, watch.restarts = self.clock(), watch.restarts + 1
        if watch.name == "control":
            try:
                self.system.start_control(self.clock() + self.policy.startup_seconds)
            except ChildFailed as error:
                control = self.system.control  # started, not ready: it holds the ports
                if control is not None and control.alive():
                    self.system.supervisor.kill(control)
                self._failed(watch, str(error).splitlines()[0])
                return
            watch.ready_at = self.clock()
            self.log(f"kvmesh up: control is back ({self.system.endpoint})")
            return
        watch.ready_at = None
        self.system.restart_worker(watch.name)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
