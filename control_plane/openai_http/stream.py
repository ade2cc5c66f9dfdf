"""OpenAI response objects from GenerateResponses: stream chunks, final bodies, usage, logprobs.

`Answer` accumulates a request's responses (every choice's text, logprobs, finish reason and
usage); `chunk` turns one response into the stream chunk of the same request. Completion
logprobs are `{tokens, token_logprobs, top_logprobs, text_offset}`; chat logprobs are
`{content: [{token, logprob, bytes, top_logprobs}]}`. A token without text from the worker is
named `token_id:<id>`.
"""

from __future__ import annotations

import itertools
import json
import math
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
REPLACEMENT = "\ufffd"  # a token that is part of a character, decoded alone
LOWEST_LOGPROB = -9999.0


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def token_text(token: str, token_id: int) -> str:
    return token or f"token_id:{token_id}"


def json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token the model rules out) as -9999.0, as vLLM
    answers, and so any other non-finite value (a NaN row of raw logprobs): JSON has neither
    infinity nor NaN, the final body's encoder would fail the whole response and a stream's
    event would not be JSON."""
    return max(logprob, LOWEST_LOGPROB) if math.isfinite(logprob) else LOWEST_LOGPROB


def chat_logprob(text: str, logprob: float, raw: bytes = b"") -> dict[str, Any]:
    """One chat logprob entry; `bytes` are the token's own (`raw`, part of a UTF-8 character
    for some tokens), else its text's UTF-8 (a worker that sent none)."""
    return {"token": text, "logprob": json_logprob(logprob), "bytes": list(raw or text.encode())}


def chat_logprobs(items: list[generation_pb2.TokenLogprobs]) -> dict[str, Any]:
    content = []
    for lp in items:
        entry = chat_logprob(token_text(lp.token, lp.token_id), lp.logprob, lp.token_bytes)
        raws = list(lp.top_token_bytes) or [b""] * len(lp.top_token_ids)
        entry["top_logprobs"] = [
            chat_logprob(token_text(t, i), p, raw)
            for (t, i, p), raw in zip(zip_top(lp), raws, strict=False)
        ]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    items: list[generation_pb2.TokenLogprobs],
    offset: int,
    top: int | None = None,
    text: str | None = None,
) -> dict[str, Any]:
    """Logprobs of consecutive tokens whose text starts at `offset` in the choice's text (at
    most `top` alternatives each, and the token: `top_with_token`); a prompt's first token
    (logprob NaN: nothing precedes it) has null logprob and alternatives. Given the choice's
    `text`, the offsets are where the tokens are found in it (`text_offsets`), else their
    lengths added up."""
    tokens = [token_text(lp.token, lp.token_id) for lp in items]
    if text is None:
        lengths = itertools.accumulate((len(lp.token) for lp in items), initial=offset)
        offsets = list(lengths)[: len(items)]
    else:
        offsets = text_offsets([lp.token for lp in items], text, offset)
    scored = [not math.isnan(lp.logprob) for lp in items]
    return {
        "tokens": tokens,
        "token_logprobs": [
            json_logprob(lp.logprob) if ok else None for lp, ok in zip(items, scored, strict=True)
        ],
        "top_logprobs": [
            top_with_token(lp, top) if ok else None for lp, ok in zip(items, scored, strict=True)
        ],
        "text_offset": offsets,
    }


def top_with_token(lp: generation_pb2.TokenLogprobs, top: int | None) -> dict[str, float]:
    """A completion token's `top_logprobs`: its `top` (None: all sent) most likely alternatives,
    then the token itself when they lack it (OpenAI's "up to logprobs + 1", as vLLM answers;
    its logprob is below theirs, so the values stay descending)."""
    entries = {token_text(t, i): json_logprob(p) for t, i, p in zip_top(lp)[:top]}
    entries.setdefault(token_text(lp.token, lp.token_id), json_logprob(lp.logprob))
    return entries


def text_offsets(tokens: list[str], text: str, start: int = 0) -> list[int]:
    """Where each token starts in `text`, from `start` on, never decreasing. A token found at
    the current position moves it past itself. One that is not there (a special token the text
    leaves out, or a piece of a multi-byte character, U+FFFD when decoded alone) starts at the
    current position; the characters such pieces stood for (one per U+FFFD) are passed over
    when the next token is found within that many characters further on."""
    offsets, pos, pieces = [], start, 0
    for token in tokens:
        if token and not text.startswith(token, pos) and pieces:
            found = text.find(token, pos, pos + pieces + len(token))
            pos = pos if found < 0 else found
        if token and text.startswith(token, pos):
            offsets.append(pos)
            pos, pieces = pos + len(token), 0
        else:
            offsets.append(min(pos, len(text)))
            pieces += token.count(REPLACEMENT)
    return offsets


