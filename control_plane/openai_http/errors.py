"""OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) and the HTTP status
of every front-door failure."""

from __future__ import annotations

import math
import re

import grpc
from starlette.responses import JSONResponse

from control_plane.run import RpcFailure

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.ABORTED: (409, "aborted"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable"),
}
# HTTP status of an answer given before a run starts -> the gRPC status it is counted as.
_HTTP_CODE = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# Failures a client must not retry (the official openai client retries 408, 409, 429 and 5xx
# unless told `x-should-retry: false`): an owner's Abort (409) would run the request again,
# and a request that used up the server's max request time (504) would only use it up again.
_FINAL = (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)
# A worker's field name (the start of its INVALID_ARGUMENT message) -> the request's param.
_PROMPT_FIELDS = ("prompt", "text", "token_ids", "chat")
_FIELD = re.compile(r"^(?:sampling\.)?([A-Za-z_]+)")
# A worker's name of a chat template option -> vLLM's request field.
_CHAT_OPTIONS = {
    "prompt.chat.template_kwargs": "chat_template_kwargs",
    "prompt.chat.documents": "documents",
    "prompt.chat.continue_final_message": "continue_final_message",
    "prompt.chat.add_generation_prompt": "add_generation_prompt",
}
_CHAT_OPTION = re.compile(r"^(prompt\.chat\.[a-z_]+)(?=$|[.\[:])")


class ApiError(Exception):
    """An HTTP error answer in OpenAI's shape; `param` names the offending request field;
    `rpc_code` is the gRPC status of the failure it answers (when it answers one)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        rpc_code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}
        self.rpc_code = rpc_code

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def grpc_code(error: ApiError) -> grpc.StatusCode:
    """The gRPC status an HTTP refusal is counted as (metrics speak gRPC code names): the
    failure's own when it answers one, else its HTTP status's."""
    if error.rpc_code is not None:
        return error.rpc_code
    return _HTTP_CODE.get(error.status, grpc.StatusCode.UNKNOWN)


def bad_param(param: str, message: str) -> ApiError:
    """400 naming `param` (the message starts with it)."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_failure(failure: RpcFailure, prompt_param: str = "prompt") -> ApiError:
    """The HTTP answer of a front-door failure; INVALID_ARGUMENT names the request's param.
    An abort or a timed-out request is answered with `x-should-retry: false`."""
    status, kind = _STATUS.get(failure.code, (500, "server_error"))
    headers: dict[str, str] = {}
    if failure.code in _FINAL:
        headers["x-should-retry"] = "false"
    param: str | None = None
    message = failure.message
    if failure.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(failure.retry_after_ms / 1000)))
    option = _CHAT_OPTION.match(failure.field or failure.message)
    if failure.code == grpc.StatusCode.INVALID_ARGUMENT and option and option[1] in _CHAT_OPTIONS:
        param = _CHAT_OPTIONS[option[1]]  # the message names the worker's field: renamed
        if message.startswith(option[1]):
            message = param + message[len(option[1]) :]
    elif failure.code == grpc.StatusCode.INVALID_ARGUMENT:
        match = _FIELD.match(failure.field or failure.message)
        if match:
            param = match.group(1)
            if param in _PROMPT_FIELDS:
                param = prompt_param
                if not message.startswith(param):  # the worker named its own field
                    message = f"{param}: {message}"
    code = failure.code.name.lower()
    return ApiError(
        status, message, type=kind, param=param, code=code, headers=headers, rpc_code=failure.code
    )
