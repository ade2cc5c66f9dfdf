"""Python client of a running kvmesh system (the control plane's GenerationService).

    from kvmesh.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="")
        result = client.complete([1, 2, 3], max_tokens=8, timeout=10)
        scored = client.complete("Hi", max_tokens=1, logprobs=2, prompt_logprobs=2)
        # scored.completions[0].logprobs, scored.prompt_logprobs: Logprob entries
        reply = client.complete_chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        more = client.complete_chat(messages, add_generation_prompt=False,
                                    continue_final_message=True,
                                    chat_template_kwargs={"enable_thinking": False})

Sampling keywords are the fields of `kvmesh.v1.SamplingParams` (vLLM's names); unset ones take
the server's defaults. Chat calls take vLLM's chat template options (`add_generation_prompt`,
`continue_final_message`, `add_special_tokens`, `chat_template_kwargs`, `documents`; see
`chat_messages`); a text prompt's `add_special_tokens=False` leaves out the tokenizer's BOS.
`timeout` (seconds) is the gRPC deadline of the call, i.e. the request's
deadline. Every gRPC failure is raised as a `KvmeshError` subclass carrying the status code and
the server's message. A call refused before any response arrived — RESOURCE_EXHAUSTED with the
server's retry delay (admission full), or UNAVAILABLE — is retried within bounds (`retry`, a
`RetryPolicy`: 2 retries, 5 s of waiting, never past the call's deadline; `NO_RETRY` turns it
off). `AsyncClient` has the same methods as coroutines / async iterators.
Importing this module never imports torch.

Security: `api_key=` sends `authorization: Bearer KEY` on every call (the front door's
`--api-key-file`); `metadata=` adds fixed metadata to every call, and each call takes its own
`metadata=` too. `ca=` (PEM file) connects with TLS verifying the server against it, `tls=True`
with TLS against the system roots; `cert=` and `key=` present a client certificate (mutual TLS).
Tracing: a call made while an OpenTelemetry span is current carries its context (`traceparent`),
so the request's trace continues the caller's.

"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate

from kvmesh.client_retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from kvmesh.v1 import generation_pb2, generation_pb2_grpc, wire

GENERATION_SERVICE = "kvmesh.v1.GenerationService"
SERVING_CHECK = health_pb2.HealthCheckRequest(service=GENERATION_SERVICE)
FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
_REPEATED_SAMPLING = frozenset({"stop", "stop_token_ids"})
Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]
# text, token ids, a conversation, or one with its rendering options (`chat_messages`)
Prompt = str | Sequence[int] | Messages | generation_pb2.ChatMessages
# Keywords a chat call takes for `chat_messages` (vLLM's chat request fields).
CHAT_OPTIONS = frozenset(
    {"add_generation_prompt", "continue_final_message", "add_special_tokens",
     "chat_template_kwargs", "documents"}
)  # fmt: skip
# Keywords of vLLM's chat requests the server cannot honour: refused by name.
_REFUSED = {
    "chat_template": "is not supported: the server renders with the model's own chat template",
    "tools": "is not supported: tool calling is not supported",
}


# -- errors ----------------------------------------------------------------------------------


class KvmeshError(Exception):
    """A call failed; `code` is the gRPC status, `message` the server's explanation."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class InvalidArgument(KvmeshError):
    """A request field is invalid (the message names it); nothing was started."""


class NotFound(KvmeshError):
    """Abort of a request id the server does not know."""


class ResourceExhausted(KvmeshError):
    """The system is at capacity; retry after `retry_after_ms`."""


class DeadlineExceeded(KvmeshError):
    """The call's deadline expired; the request's blocks were released."""


class Unavailable(KvmeshError):
    """No worker of a needed role is alive, one died mid-request, or the server is down."""


class Aborted(KvmeshError):
    """The request was aborted with Abort."""


class Cancelled(KvmeshError):
    """The call was cancelled by this client."""