def stop_reason(response: generation_pb2.GenerateResponse) -> int | str | None:
    """vLLM's `stop_reason` of a completion's last response: the stop token id or the stop
    string that ended it, None for EOS, a length or an abort."""
    which = response.WhichOneof("stop_reason")
    if which == "stop_token_id":
        return response.stop_token_id
    if which == "stop_string":
        return response.stop_string
    return None


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Completion logprobs of `first`'s tokens followed by `then`'s."""
    return {key: [*first[key], *then[key]] for key in first}


def zip_top(lp: generation_pb2.TokenLogprobs) -> list[tuple[str, int, float]]:
    texts = list(lp.top_tokens) or [""] * len(lp.top_token_ids)
    return list(zip(texts, lp.top_token_ids, lp.top_logprobs, strict=False))


@dataclass
class Echo:
    """Completions with `echo`: each choice of prompt i starts with the prompt's text (a text
    prompt's own, else the worker's decoding of its token ids: `Prompts.decoded`) and, with
    logprobs, the prompt tokens' logprobs (`Prompts.logprobs`)."""

    prompt_texts: list[str]  # per prompt: its text, "" for token ids
    prompt_only: bool = False  # max_tokens 0: the prompt alone


@dataclass
class Prompts:
    """What the workers returned about each prompt (its first response): its logprobs and its
    decoded text, when they were asked for."""

    logprobs: dict[int, list[generation_pb2.TokenLogprobs]] = field(default_factory=dict)
    decoded: dict[int, str] = field(default_factory=dict)

    def keep(self, prompt: int, response: generation_pb2.GenerateResponse) -> None:
        if response.prompt_logprobs:
            self.logprobs[prompt] = list(response.prompt_logprobs)
        if response.prompt_text:
            self.decoded[prompt] = response.prompt_text


