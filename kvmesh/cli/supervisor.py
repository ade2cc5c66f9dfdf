"""Supervision of local child processes for `kvmesh up` (and the system tests).

Contract:
- Every child runs in its own process group (so a terminal's Ctrl-C reaches only the
  supervisor, which stops children in order) with stdout and stderr merged into a pipe that a
  reader thread drains line by line (the child never blocks on a full pipe), decoded as UTF-8
  with bytes that are not UTF-8 replaced (U+FFFD).
- A watchdog process holds the read end of a pipe whose write end only the supervisor holds.
  When the supervisor exits for any reason, kill -9 included, the watchdog sees EOF, sends
  SIGTERM to every child process group still registered, and SIGKILL after `grace` seconds.
  So no child outlives its supervisor.
- A child's exit, once noticed (its output ended, `alive()` false, `stop`), SIGKILLs what is
  left of its group and unregisters the group from the watchdog at once, before its process
  group id can name another group; `stop` of such a child signals nothing.
- `wait_for(child, pattern, deadline)` returns the first output line matching `pattern`, or
  raises ChildFailed when the child exits or the deadline passes first (with its output tail).
- `poll(child, pattern)` is the same without waiting (None when no such line came yet).
- Lines no reader took yet wait in `child.lines`, the newest LINES_KEPT of them (older unread
  ones are dropped): a child that logs on after its ready line, with nobody reading any more,
  holds bounded memory. `child.tail` keeps the last TAIL_LINES for error reports.
- `stop(child, grace)` sends SIGTERM to the group, waits at most `grace` seconds, then SIGKILL.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TAIL_LINES = 60
LINES_KEPT = 10_000  # unread output lines kept per child (the newest)
KILL_WAIT_SECONDS = 5.0  # after SIGKILL, how long to wait for the exit status


class ChildFailed(RuntimeError):
    """A child exited or missed its deadline; the message ends with its last output lines."""


class RecentLines(queue.Queue[str | None]):
    """A queue that keeps the newest `limit` items: a put never blocks, and past `limit`
    unread items the oldest is dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__()

    def _init(self, maxsize: int) -> None:
        self.queue: collections.deque[str | None] = collections.deque(maxlen=self.limit)


@dataclass
class Child:
    name: str
    process: subprocess.Popen[str]
    lines: queue.Queue[str | None] = field(default_factory=lambda: RecentLines(LINES_KEPT))
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    on_exit: Callable[[Child], None] | None = field(default=None, repr=False)
    released: bool = False  # its group was killed and unregistered after its exit

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """Whether the process still runs; seeing it exited hands it to `on_exit` before it
        is reaped (until then its pid, the group's id, cannot be reused)."""
        if self.process.returncode is None and not _exited(self.pid):
            return True
        if self.on_exit is not None:
            self.on_exit(self)
        self.process.poll()  # reaps it
        return False

    def output_tail(self) -> str:
        return "\n".join(self.tail)


