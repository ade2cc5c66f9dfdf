"""PrefillService: Prepare (validate + tokenize), Prefill (compute, ship KV, first token), Release.

Prefill runs the request prefill-only with chunked prefill on this worker's engine and ships its
KV to the reservation named by `target` as one streamed send (`KVSender.start_stream`), started
with the prefill. A step hook on the engine thread (`KVExport`, through the engine's KV connector
`disagg.ready_blocks`) hands the sender thread the blocks that are final, never waiting itself:
with `--transfer-overlap` (the default) each finished chunk's full blocks go out while the next
chunk computes; with `--no-transfer-overlap` the whole set goes once the request is PREFILLED.
At PREFILLED the hook adds the rest and finishes the send with the first tokens (and their
logprobs) as the transfer's trailer, so the decode worker has them with the KV; a first token
that already ends the request finishes it without KV. The receiver acknowledges once, after the
last frame; only then are the blocks released (back to the pool, full blocks staying in the
prefix cache), or on any failure. The whole call is bounded by its deadline and
`transfer_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from kv_transfer.interface import KVSender, StreamSendHandle
from kv_transfer.state import TransferRequest, TransferResult
from kvmesh.engine import disagg
from kvmesh.engine.async_engine import AsyncLLMEngine, RequestStream
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sequence import Request
from kvmesh.service.convert import add_prompt_scores, first_tokens
from kvmesh.service.runtime import WorkerRuntime, check_layout
from kvmesh.service.status import ServiceError, abort_with, status_of
from kvmesh.telemetry import request_scope
from kvmesh.telemetry.metrics import WorkerMetrics, status_name
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from prefill_svc.export import KVExport
from prefill_svc.senders import SenderPool, endpoint_problem
from prefill_svc.spans import ChunkEvents, TransferSpan

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

DEFAULT_TRANSFER_TIMEOUT = 30.0
CANCEL_GRACE_SECONDS = 0.2  # a cancel ends the request stream at most this long before the call
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


@dataclasses.dataclass
class ActivePrefill:
    generation: int
    deadline: float
    task: asyncio.Task[Any] | None
    state: int = worker_pb2.BLOCK_SET_STATE_FILLING
    num_blocks: int = 0


@dataclasses.dataclass
class Timings:
    arrival: float
    added: float = 0.0
    first: float = 0.0
    transfer: float = 0.0


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        runtime: WorkerRuntime,
        senders: SenderPool,
        metrics: WorkerMetrics,
        transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
        *,
        transfer_overlap: bool = True,
    ) -> None:
        self.runtime = runtime
        self.senders = senders
        self.metrics = metrics
        self.transfer_timeout = transfer_timeout
        self.transfer_overlap = transfer_overlap
        self.active: dict[str, ActivePrefill] = {}
        # Calls cancelled by Release, not by their caller.
        self.released: set[asyncio.Task[Any]] = set()

    async def Prepare(
        self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareResponse:
        return await self.runtime.serve_prepare(request, context)

    async def Detokenize(
        self, request: worker_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DetokenizeResponse:
        return await self.runtime.serve_detokenize(request, context)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        timings = Timings(time.monotonic())
        return await self._serve(context, self._prefill_known(request, context, timings))

    async def PrefillAhead(
        self,
        request_iterator: AsyncIterator[worker_pb2.PrefillRequest],
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        timings = Timings(time.monotonic())
        messages = aiter(request_iterator)
        return await self._serve(context, self._prefill_ahead(messages, context, timings))

    async def _serve(
        self, context: grpc.aio.ServicerContext, body: Awaitable[worker_pb2.PrefillResponse]
    ) -> worker_pb2.PrefillResponse:
        """Run a Prefill call's body, mapping its failure to the call's status once (a call its
        caller cancelled is counted CANCELLED)."""
        task = asyncio.current_task()
        try:
            return await body
        except asyncio.CancelledError:
            if task not in self.released:  # the caller cancelled: nobody awaits a status
                self.metrics.request_done(grpc.StatusCode.CANCELLED)
                raise
            self.metrics.request_done(grpc.StatusCode.ABORTED)
            await context.abort(grpc.StatusCode.ABORTED, "request_id: released by Release")
            raise
        except Exception as exc:
            self.metrics.request_done(status_of(exc)[0])
            await abort_with(context, exc)
            raise
        finally:
            self.released.discard(task)

    async def _prefill_known(
        self,
        message: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        request = self.runtime.request_from(message.request, prefill_only=True)
        self._check_target(message.target, request, message.target.generation)
        self._check_new(request)
        target: asyncio.Future[worker_pb2.KVTarget] = asyncio.get_running_loop().create_future()
        target.set_result(message.target)
        return await self._prefill(request, message.target.generation, target, context, timings)

    def _call_deadline(self, context: grpc.aio.ServicerContext) -> float:
        """When the call must end (monotonic): its own deadline, or the worker's transfer
        bound from now for a call without one."""
        remaining = context.time_remaining()
        return time.monotonic() + (self.transfer_timeout if remaining is None else remaining)

    async def _prefill_ahead(
        self,
        messages: AsyncIterator[worker_pb2.PrefillRequest],
        context: grpc.aio.ServicerContext,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        wait = self._call_deadline(context) - time.monotonic()
        try:
            first = await asyncio.wait_for(anext(messages, None), max(0.0, wait))
        except TimeoutError:
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "request: the call's first message did not come before its deadline",
            ) from None
        if first is None:
            raise ServiceError(INVALID_ARGUMENT, "request: the call carried no message")
        if first.HasField("target"):
            raise ServiceError(INVALID_ARGUMENT, "target: comes in the call's second message")
        if first.generation == 0:
            raise ServiceError(INVALID_ARGUMENT, "generation: must be non-zero")
        prepared = first.request
        if first.HasField("prompt"):
            prepared = await self.runtime.prepare_request(first.prompt)
        request = self.runtime.request_from(prepared, prefill_only=True)
        request_scope.enter(request.request_id)
        self._check_new(request)
        target = asyncio.ensure_future(self._second_target(messages, request, first.generation))
        target.add_done_callback(_retrieve)
        try:
            return await self._prefill(request, first.generation, target, context, timings)
        finally:
            target.cancel()

    async def _second_target(
        self,
        messages: AsyncIterator[worker_pb2.PrefillRequest],
        request: Request,
        generation: int,
    ) -> worker_pb2.KVTarget:
        """The target of PrefillAhead's second message, checked. A caller's cancel ends the
        request stream too, just before grpc cancels the call: a stream ended without a target
        is refused only once that grace passed (a cancelled call is counted CANCELLED)."""
        message = await anext(messages, None)
        if message is None:
            await asyncio.sleep(CANCEL_GRACE_SECONDS)  # cancelled meanwhile if the caller left
        if message is None or not message.HasField("target"):
            raise ServiceError(INVALID_ARGUMENT, "target: the call ended without one")
        self._check_target(message.target, request, generation)
        return message.target

    def _check_target(self, target: worker_pb2.KVTarget, request: Request, generation: int) -> None:
        mismatch = check_layout(self.runtime.layout, target.layout, "target.layout")
        if mismatch is not None:
            raise ServiceError(FAILED_PRECONDITION, mismatch)
        if target.backend not in self.senders.backends:
            raise ServiceError(
                FAILED_PRECONDITION,
                f"target.backend: {target.backend!r} is not one of {self.senders.backends}",
            )
        problem = endpoint_problem(target.backend, target.endpoint)
        if problem is not None:
            raise ServiceError(INVALID_ARGUMENT, f"target.endpoint: {problem}")
        block_size = self.runtime.layout.block_size
        needed = -(-len(request.seqs[0].prompt_ids) // block_size)
        if len(target.block_ids) != needed:
            raise ServiceError(
                INVALID_ARGUMENT,
                f"target.block_ids: {len(target.block_ids)} blocks for a prompt needing {needed}",
            )
        try:
            if len(bytes.fromhex(target.transfer_id)) != 16:
                raise ValueError
        except ValueError:
            raise ServiceError(INVALID_ARGUMENT, "target.transfer_id: not 32 hex digits") from None
        if target.generation == 0:
            raise ServiceError(INVALID_ARGUMENT, "target.generation: must be non-zero")
        if target.generation != generation:
            raise ServiceError(
                FAILED_PRECONDITION,
                f"target.generation: {target.generation} is not the call's {generation}",
            )

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.active:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.request_id!r} in progress"
            )

    async def _prefill(
        self,
        request: Request,
        generation: int,
        target: asyncio.Future[worker_pb2.KVTarget],
        context: grpc.aio.ServicerContext,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        """Prefill at once, its KV (and then its first tokens) streamed to `target` once known."""
        rid, engine = request.request_id, self.runtime.engine
        deadline = self._call_deadline(context)
        self.active[rid] = active = ActivePrefill(generation, deadline, asyncio.current_task())
        export = KVExport(overlap=self.transfer_overlap)
        export.events = ChunkEvents(trace.get_current_span())
        run = EngineRun(engine, request, export, timings)
        try:
            if not target.done():  # compute while the decode worker reserves
                await run.start()
            named = await named_by(target, deadline)
            return await self._ship(named, run, active, timings)
        finally:
            run.close()  # the release, queued on the engine before the caller hears back
            self.active.pop(rid, None)

    async def _ship(
        self,
        target: worker_pb2.KVTarget,
        run: EngineRun,
        active: ActivePrefill,
        timings: Timings,
    ) -> worker_pb2.PrefillResponse:
        """Send the request's KV to `target` as the engine finalises it; the response once the
        receiver acknowledged the last frame."""
        active.num_blocks = len(target.block_ids)
        backend, endpoint = target.backend, target.endpoint
        sender = self.senders.take_idle(backend, endpoint)
        handle: StreamSendHandle | None = None
        with TransferSpan(target, len(target.block_ids)) as span:
            try:
                if sender is None:
                    sender = await self._connect(backend, endpoint, active.deadline)
                transfer = TransferRequest(bytes.fromhex(target.transfer_id), target.generation)
                handle = sender.start_stream(
                    transfer, list(target.block_ids), deadline=active.deadline
                )
                run.export.attach(handle, len(target.block_ids))
                try:
                    result = await self._ended_before_first(run, handle)
                    if result is None:  # the first tokens came; the transfer ends after them
                        output = await run.first()
                        active.state = worker_pb2.BLOCK_SET_STATE_SENDING
                        result = await self._await_sent(handle, timings)
                except BaseException as error:
                    self._abandoned(handle, backend, error)
                    raise
                finally:
                    span.parts = run.export.parts
                span.settled(result)
                self._settle(result, target)
                self.metrics.request_done(grpc.StatusCode.OK)
                return self._response(output, timings, result, self.runtime.core.tokenizer)
            finally:
                if sender is not None:
                    self._give_back(backend, endpoint, sender, handle)

    async def _connect(self, backend: str, endpoint: str, deadline: float) -> KVSender:
        """A sender to `endpoint`, connected on the pool's own threads with a handshake that
        ends by the call's `deadline` (DEADLINE_EXCEEDED naming `target` when it failed at
        it). A connect its call was cancelled before (its caller left, a Release) never runs;
        one already running goes back to the pool once connected rather than being dropped
        unclosed."""
        connect = self.senders.connect(backend, endpoint, deadline)
        waited = asyncio.wrap_future(connect)
        try:
            return await asyncio.shield(waited)
        except asyncio.CancelledError:
            waited.add_done_callback(_retrieve)  # `_late_sender` handles the outcome
            if not connect.cancel():  # running: it ends by the deadline
                connect.add_done_callback(partial(self._late_sender, backend, endpoint))
            raise
        except Exception:
            if time.monotonic() < deadline:
                raise
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"target: connecting to {endpoint!r} did not finish before the call's deadline",
            ) from None

    def _late_sender(self, backend: str, endpoint: str, connect: Future[KVSender]) -> None:
        if not connect.cancelled() and connect.exception() is None:
            self.senders.release(backend, endpoint, connect.result())

    @staticmethod
    async def _ended_before_first(
        run: EngineRun, handle: StreamSendHandle
    ) -> TransferResult | None:
        """Wait for the prompt's first tokens, or for the transfer to end before them (the
        decode worker released its reservation, its lease ran out, or it died; a transfer
        cannot complete before the first token): its failed result then, so that the call fails
        at once and frees its blocks instead of computing the rest of the prompt for nowhere;
        None once the first tokens came."""
        first = await run.first_future()
        ended = asyncio.ensure_future(handle.wait_async())
        try:
            await asyncio.wait((first, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()  # no-op once done
        if first.done() or not ended.done() or ended.cancelled():
            return None
        result = ended.result()
        return result if result.state.is_terminal and not result.ok else None

    async def _await_sent(self, handle: StreamSendHandle, timings: Timings) -> TransferResult:
        """The receiver's acknowledgement (bounded by `transfer_timeout` from the first token)."""
        result = await handle.wait_async(self.transfer_timeout)
        if not result.state.is_terminal:
            handle.cancel()
            result = await handle.wait_async(2.0)
        timings.transfer = time.monotonic() - timings.first  # the part not hidden by compute
        return result

    def _abandoned(self, handle: StreamSendHandle, backend: str, error: BaseException) -> None:
        """Stop a transfer the call gave up before it ended (its caller left, a Release, the
        prefill failed) and observe it under the status the call ends with."""
        handle.cancel()
        if isinstance(error, asyncio.CancelledError):
            released = asyncio.current_task() in self.released
            code = grpc.StatusCode.ABORTED if released else grpc.StatusCode.CANCELLED
        else:
            code = status_of(error)[0]
        seconds = handle.record.result().seconds
        self.metrics.transfer_seconds.labels(backend, status_name(code)).observe(seconds)

    def _settle(self, result: TransferResult, target: worker_pb2.KVTarget) -> None:
        """Record a finished transfer's metrics (its duration from the sender's start to its
        end, as its span's); raise a ServiceError naming `target` unless the receiver
        acknowledged it."""
        backend, seconds = target.backend, result.seconds
        if result.ok:
            self.metrics.transfer_seconds.labels(backend, "OK").observe(seconds)
        else:
            error = result.error or ServiceError(grpc.StatusCode.ABORTED, result.state.name)
            code, message = status_of(error)
            self.metrics.transfer_seconds.labels(backend, status_name(code)).observe(seconds)
            raise ServiceError(code, f"target: KV transfer to {target.worker_id!r}: {message}")
        self.metrics.transfer_bytes.labels(backend).inc(result.num_bytes)

    def _give_back(
        self, backend: str, endpoint: str, sender: KVSender, handle: StreamSendHandle | None
    ) -> None:
        """Return the sender to the pool once its transfer thread ended (a sender carries one
        transfer at a time); never waits here."""
        if handle is not None:
            handle.cancel()  # no-op once terminal
        thread = None if handle is None else handle.thread
        if thread is None or not thread.is_alive():
            self.senders.release(backend, endpoint, sender)
            return

        def later() -> None:
            thread.join(10.0)
            if thread.is_alive():
                sender.close()
            else:
                self.senders.release(backend, endpoint, sender)

        threading.Thread(target=later, name="kv-sender-return", daemon=True).start()

    @staticmethod
    def _response(
        first: RequestOutput, timings: Timings, result: TransferResult | None, tokenizer: Any
    ) -> worker_pb2.PrefillResponse:
        response = worker_pb2.PrefillResponse(
            first_tokens=first_tokens(first),
            cached_tokens=first.num_cached_tokens,
            queue_seconds=timings.added - timings.arrival,
            prefill_seconds=timings.first - timings.added,
            transfer_seconds=timings.transfer,
            transfer_bytes=0 if result is None else result.num_bytes,
        )
        add_prompt_scores(response, first, tokenizer)  # the control plane relays them
        return response

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(
            released=self.release(request.request_id, request.generation)
        )

    def release(self, request_id: str, generation: int = 0) -> bool:
        """Cancel a prefill in progress (its blocks are freed by its own cleanup)."""
        active = self.active.get(request_id)
        if active is None or generation not in (0, active.generation) or active.task is None:
            return False
        self.released.add(active.task)
        active.task.cancel()
        return True

    def held(self) -> list[worker_pb2.HeldBlockSet]:
        now = time.monotonic()
        return [
            worker_pb2.HeldBlockSet(
                request_id=rid,
                state=a.state,  # type: ignore[arg-type]
                num_blocks=a.num_blocks,
                generation=a.generation,
                lease_remaining_seconds=max(0.0, a.deadline - now),
            )
            for rid, a in self.active.items()
        ]