def vllm_prompt_logprobs(
    items: list[generation_pb2.TokenLogprobs], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt token and the `top` most likely there (logprobs as
    JSON carries them: `json_logprob`)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in items:
        if math.isnan(lp.logprob):
            out.append(None)
            continue
        own = json_logprob(lp.logprob)
        entry = {str(lp.token_id): {"logprob": own, "rank": lp.rank or None,
                                    "decoded_token": lp.token}}  # fmt: skip
        for rank, (text, token_id, logprob) in enumerate(zip_top(lp)[:top], start=1):
            entry.setdefault(
                str(token_id),
                {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": text},
            )
        out.append(entry)
    return out


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far (text offsets of completion logprobs)
    logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string
    completion_tokens: int = 0
    streamed_tokens: int = 0  # token ids relayed so far (completion_tokens is the final count)
    started: bool = False  # its first chunk was streamed (what goes only there went)


@dataclass
class Answer:
    """One request's answer as responses arrive; `id` doubles as the request id."""

    kind: Kind
    id: str
    model: str
    logprobs: int | None
    n: int = 1  # choices per prompt: choice i belongs to prompt i // n
    echo: Echo | None = None  # completions with echo: each choice starts with its prompt
    prompt_logprobs: int | None = None  # vLLM's field: each choice carries its prompt's
    prompts: Prompts = field(default_factory=Prompts)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, response: generation_pb2.GenerateResponse) -> Choice:
        """Record a response; returns its choice (state before this response's text). With
        echo and nothing to generate, the response's own tokens are left out."""
        choice = self.choices.setdefault(response.index, Choice())
        prompt = response.index // self.n
        self.prompts.keep(prompt, response)
        if response.HasField("usage"):
            self.prompt_tokens[prompt] = response.usage.prompt_tokens
            cached = max(self.cached_tokens.get(prompt, 0), response.usage.cached_tokens)
            self.cached_tokens[prompt] = cached
            choice.completion_tokens = response.usage.completion_tokens
        if response.finish_reason in FINISH_REASONS:
            choice.finish_reason = FINISH_REASONS[response.finish_reason]
            choice.stop_reason = stop_reason(response)
        if response.prompt_tokens:
            self.prompt_tokens.setdefault(prompt, response.prompt_tokens)
        if self.echo is not None and self.echo.prompt_only:
            response.text, choice.completion_tokens = "", 0
            del response.logprobs[:], response.token_ids[:]
            if choice.finish_reason in ("stop", "length"):
                choice.finish_reason = "length"  # max_tokens 0 (an abort stays one)
                choice.stop_reason = None
        choice.streamed_tokens += len(response.token_ids)
        return choice

    def choice_usage(self, index: int) -> dict[str, int]:
        """vLLM's usage of one streamed chunk (`continuous_usage_stats`): the choice's prompt
        and its tokens so far."""
        choice = self.choices[index]
        prompt = self.prompt_tokens.get(index // self.n, 0)
        done = choice.completion_tokens if choice.finish_reason else choice.streamed_tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

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
        # the choice's first chunk carries the echoed prompt and prompt_logprobs
        first, choice.started = not choice.started, True
        logprobs = list(response.logprobs)
        entry: dict[str, Any] = {"index": response.index}
        if self.kind == "completion":
            fields, echoed = self._completion_fields(
                response.index, response.text, logprobs, choice.length, first
            )
            entry.update(fields)
            choice.length += echoed
            if first:
                self._with_prompt_logprobs(entry, response.index)
        else:
            entry["delta"] = {"content": response.text}  # the role went in `role_chunk`
            entry["logprobs"] = chat_logprobs(logprobs) if self.logprobs is not None else None
        entry["finish_reason"] = choice.finish_reason
        entry["stop_reason"] = choice.stop_reason
        choice.length += len(response.text)
        body = {**self.header(True), "choices": [entry]}
        if self.kind == "chat" and response.index == 0 and first:  # vLLM: at the top level
            self._with_prompt_logprobs(body, 0)
        return body

    def role_chunk(
        self, index: int, prompt_tokens: int | None = None, usage: bool = False
    ) -> dict[str, Any]:
        """A streamed chat's first chunk of choice `index`, before its text: the role and empty
        content, as vLLM and OpenAI send it once per choice; with `prompt_tokens`, vLLM's
        `continuous_usage_stats` usage (nothing generated yet), else with `usage` (asked for)
        a null usage as every chunk but the last has."""
        entry = {"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}  # fmt: skip
        body = {**self.header(True), "choices": [entry]}
        if prompt_tokens is not None:
            body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                             "total_tokens": prompt_tokens}  # fmt: skip
        elif usage:
            body["usage"] = None
        return body

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
                entry.update(self._completion_fields(index, text, c.logprobs, 0, True, True)[0])
                self._with_prompt_logprobs(entry, index)
            else:
                entry["message"] = {"role": "assistant", "content": text}
                entry["logprobs"] = chat_logprobs(c.logprobs) if self.logprobs is not None else None
            entry["finish_reason"] = c.finish_reason
            entry["stop_reason"] = c.stop_reason
            choices.append(entry)
        body = {**self.header(False), "choices": choices, "usage": self.usage()}
        if self.kind == "chat":  # vLLM: at the top level
            self._with_prompt_logprobs(body, 0)
        return body

    def _completion_fields(
        self,
        index: int,
        text: str,
        items: list[generation_pb2.TokenLogprobs],
        offset: int,
        first: bool,
        whole: bool = False,
    ) -> tuple[dict[str, Any], int]:
        """A completion choice's `text` and `logprobs` (its tokens' text starting at `offset`);
        in its `first` part (a stream's first chunk, or the whole answer), with echo, preceded
        by the prompt's; and the echoed prompt's length (0 without). The echoed prompt's
        offsets, and those of the whole answer (`whole`), are found in the returned text; a
        stream's later tokens add up their lengths (their text may come in a later chunk)."""
        prefix, prompt_lp = self._echo_of(index) if first else ("", [])
        if self.logprobs is None:
            return {"text": prefix + text, "logprobs": None}, len(prefix)
        full = prefix + text
        logprobs = completion_logprobs(items, offset + len(prefix), text=full if whole else None)
        if prompt_lp:  # at most `logprobs` alternatives, as the rest
            echoed = completion_logprobs(prompt_lp, 0, self.logprobs, text=prefix)
            logprobs = joined_logprobs(echoed, logprobs)
        return {"text": full, "logprobs": logprobs}, len(prefix)

    def _echo_of(self, index: int) -> tuple[str, list[generation_pb2.TokenLogprobs]]:
        """With echo, the prompt text and logprobs choice `index` starts with."""
        if self.echo is None:
            return "", []
        prompt = index // self.n
        text = self.echo.prompt_texts[prompt] or self.prompts.decoded.get(prompt, "")
        return text, self.prompts.logprobs.get(prompt, [])

    def _with_prompt_logprobs(self, target: dict[str, Any], index: int) -> None:
        """vLLM's `prompt_logprobs` of choice `index`'s prompt into `target` (a choice, or a
        chat answer's top level), when asked for."""
        if self.prompt_logprobs is not None:
            items = self.prompts.logprobs.get(index // self.n, [])
            target["prompt_logprobs"] = vllm_prompt_logprobs(items, self.prompt_logprobs)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.header(True), "choices": [], "usage": self.usage()}
