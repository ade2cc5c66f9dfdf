"""The front door's request path, shared by every transport (gRPC, HTTP).

Each request is a Run: admission (bounded in-flight count), structural checks, then up to
two attempts (a retry only when a worker was lost before any token reached the client). Every
exit path — success, failure, client cancel, deadline, Abort, worker death — closes the ledger
entry and sends Release to every (possible) holder, each bounded by a short timeout. `serve`
also bounds the writes to the client by the run's deadline: a client that stops reading holds
back the worker's stream (a bounded relay buffer), never the run past its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from control_plane.cluster import Cluster
from control_plane.driver import DECODE_SKIP_CODES, Driver, map_error
from control_plane.ledger import Release, WorkerRef
from control_plane.limits import RequestLimits
from control_plane.releases import send_releases
from control_plane.request_span import RequestSpan, capture_from_env, mark_refused
from control_plane.run import RpcFailure, Run, WorkerLost
from control_plane.run_metrics import record_run
from control_plane.validation import FieldError, check_generate_request, check_request_id
from kvmesh.security.credentials import bearer
from kvmesh.telemetry.logs import bind_request_id
from kvmesh.v1 import generation_pb2, status, worker_pb2, worker_pb2_grpc

LOG = logging.getLogger("kvmesh.control_plane")
MAX_TRIES = 2
ABORT_WAIT_SECONDS = 1.0
DRAIN_MARGIN = 1.25  # drain bound = margin x the longest run's estimate + slack, capped
DRAIN_SLACK_SECONDS = 1.0
TOKENIZE_SECONDS = 30.0  # one tokenizer call on a worker
TOKENIZE_SKIP_CODES = DECODE_SKIP_CODES  # a busy or draining worker: the next one is tried
DRAINING = "the control plane is draining; retry on another replica or after it restarts"


def as_failure(error: BaseException) -> RpcFailure:
    """The RpcFailure an exception of the request path stands for (`kvmesh.v1.status`)."""
    failure = status.failure_of(error, internal="control plane error")
    if isinstance(failure, RpcFailure):
        return failure
    return RpcFailure(failure.code, failure.message, failure.retry_after_ms, field=failure.field)


class FrontDoor:
    """The transport-neutral request path; the gRPC servicer and the HTTP app adapt it."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._driver = Driver(cluster)
        self._runs: dict[str, Run] = {}
        # Whom each recently finished request belonged to (as many as the ledger's history).
        self._finished: OrderedDict[str, str | None] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self.capture_content = cluster.config.trace_message_content or capture_from_env()
        cluster.on_worker_lost(self._worker_lost)

    @property
    def inflight(self) -> int:
        return len(self._runs)

    @property
    def limits(self) -> RequestLimits:
        """The per-request size bounds every run is checked against."""
        return self._cluster.config.limits

    def check_batch(self, requests: int) -> None:
        """Whether `requests` sent at once (an HTTP batch of prompts) can be admitted together:
        RpcFailure INVALID_ARGUMENT naming `prompt` when they never could (more than
        `--max-inflight`), RESOURCE_EXHAUSTED with the retry delay when they cannot now."""
        config = self._cluster.config
        if requests > config.max_inflight:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt: a batch of {requests} prompts exceeds the {config.max_inflight} "
                "requests the server runs at once",
                field="prompt",
            )
        if len(self._runs) + requests > config.max_inflight:
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._runs)} requests are in flight; a batch of {requests} prompts "
                "does not fit now, retry later",
                config.retry_after_ms,
            )

    async def wait_idle(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()

    def drain_bound(self, cap: float) -> float:
        """How long a drain waits: the longest in-flight run's estimate (`Run.drain_estimate`
        at `drain_token_seconds` per token until it streams) x 1.25 + 1 s, at most `cap`."""
        token_seconds = self._cluster.config.drain_token_seconds
        estimates = [run.drain_estimate(token_seconds) for run in self._runs.values()]
        if not estimates:
            return 0.0
        return min(cap, DRAIN_MARGIN * max(estimates) + DRAIN_SLACK_SECONDS)

    def cut_all(self, reason: str) -> None:
        """End every run still in flight with UNAVAILABLE naming `reason` (its blocks are
        released as for any other failure)."""
        for run in list(self._runs.values()):
            run.cut = reason
            if run.attempt is not None:
                run.attempt.cancel()
            run.interrupt()

    # -- one request ---------------------------------------------------------------------

    def owner(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Whom a call with this metadata acts for: with API keys configured, a digest of the
        key it presents (each key its own tenant; only it may Abort its requests), else None
        (a single tenant)."""
        key = bearer(metadata) if self._cluster.config.security.api_keys else None
        return None if key is None else hashlib.sha256(key.encode()).hexdigest()

    async def generate(
        self,
        request: generation_pb2.GenerateRequest,
        timeout: float | None = None,
        owner: str | None = None,
        nested: bool = False,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Admit, run and finish one request of `owner`; `timeout` is the client's remaining
        time; `nested`: one of several runs of one transport request, with a request span of
        its own (`RequestSpan`).

        Raises RpcFailure (admission refused, or the run failed: its blocks are released
        before the failure is raised). Closing the iterator early, or cancelling its consumer,
        cancels the run and releases every holder, like a gRPC cancel.
        """
        run = self.open_run(request, timeout, owner, nested)
        try:
            async for response in self.stream(run):
                yield response
        finally:
            await self.settle(run)

    async def serve(
        self,
        request: generation_pb2.GenerateRequest,
        write: Callable[[generation_pb2.GenerateResponse], Awaitable[None]],
        timeout: float | None = None,
        owner: str | None = None,
    ) -> None:
        """Admit, run and finish one request of `owner`, handing each response to `write` (the
        client's write, which waits while the client is not reading); `timeout` is the
        client's remaining time.

        The whole call, writes included, ends by the run's deadline (RpcFailure
        DEADLINE_EXCEEDED), or sooner on Abort (ABORTED) or a drain's cut (UNAVAILABLE).
        Returns or raises only once the run is finished (its blocks released, its outcome on
        its span), also when cancelled (a client cancel: the run ends CANCELLED).
        """
        run = self.open_run(request, timeout, owner)
        try:
            async with contextlib.aclosing(self.stream(run)) as responses:
                async for response in responses:
                    await self._deliver(run, write(response))
        finally:
            await self.settle(run)

    async def _deliver(self, run: Run, write: Awaitable[None]) -> None:
        """Await one write to the client within the run's deadline, or until `Run.interrupt`;
        RpcFailure naming why when it did not complete in time."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + max(run.remaining(), 0.0)) as bound:
                run.delivery = bound
                await write
        except TimeoutError:
            raise self._failed(run, self._interrupted(run)) from None
        finally:
            run.delivery = None

    def _interrupted(self, run: Run) -> RpcFailure:
        """Why a write to the client was cut short: Abort, a drain's cut, else the deadline."""
        if run.aborted:
            return RpcFailure(grpc.StatusCode.ABORTED, f"request {run.request_id!r} was aborted")
        if run.cut is not None:
            return RpcFailure(
                grpc.StatusCode.UNAVAILABLE, run.cut, self._cluster.config.retry_after_ms
            )
        return RpcFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request {run.request_id!r} timed out writing to the client (is it reading?)",
        )

    @staticmethod
    def _failed(run: Run, failure: RpcFailure) -> RpcFailure:
        """Record `failure` as the run's outcome (status, span description); returns it."""
        assert run.request_span is not None
        run.status = failure.code
        run.request_span.failure = failure.message
        return failure

    async def stream(self, run: Run) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """The run's responses; on failure the run is finished first, then RpcFailure raised."""
        assert run.request_span is not None
        try:
            async for response in self._relay(run):
                run.request_span.observe(response)
                yield response
            run.status = grpc.StatusCode.OK
        except RpcFailure as failure:
            self._failed(run, failure)
            await self.settle(run)  # released before the client sees the end
            raise

    def open_run(
        self,
        request: generation_pb2.GenerateRequest,
        client_left: float | None = None,
        owner: str | None = None,
        nested: bool = False,
    ) -> Run:
        """Admission and structural checks (RpcFailure when refused, counted by status); the
        caller must `finish` the returned run."""
        try:
            return self._admit(request, client_left, owner, nested)
        except RpcFailure as failure:
            self.refused(failure.code, failure.message)
            raise

    def refused(self, code: grpc.StatusCode, message: str) -> None:
        """A request refused before it ran (either door): counted by status, and its span
        (the current one) marked ERROR."""
        self._cluster.metrics.requests.labels(code.name).inc()
        mark_refused(code, message)

    def _admit(
        self,
        request: generation_pb2.GenerateRequest,
        client_left: float | None,
        owner: str | None,
        nested: bool,
    ) -> Run:
        if self.draining:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE, DRAINING, self._cluster.config.retry_after_ms
            )
        try:
            request_id = check_generate_request(request, self._cluster.config.limits)
        except FieldError as error:
            raise as_failure(error) from None
        if request_id in self._runs or self._cluster.ledger.is_live(request_id):
            raise RpcFailure(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running"
            )
        config = self._cluster.config
        if len(self._runs) >= config.max_inflight:
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{config.max_inflight} requests are in flight; retry later",
                config.retry_after_ms,
            )
        now = self._cluster.clock()
        budget = config.max_request_seconds
        if client_left is not None:
            budget = min(budget, client_left)
        run = Run(request_id, request, now, now + budget, clock=self._cluster.clock, owner=owner)
        run.model = self._cluster.model_name()
        bind_request_id(request_id)
        run.request_span = RequestSpan(request, request_id, run.model, self.capture_content, nested)
        run.event("admitted")
        self._runs[request_id] = run
        self._idle.clear()
        self._cluster.metrics.inflight.set(len(self._runs))
        return run

    async def _relay(self, run: Run) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while True:
            if run.aborted or run.cut is not None:  # between attempts: no cancel reached it
                raise self._interrupted(run)
            run.tries += 1
            run.calls.clear()
            run.lost = None
            run.worker_aborted = False
            with run.traced():  # the attempt's calls and background releases run under it
                run.attempt = asyncio.create_task(self._driver.attempt(run))
            run.attempt.add_done_callback(lambda _: run.queue.put_nowait(None))
            async for response in self._drain(run):
                yield response
            lost = self._outcome(run)
            if lost is None:
                return
            if run.streamed or run.tries >= MAX_TRIES:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, str(lost))
            self._cluster.metrics.retries.inc()
            run.avoid.add(lost.worker_id)
            with run.traced():
                LOG.info("retrying %s after: %s", run.request_id, lost)
                await self._release(self._cluster.ledger.close(run.request_id, "retried"))

    async def _drain(self, run: Run) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yield the attempt's responses until it ended (its None in the queue), each wait
        bounded by the run's deadline (+ 1 s)."""
        assert run.attempt is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout_at(loop.time() + max(run.remaining(), 0.0) + 1.0):
                    response = await run.queue.get()
                run.take(response)
            except TimeoutError:
                run.attempt.cancel()
                raise RpcFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"request {run.request_id!r} timed out"
                ) from None
            if response is None:
                return
            yield response

    def _outcome(self, run: Run) -> WorkerLost | None:
        """None on success, WorkerLost when a retry may help; raises RpcFailure otherwise."""
        attempt = run.attempt
        assert attempt is not None and attempt.done()
        if attempt.cancelled():
            if run.aborted:
                raise RpcFailure(grpc.StatusCode.ABORTED, f"request {run.request_id!r} was aborted")
            if run.lost is not None:
                return WorkerLost(run.lost, f"worker {run.lost!r} stopped heartbeating")
            if run.cut is not None:
                raise RpcFailure(
                    grpc.StatusCode.UNAVAILABLE, run.cut, self._cluster.config.retry_after_ms
                )
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the control plane is shutting down")
        error = attempt.exception()
        if error is None:
            return None
        if isinstance(error, WorkerLost):
            return error
        failure = as_failure(error)  # RpcFailure, NoRouteError, LedgerError, ... (one table)
        if failure.code == grpc.StatusCode.INTERNAL:
            with run.traced():
                LOG.error("request %s failed", run.request_id, exc_info=error)
        raise failure

    async def settle(self, run: Run) -> None:
        """`finish` the run, to its end even when the caller is cancelled meanwhile (a client
        cancel that follows a failed write): its span is complete before the transport's own
        ends. The cancel is raised once the run is finished."""
        finishing = asyncio.ensure_future(self.finish(run))
        cancelled = False
        while not finishing.done():
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                cancelled = True
        await finishing
        if cancelled:
            raise asyncio.CancelledError

    async def finish(self, run: Run) -> None:
        """Stop the attempt, close the ledger entry, release every holder (once)."""
        if run.finishing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), 3 * ABORT_WAIT_SECONDS)
            return
        run.finishing = True
        attempt = run.attempt
        if attempt is not None and not attempt.done():
            attempt.cancel()
            try:
                await asyncio.wait_for(attempt, ABORT_WAIT_SECONDS)
            except (asyncio.CancelledError, TimeoutError):
                pass  # stopped, or still stopping past the bound: the releases follow anyway
            except Exception as error:  # the run's status is already decided
                LOG.debug("request %s: stopped attempt ended with %r", run.request_id, error)
        elif attempt is not None and not attempt.cancelled():
            attempt.exception()  # retrieved (already reported through the status)
        status = run.status or (
            grpc.StatusCode.ABORTED if run.aborted else grpc.StatusCode.CANCELLED
        )
        with run.traced():  # the releases are part of the request's trace
            await self._release(self._cluster.ledger.close(run.request_id, status.name))
        self._runs.pop(run.request_id, None)
        self._remember(run)
        record_run(self._cluster.metrics, run, status, run.model or self._cluster.model_name())
        self._cluster.metrics.inflight.set(len(self._runs))
        self._end_span(run, status)
        run.done.set()
        if not self._runs:
            self._idle.set()

    def _remember(self, run: Run) -> None:
        """Remember the finished run's owner, for Abort (`history_size` ids at most)."""
        self._finished[run.request_id] = run.owner
        self._finished.move_to_end(run.request_id)
        while len(self._finished) > self._cluster.config.history_size:
            self._finished.popitem(last=False)

    def _end_span(self, run: Run, status: grpc.StatusCode) -> None:
        """The request's last log line and the end of its span."""
        t, span = run.timings, run.request_span
        assert span is not None
        with run.traced():
            LOG.info("request %s finished %s: %d prompt tokens (%d cached), %d output tokens, "
                     "%.3f s", run.request_id, status.name, t.prompt_tokens, t.cached_tokens,
                     span.output_tokens, self._cluster.clock() - run.arrival)  # fmt: skip
        span.end(status, t.prompt_tokens, t.cached_tokens)

    async def _release(self, releases: list[Release]) -> None:
        await send_releases(self._cluster, releases)

    def _worker_lost(self, worker: WorkerRef) -> None:
        """Cancel the attempts that depend on `worker` now: a call to it is in flight, or it
        holds the request's blocks. A worker the run no longer needs (a prefill worker whose
        transfer completed, a decode worker that refused the reservation) ends nothing."""
        ledger = self._cluster.ledger
        for run in self._runs.values():
            if run.attempt is None or run.attempt.done():
                continue
            if run.depends_on(worker, ledger.holders(run.request_id)):
                run.lost = worker.worker_id
                run.attempt.cancel()

    # -- Abort, model info -----------------------------------------------------------------

    async def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Abort a running request of `owner` (True), or a recently finished one (False);
        RpcFailure INVALID_ARGUMENT for a bad id, NOT_FOUND for an id never seen or forgotten,
        and for another owner's request, running or finished (as if unknown: it is neither
        stopped nor revealed)."""
        try:
            if not request_id:
                raise FieldError("request_id", "must not be empty")
            check_request_id(request_id)
        except FieldError as error:
            raise as_failure(error) from None
        run = self._runs.get(request_id)
        if run is not None and run.owner != owner:
            raise self._not_found(request_id)
        if run is not None:
            run.aborted = True
            if run.attempt is not None:
                run.attempt.cancel()
            run.interrupt()  # a write blocked on a client that is not reading ends too
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), ABORT_WAIT_SECONDS)
            return True
        finished = self._cluster.ledger.closed_outcome(request_id) is not None
        if finished and self._finished.get(request_id) == owner:
            return False
        raise self._not_found(request_id)

    @staticmethod
    def _not_found(request_id: str) -> RpcFailure:
        return RpcFailure(
            grpc.StatusCode.NOT_FOUND,
            f"request_id {request_id!r} is not running and not among recently finished requests",
        )

    def model_info(self) -> generation_pb2.ModelInfo:
        """The served model as the live workers that can serve it describe it: "disaggregated"
        with a prefill and a decode worker of equal layouts, else "colocated" with a colocated
        worker; RpcFailure UNAVAILABLE without either (as Generate and health say)."""
        serving = self._cluster.registry.serving_set()
        if serving is None:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE,
                "no usable workers: need a prefill and a decode worker of equal layouts, or a "
                "colocated worker",
            )
        mode, workers = serving
        info = generation_pb2.ModelInfo()
        info.CopyFrom(workers[0].info.model)
        info.mode = mode
        return info

    # -- tokenizing (the HTTP door's /tokenize and /detokenize) ------------------------------

    async def tokenize(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids exactly as a run of `request` would prefill them: the
        worker's own Prepare (validation, chat template, tokenizer) on a prefill or colocated
        worker of the serving set. RpcFailure as a run's checks answer (INVALID_ARGUMENT naming
        the field), UNAVAILABLE without a worker."""
        try:
            request.request_id = check_generate_request(request, self._cluster.config.limits)
        except FieldError as error:
            raise as_failure(error) from None
        call = worker_pb2.PrepareRequest(request=request)
        prepared = await self._tokenizer_call("prepare", "Prepare", call)
        return list(prepared.request.prompt_ids)

    async def detokenize(
        self, token_ids: list[int], token_strs: bool = False
    ) -> tuple[str, list[str]]:
        """The ids' text as the served model's tokenizer decodes them (special tokens kept; an
        id it does not know decodes to nothing) and, with `token_strs`, each id's token string;
        RpcFailure INVALID_ARGUMENT naming `token_ids` for more ids than the model's context or
        a negative one, UNAVAILABLE without a worker."""
        call = worker_pb2.DetokenizeRequest(token_ids=token_ids, token_strs=token_strs)
        answer = await self._tokenizer_call("detokenize", "Detokenize", call)
        return answer.text, list(answer.token_strs)

    async def _tokenizer_call(self, what: str, method: str, message: Any) -> Any:
        """A unary PrefillService call on the serving set's prefill (or colocated) workers,
        least loaded first, the next one tried when a worker is gone or busy."""
        serving = self._cluster.registry.serving_set()
        live = self._cluster.registry.alive_by_role()
        if serving is None:
            workers = []
        elif serving[0] == "disaggregated":
            layouts = [d.layout for d in serving[1]]
            workers = [p for p in live["prefill"] if p.layout in layouts]
        else:
            workers = serving[1]
        last = "no usable workers: need a prefill and a decode worker of equal layouts, or a "
        last += "colocated worker"
        registry = self._cluster.registry
        for worker in sorted(workers, key=lambda w: w.load.waiting + w.load.running):
            if not registry.is_current(worker.worker_id, worker.epoch):
                continue  # reaped during an earlier call: no channel opened to it again
            stub = worker_pb2_grpc.PrefillServiceStub(self._cluster.channels.get(worker.address))
            try:
                return await getattr(stub, method)(message, timeout=TOKENIZE_SECONDS)
            except grpc.aio.AioRpcError as error:
                failure = map_error(error, worker, what)
                if isinstance(failure, RpcFailure) and failure.code not in TOKENIZE_SKIP_CODES:
                    raise failure from None
                last = str(failure)
        raise RpcFailure(grpc.StatusCode.UNAVAILABLE, last, self._cluster.config.retry_after_ms)

    @property
    def request_seconds(self) -> float:
        """The longest any request may run (`--max-request-seconds`), writes included."""
        return self._cluster.config.max_request_seconds

    @property
    def serving(self) -> bool:
        """True while a usable worker set is registered and the door is not draining."""
        return self._cluster.serving and not self.draining
