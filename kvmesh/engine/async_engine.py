"""AsyncLLMEngine: the one asyncio interface to an LLMEngine (the services use it too).

```
asyncio callers ──call(fn) / open_stream / abort──▶ command queue ──▶ engine thread: commands
        ▲                                                             at a step boundary, then
        └── call_soon_threadsafe ◀── RequestStream (asyncio.Queue) ◀── engine.step() while work
```
Only the engine thread touches the LLMEngine (scheduler, block manager, runner); torch
releases the GIL, so the event loop stays responsive. Commands run in the order they were
queued, each exactly once: a caller that stops waiting (timeout, cancel) loses only the result,
so a cleanup queued after a command always runs after it. `load()` is a snapshot refreshed
after every command and step, before the command's caller resumes; any thread may read it.

Every wait is bounded:

    call() / abort() / open_stream()   the result within `call_timeout` s, else TimeoutError
    RequestStream                      each next output within `output_timeout` s, else the
                                       request is cleaned up and TimeoutError raised
    stop() / shutdown()                joins the engine thread within `timeout` s

A stream may carry a step hook (`open_stream(..., on_step=fn)`): `fn(engine, request_id, output)`
runs on the engine thread after every step while the stream is open, before that step's outputs
are handed out (`output`: the request's output of that step, or None; one hook per stream, so
bounded; it must be quick and must never wait on I/O; the prefill worker's KV export uses it to
hand finished blocks and the first token to a sender thread). A hook that raises is logged and
removed.

A request that fails in a step alone (its final output carries `error`, a RequestFailedError:
the engine aborted it and freed its blocks) ends its stream with that error, its step hook
removed without being called; the other streams and the engine thread go on.

Leaving a stream early (break, cancel, disconnect, `close()`) runs its cleanup (abort by
default) on the engine thread, which frees the request's blocks; only while the stream still
holds its request id: a stream whose open was refused (another holds the id) or whose request
already ended never cleans up the request that holds the id now. The engine never imports
grpc; importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput, merge_unread

if TYPE_CHECKING:
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine, PromptInput
    from kvmesh.engine.sampling_params import SamplingParams

T = TypeVar("T")
LOG = logging.getLogger("kvmesh.engine")
IDLE_WAIT_SECONDS = 0.05  # how long an idle engine thread sleeps between command checks
# After a step that could plan nothing (waiting work, no room yet): how long the thread waits
# for a command (a release, an abort: what makes room) before it plans again, instead of
# spinning through empty steps; short, as room can also come from the engine's own threads.
STALLED_WAIT_SECONDS = 0.005
# Unread outputs a stream keeps one per step; past this many, new ones merge into the last.
MERGE_BACKLOG = 16
Cleanup = Callable[["LLMEngine", str], object]
StepHook = Callable[["LLMEngine", str, "RequestOutput | None"], object]


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    total_blocks: int = 0
    free_blocks: int = 0  # free now (uncached) plus evictable cached blocks
    cached_blocks: int = 0  # published in the prefix index (in use or evictable)
    evictable_blocks: int = 0  # the free blocks still holding a reusable prefix (in free_blocks)
    running: int = 0
    waiting: int = 0
    steps: int = 0
    prefix_query_tokens: int = 0  # cumulative, like the two below
    prefix_hit_tokens: int = 0
    preemptions: int = 0


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); nothing more runs on it."""

    status_name = "UNAVAILABLE"  # the gRPC status it is answered with


def abort_request(engine: LLMEngine, request_id: str) -> object:
    """The default cleanup of a stream left early."""
    return engine.abort_request(request_id)


class OutputQueue(asyncio.Queue[Any]):
    """A stream's queue of outputs and errors, bounded for a slow reader: once MERGE_BACKLOG
    outputs wait unread, an output put behind an unread unfinished one merges into it
    (`merge_unread`), so a reader that falls behind the engine's steps holds a bounded number
    of outputs, whatever the steps made meanwhile, and still reads every token and finish (a
    reader keeping up gets one output per step). It overrides `asyncio.Queue._put` and reads
    `_queue`, the hooks CPython's `PriorityQueue` and `LifoQueue` use."""

    def _put(self, item: Any) -> None:
        queue = self._queue  # type: ignore[attr-defined]
        if (
            len(queue) >= MERGE_BACKLOG
            and isinstance(item, RequestOutput)
            and isinstance(queue[-1], RequestOutput)
            and not queue[-1].finished
        ):
            queue[-1] = merge_unread(queue[-1], item)
        else:
            queue.append(item)


