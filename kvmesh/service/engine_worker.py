"""EngineWorker: one thread owns an LLMEngine; asyncio code talks to it through commands.

```
asyncio servicers ──call(fn)──▶ command queue ──▶ engine thread: run fn(engine) at a step
        ▲                                          boundary, then engine.step() while work
        └── call_soon_threadsafe ◀── per-request asyncio.Queue ◀── RequestOutput of the step
```
Only the engine thread touches the scheduler and the block manager. `load()` is a snapshot
refreshed after every command and step, safe to read from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import RequestOutput

T = TypeVar("T")
IDLE_WAIT_SECONDS = 0.05  # how long an idle engine thread sleeps between command checks


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    total_blocks: int = 0
    free_blocks: int = 0  # free now (uncached) plus evictable cached blocks
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0


class EngineStoppedError(RuntimeError):
    """The engine thread has stopped; no more commands run."""


class EngineWorker:
    """Runs `engine` on its own thread; `start()` before use, `stop()` at shutdown."""

    def __init__(self, engine: LLMEngine, name: str = "kvmesh-engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._sinks_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._load = LoadSnapshot()
        self._steps = 0
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_load()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- commands --------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread at the next step boundary; its result or
        exception comes back here."""
        if self._stopping.is_set() or not self._thread.is_alive():
            raise EngineStoppedError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:
                _post(loop, settle, False, exc)
            else:
                _post(loop, settle, True, result)

        self._commands.put(command)
        return await future

    def submit(self, fn: Callable[[LLMEngine], object]) -> None:
        """Queue `fn(engine)` without waiting (cleanup that must happen even if the caller is
        cancelled); its errors are dropped."""

        def command() -> None:
            with contextlib.suppress(Exception):
                fn(self.engine)

        self._commands.put(command)

    def subscribe(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """A queue receiving every RequestOutput of `request_id` (register before adding it)."""
        sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._sinks_lock:
            self._sinks[request_id] = (asyncio.get_running_loop(), sink)
        return sink

    def unsubscribe(self, request_id: str) -> None:
        with self._sinks_lock:
            self._sinks.pop(request_id, None)

    def load(self) -> LoadSnapshot:
        return self._load

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.engine.scheduler.has_unfinished()
                self._drain_commands(block=not busy)
                if self._stopping.is_set():
                    break
                if self.engine.scheduler.has_unfinished():
                    self._deliver(self.engine.step())
                    self._steps += 1
                self._refresh_load()
        except BaseException as exc:
            self.error = exc
            self._stopping.set()
            raise

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                command()
                self._refresh_load()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.push(output)

    def push(self, output: RequestOutput) -> None:
        """Hand one output to its request's subscriber (engine thread; dropped when none)."""
        with self._sinks_lock:
            target = self._sinks.get(output.request_id)
        if target is not None:
            loop, sink = target
            _post(loop, sink.put_nowait, output)

    def _refresh_load(self) -> None:
        scheduler = self.engine.scheduler
        metrics = scheduler.block_manager.metrics()
        self._load = LoadSnapshot(
            total_blocks=metrics.total_blocks,
            free_blocks=metrics.free_blocks + metrics.evictable_blocks,
            cached_blocks=metrics.cached_blocks,
            running=scheduler.num_running,
            waiting=scheduler.num_waiting,
            steps=self._steps,
        )


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on `loop`; a loop that already closed has no one to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def monotonic_deadline(seconds: float | None, default: float) -> float:
    """Absolute monotonic deadline `seconds` from now (`default` when None)."""
    return time.monotonic() + (default if seconds is None else seconds)
