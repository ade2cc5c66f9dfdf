"""The Starlette app of the HTTP door: an adapter over the FrontDoor's request path.

Routes: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST
/v1/chat/completions, GET /health (200 while a usable worker set is registered, else 503; GET
and POST /ping the same), GET /metrics (the control plane's Prometheus registry), and vLLM's
POST /tokenize, POST /detokenize (through a worker's tokenizer) and GET /version. A request's
id ("cmpl-…", "chatcmpl-…") is its front-door request id. Failures before the first token are
HTTP errors in OpenAI's shape (an unexpected exception a 500 server_error); a failure after it
ends the stream with an `error` event. A client that goes away, streaming or not, cancels the
run, which releases its blocks on every worker as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from importlib import metadata
from typing import Any, TypeVar

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.front_door import FrontDoor
from control_plane.openai_http.auth import ApiKeyMiddleware
from control_plane.openai_http.errors import ApiError, bad_param, from_failure, grpc_code
from control_plane.openai_http.schema import (
    Kind,
    ParsedRequest,
    parse,
    parse_detokenize,
    parse_tokenize,
)
from control_plane.openai_http.server import ResponseCut
from control_plane.openai_http.stream import DONE, Answer, Echo, sse
from control_plane.run import RELAY_BUFFER, RpcFailure
from kvmesh.v1 import generation_pb2

LOG = logging.getLogger("kvmesh.control_plane.http")
T = TypeVar("T")
Responses = AsyncGenerator[generation_pb2.GenerateResponse, None]
ID_PREFIX: dict[Kind, str] = {"completion": "cmpl", "chat": "chatcmpl"}
DEFAULT_BODY_BYTES = 4 << 20
INLINE_BODY_BYTES = 64 << 10  # larger bodies are decoded off the event loop
VERSION = metadata.version("kvmesh")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class OpenAIApp:
    def __init__(
        self,
        door: FrontDoor,
        registry: CollectorRegistry,
        api_keys: Sequence[str] = (),
        on_refused: Callable[[], object] | None = None,
        max_body_bytes: int = DEFAULT_BODY_BYTES,
    ) -> None:
        self.door = door
        self.registry = registry
        self.api_keys = tuple(api_keys)
        self.on_refused = on_refused
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    def asgi(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        handlers = {ApiError: api_error, HTTPException: http_error, Exception: server_error}
        middleware = (
            [Middleware(ApiKeyMiddleware, keys=self.api_keys, on_refused=self.on_refused)]
            if self.api_keys
            else []
        )
        return Starlette(
            routes=routes,
            exception_handlers=handlers,  # type: ignore[arg-type]
            middleware=middleware,
        )

    # -- plain endpoints -------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        ready = self.door.serving
        return JSONResponse({"status": "ok" if ready else "unavailable"}, 200 if ready else 503)

    async def version(self, request: Request) -> Response:
        """The server's version (vLLM's /version: its own package's)."""
        return JSONResponse({"version": VERSION})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """The served model, as OpenAI's list of models."""
        return JSONResponse({"object": "list", "data": [self.model_object(self.model_info())]})

    async def model(self, request: Request) -> Response:
        """The served model by its id (404 model_not_found for any other id)."""
        info, wanted = self.model_info(), request.path_params["model"]
        if wanted != info.model_name:
            raise ApiError(404, f"model {wanted!r} is not served (serving {info.model_name!r})",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(self.model_object(info))

    def model_object(self, info: generation_pb2.ModelInfo) -> dict[str, object]:
        return {"id": info.model_name, "object": "model", "created": self.created,
                "owned_by": "kvmesh", "max_model_len": info.max_model_len}  # fmt: skip

    def model_info(self) -> generation_pb2.ModelInfo:
        try:
            return self.door.model_info()
        except RpcFailure as failure:
            raise from_failure(failure) from None

    # -- tokenizing (vLLM's extra endpoints) -------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a completion's prompt or a chat's messages as the token ids a
        generation request would prefill (the worker's own Prepare: chat template, tokenizer),
        with the model's context length, and with `return_token_strs` each id's token."""
        parsed = await json_body(request, self.max_body_bytes, parse_tokenize)
        info = self.served(parsed.model)
        prompt_param = "messages" if parsed.request.WhichOneof("prompt") == "chat" else "prompt"
        try:
            ids = await self.door.tokenize(parsed.request)
            strs = (await self.door.detokenize(ids, True))[1] if parsed.return_token_strs else None
        except RpcFailure as failure:
            raise from_failure(failure, prompt_param) from None
        return JSONResponse({"count": len(ids), "max_model_len": info.max_model_len,
                             "tokens": ids, "token_strs": strs})  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids as the model's tokenizer decodes them together; more
        ids than the model's context are a 400 naming `tokens` before any worker call."""
        model, tokens = await json_body(request, self.max_body_bytes, parse_detokenize)
        max_len = self.served(model).max_model_len
        if len(tokens) > max_len:
            raise bad_param("tokens", f"{len(tokens)} ids; at most {max_len} (the context)")
        try:
            text, _ = await self.door.detokenize(tokens)
        except RpcFailure as failure:
            raise from_failure(failure, "tokens") from None
        return JSONResponse({"prompt": text})

    def served(self, model: str | None) -> generation_pb2.ModelInfo:
        """The served model's info; ApiError 404 model_not_found when `model` names another."""
        info = self.model_info()
        if model is not None and model != info.model_name:
            raise ApiError(404, f"model {model!r} is not served (serving {info.model_name!r})",
                           param="model", code="model_not_found")  # fmt: skip
        return info

    # -- generation ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def generate(self, request: Request, kind: Kind) -> Response:
        try:
            parsed, answer = await self.accept(request, kind)
        except ApiError as error:  # refused before a run: counted and traced like the door's
            self.door.refused(grpc_code(error), error.message)
            raise
        n = parsed.n
        deadline = asyncio.get_running_loop().time() + self.door.request_seconds
        owner = self.door.owner(request.headers.items())
        batch = len(parsed.requests) > 1  # each prompt's run: a request span of its own
        runs = [
            numbered(self.door.generate(each, owner=owner, nested=batch), i * n, i)
            for i, each in enumerate(parsed.requests)
        ]
        prompt_param = "prompt" if kind == "completion" else "messages"
        try:
            firsts = await until_disconnect(request, first_responses(runs))
            responses = runs[0] if len(runs) == 1 else merged(runs)
            if parsed.stream:
                events = stream_events(answer, parsed, firsts, responses, prompt_param)
                return RunStream(events, responses, runs, deadline)
            await until_disconnect(request, keep_all(answer, firsts, responses))
            return BoundedJSON(answer.final(), deadline)
        except PromptFailure as failed:
            return failed.answer(parsed, prompt_param).response()
        except ClientGone:
            return Response(status_code=499)
        except StopAsyncIteration:
            raise ApiError(500, "no response from the workers", type="server_error") from None

    async def accept(self, request: Request, kind: Kind) -> tuple[ParsedRequest, Answer]:
        """The parsed body (ApiError 400/404/503 before any run starts) and its answer,
        whose id is the request id."""
        limits = self.door.limits
        parsed = await json_body(request, self.max_body_bytes, lambda b: parse(b, kind, limits))
        if len(parsed.requests) > 1:  # a batch is admitted whole, before any run starts
            try:
                self.door.check_batch(len(parsed.requests))
            except RpcFailure as failure:
                raise from_failure(failure) from None
        served = self.served(parsed.model).model_name
        echo = None
        if parsed.echo:
            echo = Echo([r.text for r in parsed.requests], prompt_only=parsed.prompt_only)
        answer = Answer(kind, f"{ID_PREFIX[kind]}-{uuid.uuid4().hex}", parsed.model or served,
                        parsed.logprobs, n=parsed.n, echo=echo,
                        prompt_logprobs=parsed.prompt_logprobs)  # fmt: skip
        for i, each in enumerate(parsed.requests):  # a batch's prompts: "<id>-<i>"
            each.request_id = answer.id if len(parsed.requests) == 1 else f"{answer.id}-{i}"
        if parsed.user:
            LOG.debug("request %s from user %r", answer.id, parsed.user)
        return parsed, answer


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes (ApiError 413 beyond it, before reading it all)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, limit: int, parser: Callable[[Any], T]) -> T:
    """`parser` of the decoded JSON body (off the event loop when large): ApiError 413 beyond
    `limit` bytes, 400 when not JSON, too deeply nested, or holding an unpaired surrogate."""
    raw = await read_body(request, limit)

    def decoded() -> T:
        try:
            body = json.loads(raw)
        except ValueError:  # includes UnicodeDecodeError: the body is not UTF-8
            raise ApiError(400, "the request body is not valid JSON (UTF-8)") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        try:
            return parser(body)
        except UnicodeEncodeError:  # a lone surrogate escape ("\ud800") in some string
            raise not_unicode(body) from None

    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(decoded)
    return decoded()


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")  # fmt: skip


def not_unicode(body: object) -> ApiError:
    """400 naming the top-level param holding a string that cannot be encoded as UTF-8."""
    param = None
    if isinstance(body, dict):
        for key, value in body.items():
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                param = str(key)
                break
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}a string is not valid Unicode (an unpaired surrogate)",
                    param=param, code="invalid_value")  # fmt: skip