class RequestStream:
    """Outputs of one request, in order, until one is finished (an async iterator)."""

    def __init__(
        self, owner: AsyncLLMEngine, request_id: str, sink: asyncio.Queue[Any], cleanup: Cleanup
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._sink = sink
        self._cleanup: Cleanup | None = cleanup
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        timeout = self._owner.output_timeout
        try:
            item = await asyncio.wait_for(self._sink.get(), timeout)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"request {self.request_id!r}: no output in {timeout} s") from None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`: the next read after the outputs already queued raises
        it. Call on the stream's event loop."""
        if not self._closed:
            self._sink.put_nowait(error)

    def detach(self, error: BaseException) -> None:
        """End the stream with `error` and give up its request id at once (a new stream may
        open under it): no output reaches this stream any more, and closing it later cleans
        nothing up (the caller drops the request itself). Call on the stream's event loop."""
        if self._closed:
            return
        self._sink.put_nowait(error)
        self._cleanup = None
        self._owner._unsubscribe(self.request_id, self._sink)

    def close(self) -> None:
        """Stop listening; an unfinished request is cleaned up on the engine thread. Returns at
        once (safe in `finally` of a cancelled task); idempotent."""
        if self._closed:
            return
        self._closed = True
        cleanup = None if self.finished else self._cleanup
        self._owner.submit(self._owner._drop_stream, self.request_id, self._sink, cleanup)

    async def aclose(self) -> object:
        """`close()`, waiting (bounded) for the cleanup's result."""
        if self._closed:
            return None
        self._closed = True
        cleanup = None if self.finished else self._cleanup
        return await self._owner.call(
            self._owner._drop_stream, self.request_id, self._sink, cleanup
        )

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncLLMEngine:
    """Start with `AsyncLLMEngine(config)` or `AsyncLLMEngine(engine=...)`; stop with
    `await shutdown()` (or `stop()` outside a loop)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        *,
        output_timeout: float = 300.0,
        call_timeout: float = 60.0,
        name: str = "kvmesh-engine",
    ) -> None:
        if engine is None:
            from kvmesh.engine.engine import LLMEngine

            engine = LLMEngine(config)
        self.engine = engine
        self.output_timeout = output_timeout
        self.call_timeout = call_timeout
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._streams_lock = threading.Lock()
        self._hooks: dict[str, StepHook] = {}  # engine thread only
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._steps = 0
        self._load = LoadSnapshot()
        self._refresh_load()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs (each carries new_token_ids / new_text)."""
        stream = await self.add_request(request_id, prompt, params, prefill_only=prefill_only)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
    ) -> RequestStream:
        """Queue a request; its output stream. InvalidParameterError on bad input."""

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, prefill_only=prefill_only)

        return await self.open_stream(request_id, add)

    async def open_stream(
        self,
        request_id: str,
        start: Callable[[LLMEngine], RequestOutput | None],
        cleanup: Cleanup = abort_request,
        *,
        on_step: StepHook | None = None,
    ) -> RequestStream:
        """Subscribe to `request_id` and run `start(engine)` in the same command (it adds the
        request; an output it returns is the stream's first). `cleanup(engine, request_id)`
        runs when the stream is left before its request finished. `on_step(engine,
        request_id, output)` runs on the engine thread after each step while the stream is open."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = OutputQueue()

        def open_(engine: LLMEngine) -> None:
            self._subscribe(request_id, loop, sink)
            if on_step is not None:
                self._hooks[request_id] = on_step
            self._start(engine, request_id, sink, start)

        try:
            await self.call(open_)
        except (asyncio.CancelledError, TimeoutError):
            self.submit(self._drop_stream, request_id, sink, cleanup)  # runs after open_
            raise
        return RequestStream(self, request_id, sink, cleanup)

    def open_stream_when(
        self,
        request_id: str,
        when_ready: Callable[[Callable[[], None]], object],
        start: Callable[[LLMEngine], RequestOutput | None],
        cleanup: Cleanup = abort_request,
    ) -> RequestStream:
        """Subscribe to `request_id` now; run `start(engine)` on the engine thread once
        `when_ready(fire)` calls `fire()` (once, from any thread: that thread queues the
        command itself, with no hop through this event loop). What `start` raises ends the
        stream with that error; `start` is skipped when the stream was closed before it ran.
        InvalidParameterError when a stream for `request_id` is open."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = OutputQueue()
        self._subscribe(request_id, loop, sink)

        def begin(engine: LLMEngine) -> None:
            with self._streams_lock:
                target = self._streams.get(request_id)
            if target is None or target[1] is not sink:
                return  # closed (or failed) before the start ran: nothing to join
            try:
                self._start(engine, request_id, sink, start)
            except Exception as exc:
                _post(loop, sink.put_nowait, exc)

        when_ready(lambda: self.submit(begin))
        return RequestStream(self, request_id, sink, cleanup)

    def _start(
        self,
        engine: LLMEngine,
        request_id: str,
        sink: asyncio.Queue[Any],
        start: Callable[[LLMEngine], RequestOutput | None],
    ) -> None:
        """On the engine thread: run `start(engine)` for a subscribed stream and push the
        output it returns; on an error drop the stream (no cleanup: nothing was added) and
        re-raise."""
        try:
            first = start(engine)
        except BaseException:
            self._drop_stream(engine, request_id, sink, None)
            raise
        if first is not None:
            self._push(first)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (idempotent); its stream ends with the aborted output. True if it
        was still running."""

        def abort(engine: LLMEngine) -> bool:
            output = engine.abort_request(request_id)
            if output is not None:
                self._push(output)
            return output is not None

        return await self.call(abort)

    # -- commands --------------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run `fn(engine, *args)` on the engine thread at the next step boundary; its result
        or exception comes back here (TimeoutError after `timeout`, default `call_timeout`)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        future.add_done_callback(_retrieve)  # a caller that gave up must not leave it unread
        self._queue(_Command(fn, args, loop, future))
        limit = self.call_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(future), limit)
        except TimeoutError:
            raise TimeoutError(f"engine call {_name(fn)} took over {limit} s") from None

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue `fn(engine, *args)` without waiting (cleanup that must happen even when the
        caller is cancelled); its errors are logged. Dropped once the engine stopped."""
        if not self._stopping.is_set():
            self._queue(_Command(fn, args, None, None))

    def load(self) -> LoadSnapshot:
        return self._load

    @property
    def num_unfinished(self) -> int:
        """Open streams (requests someone is still listening to)."""
        return len(self._streams)

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (joined within `timeout` s); open streams and waiting
        callers get EngineDeadError. Idempotent."""
        self._stopping.set()
        self._commands.put(_Command(None, (), None, None))  # wake an idle thread
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                LOG.warning("engine thread still in a step after %.1f s at shutdown", timeout)
        self._fail_pending(EngineDeadError("engine shut down"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """`stop()` without blocking the event loop."""
        self._stopping.set()
        self._commands.put(_Command(None, (), None, None))
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self.stop(0.0)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stalled = False  # the last step planned nothing: wait a little for a command
            while not self._stopping.is_set():
                if stalled:
                    self._run_commands(block=True, timeout=STALLED_WAIT_SECONDS)
                else:
                    self._run_commands(block=not self.engine.scheduler.has_unfinished())
                if self._stopping.is_set():
                    break
                stalled = False
                if self.engine.scheduler.has_unfinished():
                    outputs = self.engine.step()
                    if self.engine.last_step_empty:  # waiting work that cannot start yet
                        stalled = True
                        continue
                    self._steps += 1
                    self._refresh_load()
                    if self._hooks:
                        self._run_hooks(outputs)
                    for output in outputs:
                        self._push(output)
        except BaseException as exc:  # the loop must report, not vanish
            self.error = exc
            LOG.exception("engine thread failed")
        finally:
            self._stopping.set()
            try:
                self.engine.close()
            except Exception:
                LOG.exception("closing the engine failed")
            self._stopped.set()
            self._fail_pending(EngineDeadError(f"engine is not running ({self.error!r})"))

    def _run_commands(self, block: bool, timeout: float = IDLE_WAIT_SECONDS) -> None:
        try:
            command = self._commands.get(timeout=timeout) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                command.run(self)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_hooks(self, outputs: list[RequestOutput]) -> None:
        by_request = {output.request_id: output for output in outputs}
        for request_id, hook in list(self._hooks.items()):
            failed = by_request.get(request_id)
            if failed is not None and failed.error is not None:
                self._hooks.pop(request_id, None)  # nothing of it is left to hand on
                continue
            try:
                hook(self.engine, request_id, by_request.get(request_id))
            except Exception:
                LOG.exception("step hook of %r failed; removed", request_id)
                self._hooks.pop(request_id, None)

    def _subscribe(
        self, request_id: str, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue[Any]
    ) -> None:
        """Route `request_id`'s outputs to `sink` on `loop` (any thread); InvalidParameterError
        when a stream for it is open."""
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidParameterError("request_id", f"{request_id!r} already exists")
            self._streams[request_id] = (loop, sink)

    def _push(self, output: RequestOutput) -> None:
        """Hand an output to its request's stream (engine thread; dropped when none); a
        failed request's output ends its stream with the error it carries."""
        with self._streams_lock:
            target = self._streams.get(output.request_id)
            if target is not None and output.finished:
                del self._streams[output.request_id]
                self._hooks.pop(output.request_id, None)
        if target is not None:
            item = output if output.error is None else output.error
            _post(target[0], target[1].put_nowait, item)

    def _drop_stream(
        self, engine: LLMEngine, request_id: str, sink: asyncio.Queue[Any], cleanup: Cleanup | None
    ) -> object:
        """Unsubscribe `sink`; run `cleanup` only when `sink` still held `request_id`: a stream
        that never got the id (its open was refused: another stream holds it) or that lost it
        (its request ended, or it was detached) must not clean up whoever holds it now."""
        held = self._unsubscribe(request_id, sink)
        return None if cleanup is None or not held else cleanup(engine, request_id)

    def _unsubscribe(self, request_id: str, sink: asyncio.Queue[Any]) -> bool:
        """Stop routing `request_id`'s outputs to `sink` (any thread; a newer stream under the
        same id is left alone); True when `sink` held it."""
        with self._streams_lock:
            target = self._streams.get(request_id)
            if target is None or target[1] is not sink:
                return False
            del self._streams[request_id]
            self._hooks.pop(request_id, None)
            return True

    def _refresh_load(self) -> None:
        scheduler = self.engine.scheduler
        metrics = scheduler.block_manager.metrics()
        self._load = LoadSnapshot(
            total_blocks=metrics.total_blocks,
            free_blocks=metrics.free_blocks + metrics.evictable_blocks,
            cached_blocks=metrics.cached_blocks,
            evictable_blocks=metrics.evictable_blocks,
            running=scheduler.num_running,
            waiting=scheduler.num_waiting,
            steps=self._steps,
            prefix_query_tokens=metrics.prefix_query_tokens,
            prefix_hit_tokens=metrics.prefix_hit_tokens,
            preemptions=scheduler.num_preemptions,
        )

    # -- either thread ---------------------------------------------------------------------
    def _queue(self, command: _Command) -> None:
        self._commands.put(command)
        if self._stopped.is_set():  # the thread may have drained the queue before this put
            self._fail_pending(EngineDeadError("engine shut down"))

    def _fail_pending(self, error: BaseException) -> None:
        """After the thread stopped: fail queued commands and open streams."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            return
        while True:
            try:
                self._commands.get_nowait().fail(error)
            except queue.Empty:
                break
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for loop, sink in streams.values():
            _post(loop, sink.put_nowait, error)

    def _check_alive(self) -> None:
        if self._stopping.is_set():
            raise EngineDeadError(f"engine is not running ({self.error!r})")


class _Command:
    """One function for the engine thread and, when someone waits, where its result goes."""

    __slots__ = ("args", "fn", "future", "loop")

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop | None,
        future: asyncio.Future[Any] | None,
    ) -> None:
        self.fn, self.args, self.loop, self.future = fn, args, loop, future

    def run(self, owner: AsyncLLMEngine) -> None:
        if self.fn is None:
            return
        try:
            result = self.fn(owner.engine, *self.args)
        except Exception as exc:
            owner._refresh_load()
            if self.future is None:
                LOG.warning("engine command %s failed: %r", _name(self.fn), exc)
            self._settle(False, exc)
        else:
            owner._refresh_load()
            self._settle(True, result)

    def fail(self, error: BaseException) -> None:
        self._settle(False, error)

    def _settle(self, ok: bool, value: Any) -> None:
        if self.loop is not None and self.future is not None:
            _post(self.loop, _resolve, self.future, ok, value)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _resolve(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule `fn(*args)` on `loop`; a loop that already closed has no one to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))