class Supervisor:
    """Starts, watches and stops child processes; see the module docstring."""

    def __init__(self, echo: bool = False, grace: float = 5.0) -> None:
        self.echo = echo  # copy children's output (prefixed with their name) to stderr
        self.grace = grace
        self.children: list[Child] = []
        self._release_lock = threading.Lock()
        read_end, self._watch_fd = os.pipe()
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli.supervisor", str(grace)],
            stdin=read_end, start_new_session=True, close_fds=True,
        )  # fmt: skip
        os.close(read_end)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """Start `argv` as a new process group; its output is read by a background thread."""
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, encoding="utf-8", errors="replace", bufsize=1,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
        child = Child(name, process, on_exit=self._release)
        self.children.append(child)
        self._tell_watchdog(f"+{process.pid}")
        threading.Thread(target=self._read, args=(child,), daemon=True).start()
        return child

    def _read(self, child: Child) -> None:
        assert child.process.stdout is not None
        for raw in child.process.stdout:
            line = raw.rstrip("\n")
            child.tail.append(line)
            child.lines.put(line)
            if self.echo:
                print(f"[{child.name}] {line}", file=sys.stderr, flush=True)
        with contextlib.suppress(ChildProcessError):  # reaped elsewhere already
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        self._release(child)
        child.process.wait()
        child.lines.put(None)

    def wait_for(
        self, child: Child, pattern: str | re.Pattern[str], deadline: float
    ) -> re.Match[str]:
        """First line of `child` matching `pattern` (re.search) before `deadline` (monotonic)."""
        regex = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"{child.name} not ready in time\n{child.output_tail()}")
            try:
                line = child.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                code = child.process.wait()
                raise ChildFailed(f"{child.name} exited with {code}\n{child.output_tail()}")
            match = regex.search(line)
            if match is not None:
                return match

    def poll(self, child: Child, pattern: str | re.Pattern[str]) -> re.Match[str] | None:
        """The first line already printed by `child` matching `pattern`, else None (never
        blocks); ChildFailed when its output ended (it exited) without one."""
        regex = re.compile(pattern)
        while True:
            try:
                line = child.lines.get_nowait()
            except queue.Empty:
                return None
            if line is None:
                child.lines.put(None)  # keep the end visible to the next reader
                raise ChildFailed(f"{child.name} exited\n{child.output_tail()}")
            match = regex.search(line)
            if match is not None:
                return match

    def stop(self, child: Child, grace: float | None = None, sig: int = signal.SIGTERM) -> int:
        """Signal the child's group, wait at most `grace` s, then SIGKILL it; the exit code.
        A child whose exit was handled already is not signalled (its pid may be reused)."""
        grace = self.grace if grace is None else grace
        if child.released:
            with contextlib.suppress(subprocess.TimeoutExpired):  # reaped elsewhere, at once
                child.process.wait(timeout=KILL_WAIT_SECONDS)
            return child.process.returncode
        _signal_group(child.pid, sig)
        if not self._wait_exit(child, grace):
            _signal_group(child.pid, signal.SIGKILL)
            self._wait_exit(child, KILL_WAIT_SECONDS)  # a D-state child cannot hang us
        self._release(child)  # one that would not die is given up on too
        return child.process.returncode

    def _wait_exit(self, child: Child, seconds: float) -> bool:
        """Whether `child` exits within `seconds`; if so it is released, then reaped."""
        end = time.monotonic() + seconds
        while child.process.returncode is None and not _exited(child.pid):
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        self._release(child)
        child.process.wait()
        return True

    def _release(self, child: Child) -> None:
        """SIGKILL what is left of an exited child's group and unregister it from the
        watchdog; once per child, from whichever thread noticed the exit first."""
        with self._release_lock:
            if child.released:
                return
            child.released = True
            _signal_group(child.pid, signal.SIGKILL)
            self._tell_watchdog(f"-{child.pid}")

    def _tell_watchdog(self, line: str) -> None:
        """Send the watchdog one line (nothing once `close`d: it has exited). A watchdog killed
        from outside (the OOM killer, an operator) stops no start and no shutdown: this
        process still stops its children itself; only its own SIGKILL would leave them."""
        if self._watch_fd >= 0:
            with contextlib.suppress(OSError):  # BrokenPipeError: the watchdog is gone
                os.write(self._watch_fd, f"{line}\n".encode())

    def kill(self, child: Child) -> None:
        """SIGKILL the child's group now (failure injection)."""
        self.stop(child, grace=0.0, sig=signal.SIGKILL)

    def stop_all(self, grace: float | None = None) -> None:
        """Stop every child still running (SIGTERM all first, then wait, bounded)."""
        grace = self.grace if grace is None else grace
        running = [c for c in self.children if c.alive()]
        for child in running:
            _signal_group(child.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        for child in running:
            self.stop(child, grace=max(0.0, end - time.monotonic()))

    def close(self) -> None:
        """Stop all children, then let the watchdog exit; idempotent (the watchdog's pipe is
        closed once, never a descriptor that reused its number)."""
        self.stop_all()
        fd, self._watch_fd = self._watch_fd, -1
        if fd >= 0:
            os.close(fd)
        self._watchdog.wait(timeout=self.grace + 5)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exited(pid: int) -> bool:
    """Whether the child `pid` exited, without reaping it (True when reaped already)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def watchdog(grace: float) -> None:
    """Read `+pgid`/`-pgid` lines from stdin; at EOF terminate the groups still listed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin:
        text = line.strip()
        if text[:1] in "+-" and text[1:].isdigit():
            (groups.add if text[0] == "+" else groups.discard)(int(text[1:]))
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_group_alive(g) for g in groups):
        time.sleep(0.05)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)


if __name__ == "__main__":
    watchdog(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
