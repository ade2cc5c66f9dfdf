"""Size bounds a worker checks on every request before converting, rendering or tokenizing it.

A worker trusts no caller, so these hold whoever sent the request: they look only at lengths
protobuf already knows, so a refused request costs no more than its parsing did.
"""

from __future__ import annotations

from kvmesh.engine.chat import MAX_TEMPLATE_KWARGS_BYTES, max_prompt_chars
from kvmesh.engine.errors import InvalidParameterError
from kvmesh.engine.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from kvmesh.v1 import generation_pb2

MAX_N = 128  # completions per request
MAX_MESSAGES = 4096  # chat messages per conversation


def check_sampling_size(sampling: generation_pb2.SamplingParams) -> None:
    """Counts of the repeated sampling fields and `n`, before they are converted."""
    if sampling.HasField("n") and sampling.n > MAX_N:
        raise InvalidParameterError("n", f"must be at most {MAX_N}, got {sampling.n}")
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidParameterError(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop)}"
        )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParameterError(
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(sampling.stop_token_ids)}",
        )
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidParameterError(
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(sampling.logit_bias)}",
        )


def check_prompt_ids_size(count: int, max_model_len: int, field: str) -> None:
    """A prompt of `count` token ids can fit a `max_model_len` context."""
    if count > max_model_len:
        raise InvalidParameterError(
            field, f"{count} tokens exceed the model's maximum length of {max_model_len}"
        )


def check_prompt_size(message: generation_pb2.GenerateRequest, max_model_len: int) -> None:
    """The prompt of a client request is small enough to be tokenized at all: text and chat
    contents (documents included) within `max_prompt_chars` UTF-8 bytes, token ids within the
    context, at most MAX_MESSAGES messages, template variables within
    MAX_TEMPLATE_KWARGS_BYTES."""
    limit = max_prompt_chars(max_model_len)
    which = message.WhichOneof("prompt")
    if which == "text":
        _check_bytes(message.text, limit, "prompt.text")
    elif which == "token_ids":
        check_prompt_ids_size(len(message.token_ids.ids), max_model_len, "prompt.token_ids")
    elif which == "chat":
        messages = message.chat.messages
        if len(messages) > MAX_MESSAGES:
            raise InvalidParameterError(
                "prompt.chat.messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}"
            )
        chat = message.chat
        if len(chat.template_kwargs) > MAX_TEMPLATE_KWARGS_BYTES:
            raise InvalidParameterError(
                "prompt.chat.template_kwargs",
                f"{len(chat.template_kwargs)} characters; at most "
                f"{MAX_TEMPLATE_KWARGS_BYTES} bytes are accepted",
            )
        total = sum(len(m.content) + len(m.role) + len(m.name) for m in messages)
        total += len(chat.documents)  # rendered into the prompt
        if total > limit:
            raise InvalidParameterError(
                "prompt.chat.messages",
                f"{total} characters can never fit the model's maximum length of "
                f"{max_model_len} tokens (at most {limit} are accepted)",
            )


def _check_bytes(text: str, limit: int, field: str) -> None:
    size = len(text) if len(text) > limit or text.isascii() else len(text.encode("utf-8"))
    if size > limit:
        raise InvalidParameterError(
            field,
            f"{size} bytes can never fit the model's maximum length (at most {limit} bytes "
            "are accepted)",
        )