class EngineRun:
    """The engine side of one Prefill: the request's stream, opened once, and its first
    output (the first tokens, once PREFILLED)."""

    def __init__(
        self, engine: AsyncLLMEngine, request: Request, export: KVExport, timings: Timings
    ) -> None:
        self.engine, self.request, self.export, self.timings = engine, request, export, timings
        self.stream: RequestStream | None = None
        self._first: asyncio.Future[RequestOutput] | None = None

    async def start(self) -> None:
        if self.stream is not None:
            return
        request, timings = self.request, self.timings

        def add(engine: LLMEngine) -> None:
            disagg.add_request(engine, request)
            timings.added = time.monotonic()  # on the engine thread: the prefill starts now

        self.stream = await self.engine.open_stream(
            request.request_id, add, cleanup=disagg.release, on_step=self.export
        )
        self._first = asyncio.ensure_future(anext(self.stream))
        self._first.add_done_callback(self._stamp_first)

    def _stamp_first(self, first: asyncio.Future[RequestOutput]) -> None:
        """`timings.first`: when the engine sampled the first token (now, if it did not)."""
        sampled = None
        if not first.cancelled() and first.exception() is None:
            sampled = first.result().metrics.first_token_time
        self.timings.first = sampled or time.monotonic()

    async def first(self) -> RequestOutput:
        return await (await self.first_future())

    async def first_future(self) -> asyncio.Future[RequestOutput]:
        """The future of the first tokens (started if it was not): awaited, never cancelled,
        by whoever races it against something else."""
        await self.start()
        assert self._first is not None
        return self._first

    def close(self) -> None:
        if self._first is not None:
            self._first.cancel()
        if self.stream is not None:
            self.stream.close()


async def named_by(
    target: asyncio.Future[worker_pb2.KVTarget], deadline: float
) -> worker_pb2.KVTarget:
    """The target once named (DEADLINE_EXCEEDED naming `target` when it is not by `deadline`:
    the call's own deadline, or `transfer_timeout` for a call without one)."""
    try:
        return await asyncio.wait_for(target, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise ServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "target: not named before the call's deadline"
        ) from None


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a failed future's exception retrieved (whoever awaits it reports it)."""
    if not future.cancelled():
        future.exception()
