"""Helpers of the fault suite: streams placed on known decode workers, signals, measurements.

With `KVMESH_FAULT_REPORT=FILE`, every case appends one JSON line of what it measured
(requests lost, collateral losses, leaked blocks, outage and recovery seconds) to FILE;
docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sys_harness import live_workers, sample, scrape, total

from kvmesh.cli.up import LocalSystem, Worker
from kvmesh.client import Client, KvmeshError

PROMPT = [(7 * i) % 500 + 1 for i in range(40)]  # every stream reserves the same blocks


@dataclass
class Stream:
    """One request consumed on a thread; `worker` is the decode worker that served it."""

    index: int
    worker: str = ""
    first: threading.Event = field(default_factory=threading.Event)
    error: KvmeshError | None = None
    tokens: int = 0
    ended_at: float = 0.0
    thread: threading.Thread | None = None

    def join(self, seconds: float) -> None:
        assert self.thread is not None
        self.thread.join(seconds)
        assert not self.thread.is_alive(), f"stream {self.index} hung"


def running(system: LocalSystem, role: str = "decode") -> dict[str, float]:
    """Sequences in the batch of every ready, live worker of `role`."""
    return {
        w.child.name: total(w.ready["metrics_address"], "kvmesh:num_requests_running")
        for w in system.workers
        if w.role == role and w.ready and w.child.alive()
    }


def admitted(system: LocalSystem) -> dict[str, float]:
    """Requests each live decode worker took so far (running + waiting + finished): it only
    grows while nothing fails, even when a stream ends as another starts. Each worker's three
    numbers come from one scrape, and the snapshot is read until two reads agree: a stream
    that ends between two reads would otherwise count twice or not at all, and a `before`
    missing one stream makes its worker look grown for good."""
    snapshot = _admitted_once(system)
    for _ in range(20):
        time.sleep(0.02)
        again = _admitted_once(system)
        if again == snapshot:
            break
        snapshot = again
    return snapshot


def _admitted_once(system: LocalSystem) -> dict[str, float]:
    counts = {}
    for w in system.workers:
        if w.role == "decode" and w.ready and w.child.alive():
            samples = scrape(w.ready["metrics_address"])
            counts[w.child.name] = sum(
                v
                for (n, labels), v in samples.items()
                if n in ("kvmesh:num_requests_running", "kvmesh:num_requests_waiting")
                or (n == "kvmesh_requests_total" and ("status", "OK") in labels)
            )
    return counts


def busiest(system: LocalSystem, role: str) -> Worker:
    """The live worker of `role` that finished the most requests (the one streams used)."""
    workers = [w for w in system.workers if w.role == role and w.ready and w.child.alive()]
    return max(workers, key=lambda w: sample(w.ready["metrics_address"],
                                             "kvmesh_requests_total", status="OK"))  # fmt: skip


def start_stream(endpoint: str, index: int, max_tokens: int, **extra: Any) -> Stream:
    stream = Stream(index)

    def consume() -> None:
        try:
            with Client(endpoint, timeout=90) as client:
                for chunk in client.generate(
                    PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **extra
                ):
                    stream.tokens += len(chunk.token_ids)
                    stream.first.set()
        except KvmeshError as error:
            stream.error = error
        stream.ended_at = time.monotonic()
        stream.first.set()

    stream.thread = threading.Thread(target=consume, daemon=True)
    stream.thread.start()
    return stream


def spread_streams(
    system: LocalSystem, endpoint: str, count: int, max_tokens: int, **extra: Any
) -> list[Stream]:
    """`count` streams started one by one, each once the previous one's load was reported
    (so the router alternates decode workers); each knows the decode worker serving it."""
    streams = []
    for i in range(count):
        before = admitted(system)
        stream = start_stream(endpoint, i, max_tokens, **extra)
        assert stream.first.wait(60), f"stream {i} got no token"
        assert stream.error is None, stream.error
        deadline = time.monotonic() + 10
        while not stream.worker and time.monotonic() < deadline:
            now = admitted(system)
            grown = [name for name, n in now.items() if n > before.get(name, 0)]
            stream.worker = grown[0] if len(grown) == 1 else ""
            time.sleep(0.05)
        streams.append(stream)
        time.sleep(0.6)  # one heartbeat: the control plane sees the new load
    return streams


def worker_of(system: LocalSystem, name: str) -> Worker:
    worker = system.worker(name)
    assert worker is not None, name
    return worker


def signal_worker(worker: Worker, sig: int) -> None:
    os.killpg(worker.child.pid, sig)


def kill9(system: LocalSystem, worker: Worker) -> None:
    system.supervisor.kill(worker.child)


def sigstop(worker: Worker) -> None:
    signal_worker(worker, signal.SIGSTOP)


def sigcont(worker: Worker) -> None:
    signal_worker(worker, signal.SIGCONT)


def wait_for_workers(system: LocalSystem, role: str, count: int, seconds: float) -> float:
    """Seconds until the control plane counts `count` live workers of `role`."""
    start = time.monotonic()
    while not _counts(system, role, count):
        if time.monotonic() - start > seconds:
            raise AssertionError(f"{count} live {role} workers: not within {seconds} s")
        time.sleep(0.1)
    return time.monotonic() - start


def _counts(system: LocalSystem, role: str, count: int) -> bool:
    try:
        return live_workers(system, role) == count
    except OSError:  # the control plane is down or restarting: not yet
        return False


def first_success(endpoint: str, seconds: float) -> float:
    """Seconds until a short request succeeds (the outage a new client sees)."""
    start = time.monotonic()
    with Client(endpoint, timeout=30) as client:
        while True:
            try:
                client.complete([1, 2, 3, 4], max_tokens=2, temperature=0.0)
                return time.monotonic() - start
            except KvmeshError:
                if time.monotonic() - start > seconds:
                    raise
                time.sleep(0.1)


def report(case: str, **numbers: Any) -> None:
    path = os.environ.get("KVMESH_FAULT_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"case": case, **numbers}) + "\n")
