"""Typed errors a caller of the engine can cause; the services map them to gRPC status codes.

`InvalidParameterError` (and subclasses) -> INVALID_ARGUMENT. Bugs stay asserts.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A request or option carries a bad value; `.field` names it and the message starts with it."""

    status_name = "INVALID_ARGUMENT"  # the gRPC status it is answered with (kvmesh.v1.status)

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type[InvalidParameterError], tuple[str, str]]:
        return (type(self), (self.field, self.message))


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus what must be generated) does not fit the model's context length."""

    def __init__(self, num_tokens: int, max_model_len: int, field: str = "prompt") -> None:
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        super().__init__(
            field, f"{num_tokens} tokens exceed the model's maximum length of {max_model_len}"
        )

    def __reduce__(self) -> tuple[type[PromptTooLongError], tuple[int, int, str]]:  # type: ignore[override]
        return (type(self), (self.num_tokens, self.max_model_len, self.field))


class EmptyPromptError(InvalidParameterError):
    """A prompt with no tokens: there is nothing to condition the first token on."""

    def __init__(self, field: str = "prompt") -> None:
        super().__init__(field, "must contain at least one token")

    def __reduce__(self) -> tuple[type[EmptyPromptError], tuple[str]]:  # type: ignore[override]
        return (type(self), (self.field,))


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or features the engine cannot run; names what is missing."""


class RequestFailedError(RuntimeError):
    """One request raised in the engine's step (a bug confined to it, or a tokenizer that
    cannot decode one of its ids): that request was aborted, its blocks freed, and the others
    of the step went on. Answered INTERNAL, naming the request and the cause."""

    status_name = "INTERNAL"  # the gRPC status it is answered with (kvmesh.v1.status)

    def __init__(self, request_id: str, cause: str) -> None:
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"request {request_id!r} failed in the engine and was aborted: {cause}")

    def __reduce__(self) -> tuple[type[RequestFailedError], tuple[str, str]]:
        return (type(self), (self.request_id, self.cause))
