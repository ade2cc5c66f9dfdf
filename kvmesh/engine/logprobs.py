"""Logprobs in vLLM's shape (pure Python, never imports torch).

`TokenLogprobs` is what the sampler and prompt scoring make at one position: the sampled (or
prompt) token's raw-model logprob and rank, and the top-n tokens best first. It is also a
read-only `Mapping[int, Logprob]`, the `dict[int, Logprob]` a vLLM script reads from
`CompletionOutput.logprobs` / `RequestOutput.prompt_logprobs` (vllm/logprobs.py,
`append_logprobs_for_next_position`): the sampled token first, then the top tokens in rank
order; the sampled token's rank is its true rank unless it is one of the top tokens, whose
ranks are 1..n; len n or n + 1. `decoded_token` is None at the engine; `LLM.generate` and
`LLM.chat` fill it (`DecodedTokens`) as vLLM's detokenizing LogprobsProcessor does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

REPLACEMENT = "\ufffd"  # what a partial UTF-8 character decodes to
CONTEXT_TOKENS = 4  # preceding tokens that can complete one (vLLM's max_context)


@dataclass(frozen=True)
class Logprob:
    """One token's logprob at a position, as vLLM's `vllm.logprobs.Logprob`: its raw-model
    log-probability, its rank in the vocabulary (1 = most likely) and its text (None where
    nothing detokenized it)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class TokenLogprobs(Mapping[int, Logprob]):
    """Raw-model logprobs at one position: the sampled token's, its rank (1 = most likely) and
    the top-n tokens in descending order (n = SamplingParams.logprobs, may be 0);
    `decoded_tokens` the texts of (sampled, *top) when the offline API decoded them. Read as
    vLLM's `dict[int, Logprob]` too (see the module); equal to a mapping with the same items,
    and to another TokenLogprobs with the same ids, logprobs and ranks (texts aside)."""

    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    decoded_tokens: tuple[str, ...] | None = field(default=None, compare=False)

    def __getitem__(self, token_id: int) -> Logprob:
        texts = self.decoded_tokens
        if token_id in self.top_token_ids:  # vLLM's top-n entry overrides the sampled one
            i = self.top_token_ids.index(token_id)
            text = texts[i + 1] if texts is not None else None
            return Logprob(self.top_logprobs[i], i + 1, text)
        if token_id == self.sampled_token_id:
            text = texts[0] if texts is not None else None
            return Logprob(self.sampled_logprob, self.sampled_rank, text)
        raise KeyError(token_id)

    def __iter__(self) -> Iterator[int]:
        sampled = self.sampled_token_id
        yield sampled
        yield from (t for t in self.top_token_ids if t != sampled)

    def __len__(self) -> int:
        return len(self.top_token_ids) + (self.sampled_token_id not in self.top_token_ids)

    def __contains__(self, token_id: object) -> bool:
        return token_id == self.sampled_token_id or token_id in self.top_token_ids

    def __bool__(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLogprobs):
            return (
                self.sampled_token_id,
                self.sampled_logprob,
                self.sampled_rank,
                self.top_token_ids,
                self.top_logprobs,
            ) == (
                other.sampled_token_id,
                other.sampled_logprob,
                other.sampled_rank,
                other.top_token_ids,
                other.top_logprobs,
            )
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented


class DecodedTokens:
    """The `decoded_token` texts vLLM's LogprobsProcessor gives (vllm/v1/engine/logprobs.py
    with vllm/tokenizers/detokenizer_utils.py `convert_ids_list_to_tokens`): each token decoded
    alone (special tokens kept), a leading space a SentencePiece (Metaspace) decode strips put
    back, and a text ending in U+FFFD (part of a UTF-8 character) redone with up to 4
    preceding tokens of the sequence ("" when they do not complete it). Texts of single ids
    are cached (at most one per vocabulary entry)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.marker = leading_space_marker(tokenizer)
        self._texts: dict[int, str] = {}

    def entries(self, entries: Sequence[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """`entries` (one per position of a sequence, None where a position has none: a
        prompt's first) with their `decoded_tokens` filled."""
        out: list[TokenLogprobs | None] = []
        for i, entry in enumerate(entries):
            if entry is None:
                out.append(None)
                continue
            context = [e.sampled_token_id for e in entries[max(0, i - CONTEXT_TOKENS) : i] if e]
            ids = (entry.sampled_token_id, *entry.top_token_ids)
            out.append(replace(entry, decoded_tokens=self.texts(ids, context)))
        return out

    def texts(self, ids: Sequence[int], context: Sequence[int]) -> tuple[str, ...]:
        """The texts of `ids`, alternatives at one position that `context` precedes."""
        texts = [self.text(i) for i in ids]
        return tuple(
            self._completed(i, context) if t.endswith(REPLACEMENT) else t
            for i, t in zip(ids, texts, strict=True)
        )

    def text(self, token_id: int) -> str:
        """One token's text on its own."""
        text = self._texts.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]) or "")
            if self.marker is not None:
                raw = self.tokenizer.convert_ids_to_tokens([token_id])[0] or ""
                text = restore_leading_spaces(raw, text, self.marker)
            self._texts[token_id] = text
        return text

    def _completed(self, token_id: int, context: Sequence[int]) -> str:
        """The text a partial-character token completes with the shortest suffix of `context`
        that makes a whole character, less what the context's own whole tokens show."""
        decode = self.tokenizer.decode
        context = list(context)
        for num in range(1, min(len(context), CONTEXT_TOKENS) + 1):
            tail = context[-num:]
            full = str(decode([*tail, token_id]))
            if full.endswith(REPLACEMENT):
                continue
            clean_end = len(tail)  # context tokens that were partial characters themselves
            for j in range(len(tail) - 1, -1, -1):
                if not str(decode([tail[j]])).endswith(REPLACEMENT):
                    break
                clean_end = j
            prefix = str(decode(tail[:clean_end])) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def leading_space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (whose decode of
    one token drops its leading space), None for any other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        config = json.loads(backend.to_str())
    except Exception:
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "Metaspace":
            return str(step.get("replacement", "\u2581"))
    return None


def restore_leading_spaces(raw_token: str, text: str, marker: str) -> str:
    """`text` with the leading spaces its vocabulary piece `raw_token` has (marker chars)."""
    markers = len(raw_token) - len(raw_token.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
