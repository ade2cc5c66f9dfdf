"""State of one Generate call at the front door, and conversion of worker responses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from control_plane.ledger import WorkerRef
from kvmesh.telemetry.logs import request_scope
from kvmesh.v1 import generation_pb2, worker_pb2
from kvmesh.v1.status import Failure

if TYPE_CHECKING:
    from control_plane.request_span import RequestSpan

DEFAULT_MAX_TOKENS = 16  # what a worker generates when the request leaves max_tokens unset
# sampling.max_tokens -1: no bound but the model's context (the HTTP door's chat default). The
# front door does not know the prompt's room in the context, so such a run is estimated at
# this many tokens: routing prefers the decode worker with the most free blocks, and a drain
# waits for it up to its cap.
MAX_TOKENS_UP_TO_CONTEXT = -1
UP_TO_CONTEXT_ESTIMATE = 1 << 20
# Responses relayed from the worker but not yet taken by the client's write, at most: past it
# the relay stops reading the worker's stream, so a client that reads slowly (or not at all)
# pushes back on the worker instead of filling the control plane's memory.
RELAY_BUFFER = 64
# A write to the client still waiting this long after an Abort or a drain's cut is taken as
# stuck (the client is not reading) and cut short; one in progress completes first.
STUCK_WRITE_SECONDS = 0.2


class RpcFailure(Failure):
    """The request ends with this gRPC status (message names the field or the worker); the
    status mapping is `kvmesh.v1.status`, shared with the workers."""


class WorkerLost(Exception):
    """A worker the request depends on died or became unreachable."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


