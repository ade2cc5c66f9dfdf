"""Structural checks of a GenerateRequest the control plane makes before any worker call.

Model-dependent checks (vocabulary, context length, sampling ranges) are the prefill worker's
(Prepare); these are the ones needing no model, including the size bounds of RequestLimits.
"""

from __future__ import annotations

import uuid

from control_plane.limits import RequestLimits
from control_plane.run import MAX_TOKENS_UP_TO_CONTEXT
from kvmesh.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 128
CHILD_SEPARATOR = "#"  # workers name a request's extra completions "{request_id}#{i}"
DEFAULT_LIMITS = RequestLimits()
MAX_TEMPLATE_KWARGS_BYTES = 65536  # a chat's template variables (JSON text; the workers' bound)


class FieldError(ValueError):
    """A request field is invalid; `.field` names it and the message starts with it."""

    status_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError("request_id", f"is longer than {MAX_REQUEST_ID_CHARS} characters")
    if not all(" " <= ch <= "~" for ch in request_id):
        raise FieldError("request_id", "must be printable ASCII")
    if CHILD_SEPARATOR in request_id:
        raise FieldError(
            "request_id",
            f"must not contain {CHILD_SEPARATOR!r} (it names a request's extra completions)",
        )


def utf8_size(text: str) -> int:
    """Bytes of `text` in UTF-8 (without encoding it when it is ASCII)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_text(text: str, limits: RequestLimits) -> None:
    if not text:
        raise FieldError("prompt.text", "must not be empty")
    if len(text) > limits.max_prompt_bytes or utf8_size(text) > limits.max_prompt_bytes:
        raise FieldError(
            "prompt.text",
            f"is {utf8_size(text)} bytes; at most {limits.max_prompt_bytes} are accepted",
        )


def check_chat(chat: generation_pb2.ChatMessages, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """At least one message and at most `max_messages`, each with a non-empty role, role and
    name within `max_role_bytes`, the contents (and documents) together within
    `max_prompt_bytes`, the template variables within MAX_TEMPLATE_KWARGS_BYTES (the
    template's checks, the JSON's included, are the worker's)."""
    if len(chat.template_kwargs) > MAX_TEMPLATE_KWARGS_BYTES or (
        utf8_size(chat.template_kwargs) > MAX_TEMPLATE_KWARGS_BYTES
    ):
        raise FieldError(
            "prompt.chat.template_kwargs",
            f"is {utf8_size(chat.template_kwargs)} bytes; at most {MAX_TEMPLATE_KWARGS_BYTES} "
            "are accepted",
        )
    messages = chat.messages
    if not messages:
        raise FieldError("prompt.chat.messages", "must contain at least one message")
    if len(messages) > limits.max_messages:
        raise FieldError(
            "prompt.chat.messages",
            f"{len(messages)} messages; at most {limits.max_messages} accepted",
        )
    total = utf8_size(chat.documents) if len(chat.documents) <= limits.max_prompt_bytes else 0
    if len(chat.documents) > limits.max_prompt_bytes or total > limits.max_prompt_bytes:
        raise FieldError(
            "prompt.chat.documents",
            f"is {utf8_size(chat.documents)} bytes; at most {limits.max_prompt_bytes} are "
            "accepted with the contents",
        )
    for i, message in enumerate(messages):
        if not message.role:
            raise FieldError(f"prompt.chat.messages[{i}].role", "must not be empty")
        for name, value in (("role", message.role), ("name", message.name)):
            if utf8_size(value) > limits.max_role_bytes:
                raise FieldError(
                    f"prompt.chat.messages[{i}].{name}",
                    f"is longer than {limits.max_role_bytes} bytes",
                )
        total += utf8_size(message.content)
        if total > limits.max_prompt_bytes:
            raise FieldError(
                f"prompt.chat.messages[{i}].content",
                f"the contents so far are {total} bytes; at most {limits.max_prompt_bytes} "
                "are accepted",
            )


def check_prompt(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> None:
    which = request.WhichOneof("prompt")
    if which is None:
        raise FieldError("prompt", "set text, token_ids or chat")
    if which == "text":
        check_text(request.text, limits)
    elif which == "token_ids":
        count = len(request.token_ids.ids)
        if not count:
            raise FieldError("prompt.token_ids.ids", "must not be empty")
        if count > limits.max_prompt_tokens:
            raise FieldError(
                "prompt.token_ids.ids",
                f"{count} ids; at most {limits.max_prompt_tokens} are accepted",
            )
    else:
        check_chat(request.chat, limits)


def check_sampling(sampling: generation_pb2.SamplingParams, limits: RequestLimits) -> None:
    """Counts and sizes of the sampling fields; max_tokens is in [1, limits.max_tokens] or
    -1 (no bound but the model's context)."""
    max_tokens = sampling.max_tokens
    in_range = 1 <= max_tokens <= limits.max_tokens or max_tokens == MAX_TOKENS_UP_TO_CONTEXT
    if sampling.HasField("max_tokens") and not in_range:
        raise FieldError(
            "sampling.max_tokens", f"must be in [1, {limits.max_tokens}] or -1 (the context)"
        )
    if sampling.HasField("n") and not 1 <= sampling.n <= limits.max_n:
        raise FieldError("sampling.n", f"must be in [1, {limits.max_n}]")
    if len(sampling.stop) > limits.max_stop_strings:
        raise FieldError(
            "sampling.stop", f"{len(sampling.stop)} strings; at most {limits.max_stop_strings}"
        )
    for i, stop in enumerate(sampling.stop):
        if utf8_size(stop) > limits.max_stop_string_bytes:
            raise FieldError(
                f"sampling.stop[{i}]", f"is longer than {limits.max_stop_string_bytes} bytes"
            )
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise FieldError(
            "sampling.stop_token_ids",
            f"{len(sampling.stop_token_ids)} ids; at most {limits.max_stop_token_ids}",
        )
    if len(sampling.logit_bias) > limits.max_logit_bias_tokens:
        raise FieldError(
            "sampling.logit_bias",
            f"{len(sampling.logit_bias)} tokens; at most {limits.max_logit_bias_tokens}",
        )


def check_generate_request(
    request: generation_pb2.GenerateRequest, limits: RequestLimits = DEFAULT_LIMITS
) -> str:
    """Validate structure and size (FieldError naming the field); returns the request id to
    use (assigned when empty)."""
    request_id = request.request_id
    if request_id:
        check_request_id(request_id)
    check_prompt(request, limits)
    if len(request.cache_salt) > limits.max_cache_salt_bytes:
        raise FieldError("cache_salt", f"is longer than {limits.max_cache_salt_bytes} bytes")
    check_sampling(request.sampling, limits)
    return request_id or f"req-{uuid.uuid4().hex}"