def bounded(send: Send, deadline: float) -> Send:
    """`send` whose every write ends by `deadline` (event-loop time): one still waiting for
    the client to take the bytes before it then raises ResponseCut (the server drops the
    connection); a write that does not wait is never cut."""

    async def bounded_send(message: Message) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await send(message)
        except TimeoutError:
            raise ResponseCut(
                "the client did not read the response by the request's deadline"
            ) from None

    return bounded_send


class BoundedJSON(JSONResponse):
    """A JSON response written a piece at a time, each write bounded by `deadline`: a client
    that does not read its answer loses the connection then, instead of holding it, and the
    whole body buffered for it, for as long as it likes."""

    PIECE = 64 << 10  # the transport's high-water mark: a piece waits while it is above that

    def __init__(self, content: Any, deadline: float) -> None:
        super().__init__(content)
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = bounded(send, self.deadline)
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        body = memoryview(self.body)
        for start in range(0, max(len(body), 1), self.PIECE):
            piece = bytes(body[start : start + self.PIECE])
            more = start + self.PIECE < len(body)
            await send({"type": "http.response.body", "body": piece, "more_body": more})


class RunStream(StreamingResponse):
    """An SSE response that closes its events (and so its run) however the response ends,
    even when the client left before the first byte was sent. Its writes end by `deadline`
    (event-loop time): a client that stops reading cannot hold its runs past the request's
    time, the connection is dropped then (`bounded`)."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        responses: Responses,
        runs: list[Responses],
        deadline: float,
    ) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self.events, self.responses, self.runs = events, responses, runs
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, bounded(send, self.deadline))
        finally:  # closing an unstarted generator runs none of its code: close every run too
            await self.events.aclose()
            await self.responses.aclose()
            for run in self.runs:
                await run.aclose()


class PromptFailure(Exception):
    """Prompt `index` of a request failed (its run raised `failure`)."""

    def __init__(self, index: int, failure: RpcFailure) -> None:
        super().__init__(failure.message)
        self.index, self.failure = index, failure

    def answer(self, parsed: ParsedRequest, prompt_param: str) -> ApiError:
        """The HTTP error; in a batch its message starts with `prompt[index]` (also its param
        when the prompt itself was refused). A refused length names the body's field for it
        (chat's max_completion_tokens)."""
        if len(parsed.requests) == 1:
            return renamed_length(from_failure(self.failure, prompt_param), parsed)
        where = f"prompt[{self.index}]"
        error = renamed_length(from_failure(self.failure, where), parsed)
        if not error.message.startswith(where):
            error.message = f"{where}: {error.message}"
        return error


def renamed_length(error: ApiError, parsed: ParsedRequest) -> ApiError:
    """`error` with its param `max_tokens` (and the field at the start of its message) named
    as the body named it."""
    name = parsed.max_tokens_param
    if error.param == "max_tokens" and name != "max_tokens":
        error.param = name
        for prefix in ("sampling.max_tokens", "max_tokens"):
            if error.message.startswith(prefix):
                error.message = name + error.message[len(prefix) :]
                break
    return error


async def numbered(responses: Responses, offset: int, prompt: int) -> Responses:
    """Prompt `prompt`'s responses with their choice index moved past the previous prompts';
    its failure is a PromptFailure naming it."""
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                response.index += offset
                yield response
        except RpcFailure as failure:
            raise PromptFailure(prompt, failure) from None


async def first_responses(runs: list[Responses]) -> list[generation_pb2.GenerateResponse]:
    """Every run's first response, awaited together; when one fails (PromptFailure naming
    it) or the wait is cancelled, every run is closed (its blocks released) first."""
    tasks = [asyncio.ensure_future(anext(run)) for run in runs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:
            await run.aclose()
        for task in tasks:
            failure = None if task.cancelled() else task.exception()
            if isinstance(failure, PromptFailure):
                raise failure from None
        raise
    return [task.result() for task in tasks]


async def merged(runs: list[Responses]) -> Responses:
    """The responses of several runs as they arrive. At most RELAY_BUFFER of them wait here
    (each run's pump waits for room), so a client that reads slowly holds its runs back as a
    single run's relay does. A run's failure ends it (raised as the run raised it), and closing
    it closes every run: the others are cancelled, their blocks released."""
    Item = generation_pb2.GenerateResponse | BaseException | None  # None: a run's end
    queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=RELAY_BUFFER)

    async def pump(run: Responses) -> None:
        # Cancelled (the consumer left) it puts nothing more: no pump waits for room then.
        try:
            async for response in run:
                await queue.put(response)
        except Exception as error:  # handed to the consumer, which ends there
            await queue.put(error)
        else:
            await queue.put(None)

    pumps = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        left = len(runs)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for run in runs:
            await run.aclose()


async def keep_all(
    answer: Answer, firsts: list[generation_pb2.GenerateResponse], responses: Responses
) -> None:
    for first in firsts:
        answer.keep(first)
    async for response in responses:
        answer.keep(response)


async def stream_events(
    answer: Answer,
    parsed: ParsedRequest,
    firsts: list[generation_pb2.GenerateResponse],
    responses: Responses,
    prompt_param: str,
) -> AsyncGenerator[str, None]:
    """SSE events: a chat's role chunk per choice (vLLM's and OpenAI's first chunks, sent when
    the first token is there), one chunk per response, the usage chunk when asked, then [DONE].

    Starlette cancels this iterator when the client disconnects, which cancels the run."""

    def event(response: generation_pb2.GenerateResponse) -> str:
        chunk = answer.chunk(response)
        if parsed.continuous_usage:  # vLLM's continuous_usage_stats: every chunk's usage
            chunk["usage"] = answer.choice_usage(response.index)
        elif parsed.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    async with contextlib.aclosing(responses):
        if answer.kind == "chat":  # every choice's role first, as vLLM sends it
            prompt = prompt_tokens(firsts[0]) if parsed.continuous_usage else None
            for index in range(parsed.n):
                yield sse(answer.role_chunk(index, prompt, parsed.include_usage))
        for first in firsts:
            yield event(first)
        try:
            async for response in responses:
                yield event(response)
        except PromptFailure as failed:
            yield sse(failed.answer(parsed, prompt_param).body())
    if parsed.include_usage:
        yield sse(answer.usage_chunk())
    yield DONE


def prompt_tokens(response: generation_pb2.GenerateResponse) -> int:
    """The prompt's length as a run's first response tells it."""
    return response.prompt_tokens or (
        response.usage.prompt_tokens if response.HasField("usage") else 0
    )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then it is cancelled, ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # the run is finished (blocks released) before returning
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error.response()


def http_error(request: Request, error: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in OpenAI's error shape."""
    assert isinstance(error, HTTPException)
    return ApiError(error.status_code, str(error.detail), code=str(error.status_code)).response()


def server_error(request: Request, error: Exception) -> Response:
    """Any other exception: a 500 in OpenAI's error shape (Starlette raises it on to the
    server, which logs it with its traceback)."""
    return ApiError(500, "internal server error", type="server_error",
                    code="internal_error").response()  # fmt: skip


def openai_app(
    door: FrontDoor,
    registry: CollectorRegistry,
    api_keys: Sequence[str] = (),
    on_refused: Callable[[], object] | None = None,
    max_body_bytes: int = DEFAULT_BODY_BYTES,
) -> ASGIApp:
    """The HTTP door's app; with `api_keys`, every /v1 route requires one of them
    (`on_refused` is called for each request refused); bodies over `max_body_bytes` get 413.
    Traced by the OpenTelemetry ASGI middleware: a SERVER span per request (but /health, /ping
    and /metrics), child of the caller's W3C `traceparent`; the front door makes it the request
    span."""
    app = OpenAIApp(door, registry, api_keys, on_refused, max_body_bytes).asgi()
    return OpenTelemetryMiddleware(  # type: ignore[no-any-return]
        app, excluded_urls="/health,/ping,/metrics", exclude_spans=["receive", "send"]
    )
