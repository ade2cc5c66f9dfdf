"""AsyncLLMEngine: the asyncio face of LLMEngine for the services.

A worker thread runs the step loop (torch releases the GIL, so the event loop stays
responsive); every engine call, steps included, happens under one lock. Outputs reach each
request's asyncio.Queue through `call_soon_threadsafe`. Every wait is bounded:

    generate()         each next output within `output_timeout` s, else abort + TimeoutError
    add/abort/call()   run in a thread via asyncio.to_thread, lock waits one step at most
    shutdown()         joins the worker within `timeout` s

Leaving a `generate` stream early (break, cancel, disconnect) aborts the request and frees its
blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine, PromptInput
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams

T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream receives this."""


class AsyncLLMEngine:
    """Start with `AsyncLLMEngine(config)`; stop with `await shutdown()`."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        output_timeout: float = 300.0,
    ) -> None:
        self.engine = engine or LLMEngine(config)
        self.output_timeout = output_timeout
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and stream its outputs (each carries new_token_ids / new_text)."""
        queue = await self.add_request(request_id, prompt, params, prefill_only=prefill_only)
        finished = False
        try:
            while not finished:
                item = await asyncio.wait_for(queue.get(), self.output_timeout)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await self.abort(request_id)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
    ) -> asyncio.Queue[Any]:
        """Queue a request; returns its output queue. InvalidParameterError on bad input."""
        self._check_alive()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:
            if request_id in self._streams:
                raise InvalidParameterError("request_id", f"{request_id!r} already exists")
            self.engine.add_request(request_id, prompt, params, prefill_only=prefill_only)
            self._streams[request_id] = (loop, queue)

        await self.call(add)
        self._wake.set()
        return queue

    async def abort(self, request_id: str) -> bool:
        """Abort a request (idempotent); True if it was still running."""

        def abort() -> bool:
            output = self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if output is not None and stream is not None:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, output)
            return output is not None

        return await self.call(abort)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in a thread while holding the engine lock (between steps)."""

        def locked() -> T:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop; open streams end with EngineDeadError."""
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout)
        self._fail_streams(EngineDeadError("engine shut down"))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # -- worker thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    self._deliver(outputs)
                if not busy:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as error:  # the loop must report, not vanish
            self._error = error
            self._fail_streams(EngineDeadError(f"engine step failed: {error!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream[0].call_soon_threadsafe(stream[1].put_nowait, output)

    def _fail_streams(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for loop, queue in streams.values():
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, error)

    def _check_alive(self) -> None:
        if self._error is not None or self._stop.is_set():
            raise EngineDeadError(f"engine is not running ({self._error!r})")
