"""How the serving benchmark sends one request and times its stream.

`GrpcBackend` drives kvmesh's front door with `kvmesh.client.AsyncClient`; `OpenAIBackend`
drives any OpenAI-compatible server (kvmesh's HTTP door, `vllm serve`) with httpx, streaming
`/v1/completions` (token-id or text prompts) or `/v1/chat/completions` (text), with
`stream_options.include_usage` for the token count. Both send greedy requests with EOS ignored
(`ignore_eos`, an extension both kvmesh and vLLM accept). Every streamed event that carries
output is one timestamp in `RequestRecord.chunk_times` (an event may hold several tokens): a
gRPC response with token ids, an HTTP event with a choice, its text empty or not (a token whose
text the detokenizer holds back is still a token; vLLM's benchmark times these events alike),
a chat's first event too: the role with empty content, sent with the first token (vLLM's
benchmark takes its time as the first token's); it alone is no token when counting events.
The prompt's length is the server's count (its usage) where it gives one, as vLLM's benchmark
takes it: a chat template's tokens, text prompts in tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.loadgen.workloads import BenchRequest

ENDPOINTS = ("completions", "chat")


@dataclass
class RequestRecord:
    """What the client saw of one request (perf_counter seconds)."""

    index: int
    group: str
    prompt_len: int
    expected_output: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a one-token answer."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]


class Backend(Protocol):
    async def send(self, index: int, request: BenchRequest) -> RequestRecord: ...

    async def close(self) -> None: ...


def _record(index: int, request: BenchRequest) -> RequestRecord:
    return RequestRecord(index, request.group, request.prompt_len, request.output_len,
                         time.perf_counter())  # fmt: skip


class GrpcBackend:
    """kvmesh's GenerationService; `client_options` are AsyncClient keywords (TLS, api_key)."""

    def __init__(self, target: str, timeout: float, **client_options: Any) -> None:
        from kvmesh.client import NO_RETRY, AsyncClient

        self.client = AsyncClient(target, timeout=timeout, retry=NO_RETRY, **client_options)

    async def vocab_size(self) -> int:
        return int((await self.client.model_info()).vocab_size)

    async def send(self, index: int, request: BenchRequest) -> RequestRecord:
        from kvmesh.client import KvmeshError

        record = _record(index, request)
        try:
            async for chunk in self.client.generate(request.prompt, max_tokens=request.output_len,
                                                    temperature=0.0, ignore_eos=True):  # fmt: skip
                if chunk.token_ids:
                    record.chunk_times.append(time.perf_counter())
                    record.output_tokens += len(chunk.token_ids)
                if chunk.usage is not None and chunk.usage.prompt_tokens:
                    record.prompt_len = chunk.usage.prompt_tokens
        except KvmeshError as error:
            record.error = str(error)
        return record

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """An OpenAI-compatible server at `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, base_url: str, timeout: float, endpoint: str = "completions",
                 model: str | None = None, api_key: str | None = None) -> None:  # fmt: skip
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
        if endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers,
                                      timeout=httpx.Timeout(timeout, connect=10.0),
                                      limits=limits)  # fmt: skip
        self.endpoint = endpoint
        self.model = model
        self.timeout = timeout

    async def served_model(self) -> str:
        """The `model` field to send: the given one, else the server's first model."""
        if self.model is None:
            response = await self.http.get("models")
            response.raise_for_status()
            self.model = str(response.json()["data"][0]["id"])
        return self.model

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}  # fmt: skip
        if self.endpoint == "chat":
            if not isinstance(request.prompt, str):
                raise ValueError("chat needs text prompts (give --tokenizer)")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, index: int, request: BenchRequest) -> RequestRecord:
        """One streamed request; `timeout` bounds it as a whole, as the gRPC backend's deadline
        does (a stream still running then is cut and fails DEADLINE_EXCEEDED)."""
        import httpx

        await self.served_model()
        record = _record(index, request)
        try:
            await asyncio.wait_for(self._stream(record, request), self.timeout)
        except asyncio.TimeoutError:
            record.error = f"DEADLINE_EXCEEDED: no complete answer within {self.timeout:g} s"
        except httpx.HTTPError as error:
            record.error = f"{type(error).__name__}: {error}"
        return record

    async def _stream(self, record: RequestRecord, request: BenchRequest) -> None:
        """Send `request` and time its events into `record` (HTTP errors raise)."""
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        counted = 0
        async with self.http.stream("POST", path, json=self.body(request)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for event in _events(response.aiter_lines()):
                if "error" in event:
                    record.error = f"stream error: {event['error']}"
                elif event.get("choices"):
                    record.chunk_times.append(time.perf_counter())
                    counted += not is_role_chunk(event)
                usage = event.get("usage")
                if usage:
                    record.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens"):
                        record.prompt_len = int(usage["prompt_tokens"])
        if not record.output_tokens:  # no usage chunk: one token per event
            record.output_tokens = counted

    async def close(self) -> None:
        await self.http.aclose()


def is_role_chunk(event: dict[str, Any]) -> bool:
    """A chat stream's first event of a choice: its role and empty content, no token."""
    delta = event["choices"][0].get("delta") or {}
    return "role" in delta and not delta.get("content")


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
