"""Structured logs: one stderr handler per process, text or JSON lines, with the request id and
the current trace and span ids on every line logged while a request is being served.

`--log-level` / `--log-format` are accepted by every command (`add_log_flags`); their defaults
come from `KVMESH_LOG_LEVEL` / `KVMESH_LOG_FORMAT`, which `setup_logging` also sets so that child
processes (`kvmesh up`'s roles) log the same way. The request id lives in a context variable
(`request_scope`): asyncio tasks started while it is set inherit it.

A JSON line holds `time` (ISO 8601, UTC), `level`, `logger`, `message`, `service`, and, where
known, `request_id`, `trace_id`, `span_id` (W3C hex), plus `exc_info` for an exception.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
LEVEL_ENV, FORMAT_ENV = "KVMESH_LOG_LEVEL", "KVMESH_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s %(message)s"
JSON_FIELDS = ("levelname", "name", "message")
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvmesh_request_id", default=None
)


def add_log_flags(parser: argparse.ArgumentParser, *, subcommand: bool = False) -> None:
    """Add `--log-level` and `--log-format` to `parser` (once; defaults from the environment).
    A `subcommand` parser leaves them unset when absent, so that it keeps the parent's."""
    if any("--log-format" in action.option_strings for action in parser._actions):
        return
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    fmt = os.environ.get(FORMAT_ENV, "text").lower()
    level = level if level in LEVELS else "INFO"
    fmt = fmt if fmt in FORMATS else "text"
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS,
                        default=argparse.SUPPRESS if subcommand else level,
                        help=f"least severe level logged (default {level})")  # fmt: skip
    parser.add_argument("--log-format", type=str.lower, choices=FORMATS,
                        default=argparse.SUPPRESS if subcommand else fmt,
                        help=f"text, or one JSON object per line (default {fmt})")  # fmt: skip


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Log lines inside the block (and tasks it starts) carry `request_id`."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def bind_request_id(request_id: str) -> None:
    """Set the request id for the rest of the current task (its context only)."""
    _REQUEST_ID.set(request_id)


def current_request_id() -> str | None:
    return _REQUEST_ID.get()


class ContextFilter(logging.Filter):
    """Adds `request_id`, `trace_id`, `span_id`, `service` (None when unknown) and `context`
    (the same as ` key=value` text) to every record."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.request_id = _REQUEST_ID.get()
        span = trace.get_current_span().get_span_context()
        record.trace_id = format(span.trace_id, "032x") if span.is_valid else None
        record.span_id = format(span.span_id, "016x") if span.is_valid else None
        parts = [(k, getattr(record, k)) for k in ("request_id", "trace_id", "span_id")]
        record.context = "".join(f" {k}={v}" for k, v in parts if v)
        return True


class JsonLines(JsonFormatter):
    """One JSON object per record, with the fields of the module docstring."""

    def __init__(self) -> None:
        super().__init__(
            " ".join(f"%({name})s" for name in JSON_FIELDS),
            rename_fields={"levelname": "level", "name": "logger"},
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message)
        log_data["time"] = datetime.fromtimestamp(record.created, UTC).isoformat()
        for key in ("service", "request_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value is None:
                log_data.pop(key, None)
            else:
                log_data[key] = value
        for key in ("context", "color_message"):
            log_data.pop(key, None)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of each record."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(level: str = "INFO", fmt: str = "text", service: str = "kvmesh") -> None:
    """Log to stderr in `fmt` at `level` (replacing the handler an earlier call installed; other
    handlers stay); children started later inherit both through the environment."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: {fmt!r} is not one of {FORMATS}")
    handler = StderrHandler()
    handler.addFilter(ContextFilter(service))
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level.upper(), fmt


def setup_from_args(args: argparse.Namespace, service: str) -> None:
    """`setup_logging` with the parsed `--log-level` / `--log-format` (defaults when absent)."""
    level = getattr(args, "log_level", None) or os.environ.get(LEVEL_ENV, "INFO")
    fmt = getattr(args, "log_format", None) or os.environ.get(FORMAT_ENV, "text")
    setup_logging(level, fmt, service)