_ERRORS: dict[grpc.StatusCode, type[KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_rpc(error: grpc.RpcError) -> KvmeshError:
    """The typed exception for a failed call (KvmeshError itself for other codes)."""
    code = error.code()  # type: ignore[attr-defined]
    retry = wire.retry_delay_ms(error)
    message = error.details() or ""  # type: ignore[attr-defined]
    return _ERRORS.get(code, KvmeshError)(code, message, retry)


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise a failed call's grpc.RpcError as its KvmeshError subclass."""
    try:
        yield
    except grpc.RpcError as error:
        raise error_from_rpc(error) from None


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Token counts and timings of one completion (seconds), as the front door measured them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_seconds: float
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    first_decode_seconds: float
    e2e_seconds: float

    @classmethod
    def from_proto(cls, usage: generation_pb2.Usage) -> Usage:
        b = usage.ttft_breakdown
        return cls(
            usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
            usage.ttft_seconds, b.queue_seconds, b.prefill_seconds, b.transfer_seconds,
            b.first_decode_seconds, usage.e2e_seconds,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Logprob:
    """One position's raw-model log-probabilities: the token's (None for a prompt's first
    token, which nothing precedes), its rank (1 = most likely; 0 unknown), and the top
    alternatives as (token id, text, logprob), best first; `token_bytes` the token's own bytes
    (part of a UTF-8 character for some tokens, whose text is then U+FFFD). Texts and bytes are
    empty without a tokenizer."""

    token_id: int
    token: str
    logprob: float | None
    rank: int
    top: tuple[tuple[int, str, float], ...]
    token_bytes: bytes = b""

    @classmethod
    def from_proto(cls, lp: generation_pb2.TokenLogprobs) -> Logprob:
        texts = list(lp.top_tokens) or [""] * len(lp.top_token_ids)
        top = tuple(zip(lp.top_token_ids, texts, lp.top_logprobs, strict=False))
        logprob = lp.logprob if not math.isnan(lp.logprob) else None
        return cls(lp.token_id, lp.token, logprob, lp.rank, top, lp.token_bytes)


@dataclass(frozen=True)
class Chunk:
    """One streamed response: new tokens of completion `index` (with their logprobs when
    `logprobs` was asked for); the last one has usage. The request's first chunk carries the
    prompt's logprobs and text when `prompt_logprobs` was asked for."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    stop_reason: int | str | None = None
    usage: Usage | None = None
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob, ...] = ()
    prompt_text: str = ""

    @classmethod
    def from_proto(cls, r: generation_pb2.GenerateResponse) -> Chunk:
        which = r.WhichOneof("stop_reason")
        return cls(
            request_id=r.request_id,
            index=r.index,
            token_ids=tuple(r.token_ids),
            text=r.text,
            finish_reason=FINISH_REASONS.get(r.finish_reason),
            stop_reason=getattr(r, which) if which else None,
            usage=Usage.from_proto(r.usage) if r.HasField("usage") else None,
            logprobs=tuple(Logprob.from_proto(lp) for lp in r.logprobs),
            prompt_logprobs=tuple(Logprob.from_proto(lp) for lp in r.prompt_logprobs),
            prompt_text=r.prompt_text,
        )


@dataclass
class Completion:
    """One finished completion (all of its chunks joined)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    logprobs: list[Logprob] = field(default_factory=list)  # one per token, when asked for


@dataclass
class Result:
    """What `complete` returns: every completion of the request, by index, and the prompt's
    logprobs (one per prompt token) and decoded text when `prompt_logprobs` was asked for."""

    request_id: str
    completions: list[Completion]
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    prompt_text: str = ""

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.completions[0].usage


def collect(request_id: str, chunks: list[Chunk]) -> Result:
    """Join streamed chunks into a Result."""
    by_index: dict[int, Completion] = {}
    prompt: list[Logprob] = []
    prompt_text = ""
    for chunk in chunks:
        c = by_index.setdefault(chunk.index, Completion(chunk.index))
        c.text += chunk.text
        c.token_ids.extend(chunk.token_ids)
        c.logprobs.extend(chunk.logprobs)
        prompt.extend(chunk.prompt_logprobs)
        prompt_text = prompt_text or chunk.prompt_text
        if chunk.finish_reason is not None:
            c.finish_reason, c.stop_reason, c.usage = (
                chunk.finish_reason, chunk.stop_reason, chunk.usage,
            )  # fmt: skip
    return Result(request_id, [by_index[i] for i in sorted(by_index)], prompt, prompt_text)


def build_request(
    prompt: Prompt,
    request_id: str | None = None,
    cache_salt: bytes = b"",
    add_special_tokens: bool | None = None,
    **sampling: Any,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for text, token ids or a conversation (a list of {"role", "content"}
    mappings, or `chat_messages`' ChatMessages); `add_special_tokens` is a text prompt's (None:
    the server's default, true). Unknown sampling keywords raise TypeError naming them."""
    request = generation_pb2.GenerateRequest(
        request_id=request_id or f"cli-{uuid.uuid4().hex}", cache_salt=cache_salt
    )
    if add_special_tokens is not None:
        request.add_special_tokens = _flag(add_special_tokens, "add_special_tokens")
    if isinstance(prompt, generation_pb2.ChatMessages):
        request.chat.CopyFrom(prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        request.chat.CopyFrom(chat_messages(cast(Messages, prompt)))
    else:
        request.token_ids.ids.extend(int(i) for i in cast(Sequence[int], prompt))
    known = generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for name, value in sampling.items():
        if name in _REFUSED or name in CHAT_OPTIONS:
            refused = _REFUSED.get(name, "is an option of a chat call (chat, complete_chat)")
            raise TypeError(f"{name} {refused}")
        if name not in known:
            raise TypeError(f"unknown sampling field {name!r}")
        if value is None:
            continue
        if name in _REPEATED_SAMPLING:
            getattr(request.sampling, name).extend(value)
        elif name == "logit_bias":  # a mapping of token ids to biases
            request.sampling.logit_bias.update(value)
        else:
            setattr(request.sampling, name, value)
    return request


def chat_messages(
    messages: Messages,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    documents: Sequence[Mapping[str, str]] | None = None,
) -> generation_pb2.ChatMessages:
    """The wire form of a conversation and how the server renders it, vLLM's chat request
    fields with their defaults and meaning: `add_generation_prompt` (open the assistant's
    turn), `continue_final_message` (leave the final message open for the model to continue;
    needs add_generation_prompt=False), `add_special_tokens` (the tokenizer's special tokens on
    top of the template's), `chat_template_kwargs` (extra template variables, e.g.
    `{"enable_thinking": False}`; sent as JSON) and `documents` (the template's `documents`, a
    list of mappings of strings; sent as JSON). TypeError for an item that is not a mapping of
    strings with role and content (and optionally name), or an option of the wrong type;
    ValueError for options JSON cannot encode. The server checks the rest (INVALID_ARGUMENT
    naming e.g. `prompt.chat.template_kwargs`), and refuses a `chat_template` among the
    variables."""
    chat = generation_pb2.ChatMessages()
    if not _flag(add_generation_prompt, "add_generation_prompt"):
        chat.add_generation_prompt = False  # unset: true
    chat.continue_final_message = _flag(continue_final_message, "continue_final_message")
    chat.add_special_tokens = _flag(add_special_tokens, "add_special_tokens")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise TypeError("chat_template_kwargs must be a mapping of template variables")
        chat.template_kwargs = _json(dict(chat_template_kwargs), "chat_template_kwargs")
    if documents is not None:
        if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
            raise TypeError("documents must be a list of mappings of strings")
        chat.documents = _json(list(documents), "documents")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a mapping with role and content")
        try:
            name = message.get("name") or ""
            chat.messages.add(role=message["role"], content=message["content"], name=name)
        except (KeyError, TypeError) as exc:
            raise TypeError(f"messages[{i}] needs string role and content ({exc})") from None
    return chat


def _flag(value: Any, name: str) -> bool:
    """`value` when it is a bool; TypeError naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False")
    return value


def _json(value: Any, name: str) -> str:
    """`value` as compact JSON text; ValueError naming `name` when JSON cannot hold it."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{name} must be JSON-encodable: {exc}") from None


# -- clients ---------------------------------------------------------------------------------


Metadata = Sequence[tuple[str, str]]


def channel_credentials(
    tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files, or None for plaintext (no TLS option given)."""
    if not (tls or ca or cert or key):
        return None
    if (cert is None) != (key is None):
        raise ValueError("cert and key go together (the client certificate and its key)")
    files = {name: None if path is None else Path(path).read_bytes()
             for name, path in (("ca", ca), ("cert", cert), ("key", key))}  # fmt: skip
    return grpc.ssl_channel_credentials(files["ca"], files["key"], files["cert"])


class _CallOptions:
    """What every call of a client carries: its default deadline and metadata."""

    def __init__(self, timeout: float | None, api_key: str | None, metadata: Metadata) -> None:
        self.timeout = timeout  # default deadline of every call (seconds); None = none
        auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._metadata = (*auth, *metadata)

    def metadata(self, metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
        """The client's metadata followed by one call's own, then the caller's current trace
        context (W3C `traceparent`) unless one of those already carries it."""
        given = (*self._metadata, *(metadata or ()))
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        keys = {key.lower() for key, _ in given}
        return (*given, *((k, v) for k, v in carrier.items() if k not in keys))


def channel_options(max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, int]]:
    """Message limits, and keepalive pings while a call is open (also while no data flows):
    a server that froze or a connection that went half-open fails the call UNAVAILABLE
    within about 15 s, even for a call without a deadline (`kvmesh.v1.wire.client_options`)."""
    return wire.client_options(max_message_bytes)


class Stream:
    """Iterator of Chunks of one Generate call; `cancel()`, or leaving the iteration early
    (`break`), cancels the request. The call is
    started by `start(timeout)`, again (bounded by `retry`) when it is refused before any
    response arrived. A cancel from another thread is never lost to a retry: during the wait
    the iteration raises Cancelled, and a retried call started around the cancel is cancelled
    too (the swap of the current call and the cancel are serialised)."""

    def __init__(
        self,
        request_id: str,
        start: Callable[[float | None], Any],
        timeout: float | None = None,
        retry: RetryPolicy = NO_RETRY,
    ) -> None:
        self.request_id = request_id
        self._retries = retry.start(timeout)
        self._start = start
        self._cancelled = threading.Event()
        self._lock = threading.Lock()  # orders cancel() against the swap to a retried call
        self._call = start(timeout)

    def __iter__(self) -> Iterator[Chunk]:
        """The chunks of the current call (and of its retries); a consumer that stops early
        (`break`, an exception in its loop, closing the iterator) cancels the request."""
        try:
            yield from self._chunks()
        finally:
            with self._lock:
                call = self._call
            call.cancel()  # nothing left to cancel when the call had ended

    def _chunks(self) -> Iterator[Chunk]:
        while True:
            received = False
            try:
                for response in self._call:
                    received = True
                    yield Chunk.from_proto(response)
                return
            except grpc.RpcError as error:
                delay = None if received else self._retries.delay(error)
                if delay is None:
                    raise error_from_rpc(error) from None
                if self._cancelled.wait(delay):
                    raise self._cancelled_error() from None
            self._retry()

    def _retry(self) -> None:
        """Start the next attempt and make it the current call; one that a cancel() reached
        first is cancelled (its iteration then raises Cancelled)."""
        if self._cancelled.is_set():
            raise self._cancelled_error()
        call = self._start(self._retries.timeout())
        with self._lock:
            self._call = call
            cancelled = self._cancelled.is_set()
        if cancelled:
            call.cancel()

    def _cancelled_error(self) -> Cancelled:
        return Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the client while retrying")

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            call = self._call
        call.cancel()


def _retrying(
    method: Any, request: Any, timeout: float | None, retry: RetryPolicy, metadata: Metadata = ()
) -> Any:
    """A unary call (each attempt with `metadata`), retried within `retry`'s bounds;
    KvmeshError when it fails."""
    retries = retry.start(timeout)
    while True:
        try:
            return method(request, timeout=retries.timeout(), metadata=metadata)
        except grpc.RpcError as error:
            delay = retries.delay(error)
            if delay is None:
                raise error_from_rpc(error) from None
        time.sleep(delay)


async def _retrying_async(
    method: Callable[..., Awaitable[Any]],
    request: Any,
    timeout: float | None,
    retry: RetryPolicy,
    metadata: Metadata = (),
) -> Any:
    retries = retry.start(timeout)
    while True:
        try:
            return await method(request, timeout=retries.timeout(), metadata=metadata)
        except grpc.RpcError as error:
            delay = retries.delay(error)
            if delay is None:
                raise error_from_rpc(error) from None
        await asyncio.sleep(delay)


class Client:
    """Blocking client; one channel per instance (thread-safe; use as a context manager)."""

    def __init__(
        self, target: str, *, timeout: float | None = None, api_key: str | None = None,
        metadata: Metadata = (), tls: bool = False, ca: str | None = None,
        cert: str | None = None, key: str | None = None, retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:  # fmt: skip
        self.target = target
        self._options = _CallOptions(timeout, api_key, metadata)
        self.retry = retry
        credentials = channel_credentials(tls, ca, cert, key)
        self._channel = (
            grpc.insecure_channel(target, options=channel_options())
            if credentials is None
            else grpc.secure_channel(target, credentials, options=channel_options())
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    @property
    def timeout(self) -> float | None:
        return self._options.timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self, prompt: Prompt, *, request_id: str | None = None, timeout: float | None = None,
        cache_salt: bytes = b"", metadata: Metadata | None = None,
        add_special_tokens: bool | None = None, **sampling: Any,
    ) -> Stream:  # fmt: skip
        """Start a request (text, token ids, or a conversation as chat takes it); iterate the
        returned Stream for its chunks. `add_special_tokens=False` tokenizes a text prompt
        without the tokenizer's special tokens (BOS); None, the server's default (with)."""
        request = build_request(prompt, request_id, cache_salt, add_special_tokens, **sampling)
        deadline = timeout or self.timeout
        call_metadata = self._options.metadata(metadata)

        def start(left: float | None) -> Any:
            return self._stub.Generate(request, timeout=left, metadata=call_metadata)

        return Stream(request.request_id, start, deadline, self.retry)

    def complete(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Run a request to the end and return its completions (same arguments as generate)."""
        stream = self.generate(prompt, **kwargs)
        return collect(stream.request_id, list(stream))

    def chat(
        self, messages: Messages, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, add_special_tokens: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Sequence[Mapping[str, str]] | None = None, **kwargs: Any,
    ) -> Stream:  # fmt: skip
        """Start a chat request: `messages` rendered with the model's chat template (by
        default with the assistant's turn opened), the options as `chat_messages` takes them
        (vLLM's names, defaults and meaning); other arguments as generate."""
        chat = chat_messages(
            _as_chat(messages), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens, chat_template_kwargs=chat_template_kwargs,
            documents=documents,
        )  # fmt: skip
        return self.generate(chat, **kwargs)

    def complete_chat(self, messages: Messages, **kwargs: Any) -> Result:
        """Run a chat request to the end (arguments, the chat options included, as chat)."""
        stream = self.chat(messages, **kwargs)
        return collect(stream.request_id, list(stream))

    def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Abort a request; False when it had already finished (NotFound when unknown)."""
        request = generation_pb2.AbortRequest(request_id=request_id)
        response = _retrying(
            self._stub.Abort,
            request,
            timeout or self.timeout,
            self.retry,
            self._options.metadata(metadata),
        )
        return bool(response.aborted)

    def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> generation_pb2.ModelInfo:
        request = generation_pb2.GetModelInfoRequest()
        info = _retrying(
            self._stub.GetModelInfo,
            request,
            timeout or self.timeout,
            self.retry,
            self._options.metadata(metadata),
        )
        return cast(generation_pb2.ModelInfo, info)

    def serving(self, *, timeout: float = 1.0) -> bool:
        """Whether the front door reports GenerationService SERVING (workers registered)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = stub.Check(SERVING_CHECK, timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


class AsyncClient:
    """asyncio client (grpc.aio); create and use it inside one running event loop."""

    def __init__(
        self, target: str, *, timeout: float | None = None, api_key: str | None = None,
        metadata: Metadata = (), tls: bool = False, ca: str | None = None,
        cert: str | None = None, key: str | None = None, retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:  # fmt: skip
        self.target = target
        self._options = _CallOptions(timeout, api_key, metadata)
        self.retry = retry
        credentials = channel_credentials(tls, ca, cert, key)
        self._channel = (
            grpc.aio.insecure_channel(target, options=channel_options())
            if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=channel_options())
        )
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    @property
    def timeout(self) -> float | None:
        return self._options.timeout

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(None)

    async def generate(
        self, prompt: Prompt, *, request_id: str | None = None, timeout: float | None = None,
        cache_salt: bytes = b"", metadata: Metadata | None = None,
        add_special_tokens: bool | None = None, **sampling: Any,
    ) -> AsyncIterator[Chunk]:  # fmt: skip
        """Async iterator of a request's chunks; closing it early cancels the request. A call
        refused before its first response is retried within `retry`'s bounds. Arguments as
        Client.generate."""
        request = build_request(prompt, request_id, cache_salt, add_special_tokens, **sampling)
        retries = self.retry.start(timeout or self.timeout)
        call_metadata = self._options.metadata(metadata)
        while True:
            call = self._stub.Generate(request, timeout=retries.timeout(), metadata=call_metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield Chunk.from_proto(response)
                return
            except grpc.RpcError as error:
                delay = None if received else retries.delay(error)
                if delay is None:
                    raise error_from_rpc(error) from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def complete(self, prompt: Prompt, **kwargs: Any) -> Result:
        request_id = kwargs.pop("request_id", None) or f"cli-{uuid.uuid4().hex}"
        chunks = [c async for c in self.generate(prompt, request_id=request_id, **kwargs)]
        return collect(request_id, chunks)

    def chat(self, messages: Messages, **kwargs: Any) -> AsyncIterator[Chunk]:
        """Async iterator of a chat request's chunks (arguments, the chat options included, as
        Client.chat)."""
        chat, rest = _chat_call(messages, kwargs)
        return self.generate(chat, **rest)

    async def complete_chat(self, messages: Messages, **kwargs: Any) -> Result:
        """Run a chat request to the end (arguments as Client.chat)."""
        chat, rest = _chat_call(messages, kwargs)
        return await self.complete(chat, **rest)

    async def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        request = generation_pb2.AbortRequest(request_id=request_id)
        abort, call_metadata = self._stub.Abort, self._options.metadata(metadata)
        response = await _retrying_async(
            abort, request, timeout or self.timeout, self.retry, call_metadata
        )
        return bool(response.aborted)

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> generation_pb2.ModelInfo:
        request = generation_pb2.GetModelInfoRequest()
        get, call_metadata = self._stub.GetModelInfo, self._options.metadata(metadata)
        info = await _retrying_async(
            get, request, timeout or self.timeout, self.retry, call_metadata
        )
        return cast(generation_pb2.ModelInfo, info)

    async def serving(self, *, timeout: float = 1.0) -> bool:
        """Whether the front door reports GenerationService SERVING (workers registered)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(SERVING_CHECK, timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def _chat_call(
    messages: Messages, kwargs: dict[str, Any]
) -> tuple[generation_pb2.ChatMessages, dict[str, Any]]:
    """The ChatMessages of a chat call's messages and chat options, and its other keywords."""
    options = {k: v for k, v in kwargs.items() if k in CHAT_OPTIONS}
    rest = {k: v for k, v in kwargs.items() if k not in CHAT_OPTIONS}
    return chat_messages(_as_chat(messages), **options), rest


def _as_chat(messages: Messages) -> list[Mapping[str, str]]:
    """`messages` as a list; an empty one or a plain string is a TypeError (not a chat)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role', 'content'} mappings")
    listed = list(messages)
    if not listed:
        raise ValueError("messages must contain at least one message")
    return listed