@dataclass
class Timings:
    queue: float = 0.0
    prefill: float = 0.0
    transfer: float = 0.0
    first_decode: float = 0.0
    ttft: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class TokenTimes:
    """When each completion's tokens were relayed: the inter-token gaps (one per token after
    a completion's first; a response of k tokens counts its gap since the previous response
    as k gaps of gap/k, the first response's extra tokens as gaps of 0), first and last token
    times and token counts per completion index, and the finish reasons."""

    gaps: list[float] = field(default_factory=list)
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, int] = field(default_factory=dict)

    def relayed(self, index: int, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if index in self.last:
            self.gaps.extend([(now - self.last[index]) / num_tokens] * num_tokens)
        else:
            self.first[index] = now
            self.gaps.extend([0.0] * (num_tokens - 1))
        self.last[index] = now
        self.count[index] = self.count.get(index, 0) + num_tokens

    def per_output_token(self) -> list[float]:
        """Mean seconds per token after the first, per completion of 2+ tokens."""
        return [(self.last[i] - self.first[i]) / (n - 1) for i, n in self.count.items() if n >= 2]


@dataclass
class Run:
    request_id: str
    request: generation_pb2.GenerateRequest
    arrival: float
    deadline: float
    clock: Callable[[], float] = time.monotonic
    # Responses of the current attempt, then None once the attempt ended; `room` admits at
    # most RELAY_BUFFER responses waiting (`push` waits for room, `take` makes it).
    queue: asyncio.Queue[generation_pb2.GenerateResponse | None] = field(
        default_factory=asyncio.Queue
    )
    room: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RELAY_BUFFER))
    # The bound of the write to the client in progress, if any (`interrupt` ends it early).
    delivery: asyncio.Timeout | None = None
    attempt: asyncio.Task[None] | None = None
    tries: int = 0
    generation: int | None = None
    # Calls of the current attempt in flight, per worker incarnation; worker ids to avoid on
    # a retry.
    calls: Counter[WorkerRef] = field(default_factory=Counter)
    avoid: set[str] = field(default_factory=set)
    lost: str | None = None
    aborted: bool = False
    owner: str | None = None  # the caller it belongs to (`FrontDoor.owner`): who may Abort it
    model: str = ""  # the served model's name at admission: its span's and its metrics' label
    worker_aborted: bool = False  # a worker ended a completion with FINISH_REASON_ABORT
    streamed: bool = False  # a worker response reached the client (no retry after it)
    status: grpc.StatusCode | None = None
    timings: Timings = field(default_factory=Timings)
    finished_indexes: set[int] = field(default_factory=set)
    tokens_streamed: int = 0  # tokens relayed to the client, all completions together
    tokens: TokenTimes = field(default_factory=TokenTimes)
    cut: str | None = None  # why the server cut the run (drain), when it did
    request_span: RequestSpan | None = None
    finishing: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The prompt's logprobs and text from the prefill worker (disaggregated), until the first
    # response relayed carries them; a colocated worker sends them in its own first response.
    prompt_logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_text: str = ""

    def depends_on(self, worker: WorkerRef, holders: frozenset[WorkerRef]) -> bool:
        """Whether losing `worker` ends the current attempt: a call to it is in flight, or
        it is among the ledger's `holders` of the request's blocks."""
        return self.calls[worker] > 0 or worker in holders

    @contextlib.contextmanager
    def calling(self, worker: WorkerRef) -> Iterator[None]:
        """Count a call to `worker` as in flight while the block runs."""
        self.calls[worker] += 1
        try:
            yield
        finally:
            self.calls[worker] -= 1
            if self.calls[worker] <= 0:
                del self.calls[worker]

    async def push(self, response: generation_pb2.GenerateResponse) -> None:
        """Queue a response for the client, first waiting while RELAY_BUFFER are waiting."""
        await self.room.acquire()
        self.queue.put_nowait(response)

    def take(self, response: generation_pb2.GenerateResponse | None) -> None:
        """Account a response taken off the queue (None, the attempt's end, takes no room)."""
        if response is not None:
            self.room.release()

    def interrupt(self) -> None:
        """Bound the write to the client in progress, if any, to STUCK_WRITE_SECONDS from now
        (Abort, a drain's cut): past it the writer sees its bound expire and names the reason
        (`aborted`, `cut`)."""
        bound = self.delivery
        if bound is None or bound.expired():
            return
        soon = asyncio.get_running_loop().time() + STUCK_WRITE_SECONDS
        when = bound.when()
        bound.reschedule(soon if when is None else min(when, soon))

    def remaining(self) -> float:
        return self.deadline - self.clock()

    def timeout(self) -> float:
        """Timeout for the next worker call; DEADLINE_EXCEEDED when none is left."""
        remaining = self.remaining()
        if remaining <= 0:
            raise RpcFailure(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.request_id!r} ran out of time"
            )
        return remaining

    @property
    def span(self) -> trace.Span:
        """The request span (every worker call and release of the run runs under it)."""
        return trace.INVALID_SPAN if self.request_span is None else self.request_span.span

    @contextlib.contextmanager
    def traced(self) -> Iterator[trace.Span]:
        """The request span as the current span (its status is set by the front door only)
        and the request id in scope for log lines: the run is driven from several tasks (the
        HTTP door reads it from others than the one that admitted it)."""
        span = self.span
        with (
            trace.use_span(span, record_exception=False, set_status_on_exception=False),
            request_scope(self.request_id),
        ):
            yield span

    def event(self, name: str, **workers: str) -> None:
        """An event on the request span naming the chosen workers (`kvmesh.worker.ROLE`)."""
        self.span.add_event(name, {f"kvmesh.worker.{k}": v for k, v in workers.items()})

    def response(self, worker: worker_pb2.DecodeResponse) -> generation_pb2.GenerateResponse:
        """A client response from a decode (or colocated) worker's response."""
        now = self.clock()
        self.tokens_streamed += len(worker.token_ids)
        self.tokens.relayed(worker.index, len(worker.token_ids), now)
        if worker.token_ids and self.timings.ttft is None:
            self.timings.ttft = now - self.arrival
            self.timings.first_decode = worker.first_decode_seconds
        out = generation_pb2.GenerateResponse(
            request_id=self.request_id,
            index=worker.index,
            token_ids=worker.token_ids,
            text=worker.text,
            logprobs=worker.logprobs,
            finish_reason=worker.finish_reason,
            prompt_tokens=self.timings.prompt_tokens,
        )
        out.prompt_logprobs.extend(worker.prompt_logprobs or self.prompt_logprobs)
        out.prompt_text = worker.prompt_text or self.prompt_text
        self.prompt_logprobs, self.prompt_text = [], ""  # sent once
        which = worker.WhichOneof("stop_reason")
        if which == "stop_token_id":
            out.stop_token_id = worker.stop_token_id
        elif which == "stop_string":
            out.stop_string = worker.stop_string
        if worker.finish_reason == generation_pb2.FINISH_REASON_ABORT:
            self.worker_aborted = True
        if worker.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
            # A colocated worker counts the cached prompt tokens on a completion's last
            # response (a prefill worker on its PrefillResponse): the span and log read it here.
            self.timings.cached_tokens = max(self.timings.cached_tokens, worker.cached_tokens)
            self.finished_indexes.add(worker.index)
            self.tokens.finish_reasons[worker.index] = worker.finish_reason
            out.usage.CopyFrom(self.usage(worker, now))
        return out

    def usage(self, worker: worker_pb2.DecodeResponse, now: float) -> generation_pb2.Usage:
        t = self.timings
        return generation_pb2.Usage(
            prompt_tokens=t.prompt_tokens,
            completion_tokens=worker.completion_tokens,
            cached_tokens=t.cached_tokens,
            ttft_seconds=t.ttft if t.ttft is not None else now - self.arrival,
            ttft_breakdown=generation_pb2.TtftBreakdown(
                queue_seconds=t.queue,
                prefill_seconds=t.prefill,
                transfer_seconds=t.transfer,
                first_decode_seconds=t.first_decode,
            ),
            e2e_seconds=now - self.arrival,
        )

    def max_tokens(self) -> int:
        """Tokens each completion may generate: max_tokens, the workers' default when unset,
        UP_TO_CONTEXT_ESTIMATE when bounded by the context alone."""
        sampling = self.request.sampling
        if not sampling.HasField("max_tokens"):
            return DEFAULT_MAX_TOKENS
        if sampling.max_tokens == MAX_TOKENS_UP_TO_CONTEXT:
            return UP_TO_CONTEXT_ESTIMATE
        return sampling.max_tokens

    def drain_estimate(self, token_seconds: float) -> float:
        """Seconds this run still needs: its tokens left (max_tokens of every completion less
        those streamed) at its own observed pace once it streamed two tokens, else at
        `token_seconds` each; never past its deadline."""
        left = max(0, self.max_tokens() * self.expected_completions() - self.tokens_streamed)
        per_token = token_seconds
        if self.tokens_streamed >= 2 and self.timings.ttft is not None:
            decoding = self.clock() - (self.arrival + self.timings.ttft)
            per_token = max(per_token / 10, decoding / (self.tokens_streamed - 1))
        return max(0.0, min(self.remaining(), left * per_token))

    def expected_completions(self) -> int:
        sampling = self.request.sampling
        return sampling.n if sampling.HasField("n") else 1
