"""Threads that prepare (render, tokenize) requests off the worker's event loop, in two lanes.

Tokenizing a large prompt takes seconds (megabytes of text); on the event loop it would stop
heartbeats and every stream. Here small prompts run in their own lane, so they never queue
behind large ones, and large prompts are bounded: `large_threads` run at once, at most
`max_large_waiting` more wait, and beyond that Prepare is refused at once with
RESOURCE_EXHAUSTED (a retry delay attached) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import grpc

from kvmesh.service.status import ServiceError
from kvmesh.v1 import generation_pb2

T = TypeVar("T")
LARGE_PROMPT_BYTES = 256 << 10  # prompts beyond this are "large"


class PreparePool:
    def __init__(
        self, small_threads: int = 4, large_threads: int = 2, max_large_waiting: int = 4
    ) -> None:
        self._small = ThreadPoolExecutor(small_threads, thread_name_prefix="kvmesh-prepare")
        self._large = ThreadPoolExecutor(large_threads, thread_name_prefix="kvmesh-prepare-large")
        self._limit = large_threads + max_large_waiting
        self._large_busy = 0  # admitted large prompts whose thread work has not ended
        self._lock = threading.Lock()

    async def run(self, prompt_bytes: int, work: Callable[[], T]) -> T:
        """`work()` in a thread of the lane for a prompt of `prompt_bytes` (ServiceError
        RESOURCE_EXHAUSTED when the large lane is full)."""
        if prompt_bytes <= LARGE_PROMPT_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self._small, work)
        with self._lock:
            if self._large_busy >= self._limit:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prompt: {self._large_busy} large prompts are being prepared; retry later",
                )
            self._large_busy += 1
        future = self._large.submit(self._counted, work)
        future.add_done_callback(self._if_cancelled)
        return await asyncio.wrap_future(future)

    def _counted(self, work: Callable[[], T]) -> T:
        try:
            return work()
        finally:  # counted down when the thread is done, even if the caller went away
            self._done()

    def _if_cancelled(self, future: Future[T]) -> None:
        if future.cancelled():  # never started: `_counted` will not count it down
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._large_busy -= 1

    @property
    def large_busy(self) -> int:
        return self._large_busy

    def close(self) -> None:
        """Drop queued work; running threads finish on their own."""
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


def prompt_bytes(message: generation_pb2.GenerateRequest) -> int:
    """The size of a client request's prompt: text or chat contents (characters; a chat's
    template variables and documents too), token ids count 4 bytes each (cheap: no
    encoding)."""
    which = message.WhichOneof("prompt")
    if which == "text":
        return len(message.text)
    if which == "chat":
        chat = message.chat
        extra = len(chat.template_kwargs) + len(chat.documents)
        return extra + sum(len(m.content) + len(m.role) + len(m.name) for m in chat.messages)
    if which == "token_ids":
        return 4 * len(message.token_ids.ids)
    return 0
