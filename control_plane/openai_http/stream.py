"""OpenAI response objects from GenerateResponses: stream chunks, final bodies, usage, logprobs.

`Answer` accumulates a request's responses (every choice's text, logprobs, finish reason and
usage); `chunk` turns one response into the stream chunk of the same request. Completion
logprobs are `{tokens, token_logprobs, top_logprobs, text_offset}`; chat logprobs are
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token without text from the worker is
named `token_id:<id>`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from control_plane.openai_http.schema import Kind
from kvmesh.v1 import generation_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def token_text(token: str, token_id: int) -> str:
    return token or f"token_id:{token_id}"


def chat_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(items: list[generation_pb2.TokenLogprobs]) -> dict[str, Any]:
    content = []
    for lp in items:
        entry = chat_logprob(token_text(lp.token, lp.token_id), lp.logprob)
        entry["top_logprobs"] = [chat_logprob(token_text(t, i), p) for t, i, p in zip_top(lp)]
        content.append(entry)
    return {"content": content}


def completion_logprobs(items: list[generation_pb2.TokenLogprobs], offset: int) -> dict[str, Any]:
    """Logprobs of consecutive tokens whose text starts at `offset` in the choice's text."""
    tokens, offsets = [], []
    for lp in items:
        tokens.append(token_text(lp.token, lp.token_id))
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(t, i): p for t, i, p in zip_top(lp)} for lp in items],
        "text_offset": offsets,
    }


def zip_top(lp: generation_pb2.TokenLogprobs) -> list[tuple[str, int, float]]:
    texts = list(lp.top_tokens) or [""] * len(lp.top_token_ids)
    return list(zip(texts, lp.top_token_ids, lp.top_logprobs, strict=False))


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far (text offsets of completion logprobs)
    logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    started: bool = False  # chat: the assistant role was sent


@dataclass
class Answer:
    """One request's answer as responses arrive; `id` doubles as the request id."""

    kind: Kind
    id: str
    model: str
    logprobs: int | None
    n: int = 1  # choices per prompt: choice i belongs to prompt i // n
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, response: generation_pb2.GenerateResponse) -> Choice:
        """Record a response; returns its choice (state before this response's text)."""
        choice = self.choices.setdefault(response.index, Choice())
        if response.HasField("usage"):
            prompt = response.index // self.n
            self.prompt_tokens[prompt] = response.usage.prompt_tokens
            cached = max(self.cached_tokens.get(prompt, 0), response.usage.cached_tokens)
            self.cached_tokens[prompt] = cached
            choice.completion_tokens = response.usage.completion_tokens
        if response.finish_reason in FINISH_REASONS:
            choice.finish_reason = FINISH_REASONS[response.finish_reason]
        return choice

    def usage(self) -> dict[str, Any]:
        """Tokens of every prompt and every choice."""
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def header(self, streaming: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, response: generation_pb2.GenerateResponse) -> dict[str, Any]:
        """The stream chunk of one response (recorded in the answer too)."""
        choice = self.add(response)
        logprobs = list(response.logprobs)
        entry: dict[str, Any] = {"index": response.index}
        if self.kind == "completion":
            entry["text"] = response.text
            entry["logprobs"] = self._completion_lp(logprobs, choice.length)
        else:
            delta: dict[str, Any] = {"content": response.text}
            if not choice.started:
                delta = {"role": "assistant", **delta}
                choice.started = True
            entry["delta"] = delta
            entry["logprobs"] = chat_logprobs(logprobs) if self.logprobs is not None else None
        entry["finish_reason"] = choice.finish_reason
        choice.length += len(response.text)
        return {**self.header(True), "choices": [entry]}

    def keep(self, response: generation_pb2.GenerateResponse) -> None:
        """Record a response of a non-streamed request (text and logprobs kept whole)."""
        choice = self.add(response)
        choice.text.append(response.text)
        choice.logprobs.extend(response.logprobs)

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response body."""
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            entry: dict[str, Any] = {"index": index}
            if self.kind == "completion":
                entry["text"] = text
                entry["logprobs"] = self._completion_lp(c.logprobs, 0)
            else:
                entry["message"] = {"role": "assistant", "content": text}
                entry["logprobs"] = chat_logprobs(c.logprobs) if self.logprobs is not None else None
            entry["finish_reason"] = c.finish_reason
            choices.append(entry)
        return {**self.header(False), "choices": choices, "usage": self.usage()}

    def _completion_lp(
        self, items: list[generation_pb2.TokenLogprobs], offset: int
    ) -> dict[str, Any] | None:
        return None if self.logprobs is None else completion_logprobs(items, offset)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.header(True), "choices": [], "usage": self.usage()}
