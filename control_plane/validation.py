"""Structural checks of a GenerateRequest the control plane makes before any worker call.

Model-dependent checks (vocabulary, context length, sampling ranges) are the prefill worker's
(Prepare); these are the ones needing no model.
"""

from __future__ import annotations

import uuid

from kvmesh.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_BYTES = 256


class FieldError(ValueError):
    """A request field is invalid; the message starts with the field's name."""


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if not all(" " <= ch <= "~" for ch in request_id):
        raise FieldError("request_id must be printable ASCII")


def check_chat(chat: generation_pb2.ChatMessages) -> None:
    """At least one message, each with a non-empty role (the template's checks are the
    worker's)."""
    if not chat.messages:
        raise FieldError("prompt.chat.messages must contain at least one message")
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise FieldError(f"prompt.chat.messages[{i}].role must not be empty")


def check_generate_request(request: generation_pb2.GenerateRequest) -> str:
    """Validate structure; returns the request id to use (assigned when empty)."""
    request_id = request.request_id
    if request_id:
        check_request_id(request_id)
    which = request.WhichOneof("prompt")
    if which is None:
        raise FieldError("prompt: set text, token_ids or chat")
    if which == "text" and not request.text:
        raise FieldError("text must not be empty")
    if which == "token_ids" and not request.token_ids.ids:
        raise FieldError("token_ids.ids must not be empty")
    if which == "chat":
        check_chat(request.chat)
    if len(request.cache_salt) > MAX_CACHE_SALT_BYTES:
        raise FieldError(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes")
    sampling = request.sampling
    if sampling.HasField("max_tokens") and sampling.max_tokens < 1:
        raise FieldError("sampling.max_tokens must be >= 1")
    if sampling.HasField("n") and sampling.n < 1:
        raise FieldError("sampling.n must be >= 1")
    return request_id or f"req-{uuid.uuid4().hex}"
