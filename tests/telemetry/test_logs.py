"""Structured logs: JSON lines with level, request id and trace ids; the text format; the
`--log-level` / `--log-format` flags on every command."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvmesh.cli.main import build_parser
from kvmesh.telemetry.logs import FORMAT_ENV, LEVEL_ENV, request_scope, setup_logging


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setenv(LEVEL_ENV, "INFO")  # restored with the variables setup_logging sets
    monkeypatch.setenv(FORMAT_ENV, "text")
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_level_request_and_trace_ids(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("debug", "json", "kvmesh-test")
    log = logging.getLogger("kvmesh.test")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span, request_scope("req-7"):
        log.warning("admitted %s", "req-7")
    log.debug("outside")
    first, second = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    context = span.get_span_context()
    assert first["level"] == "WARNING" and first["message"] == "admitted req-7"
    assert first["logger"] == "kvmesh.test" and first["service"] == "kvmesh-test"
    assert first["request_id"] == "req-7"
    assert first["trace_id"] == format(context.trace_id, "032x")
    assert first["span_id"] == format(context.span_id, "016x")
    assert "T" in first["time"]
    assert second["level"] == "DEBUG" and "request_id" not in second and "trace_id" not in second


def test_text_lines_name_the_level_and_the_request(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("INFO", "text")
    with request_scope("req-8"):
        logging.getLogger("kvmesh.test").info("hello")
        logging.getLogger("kvmesh.test").debug("hidden at INFO")
    (line,) = capsys.readouterr().err.splitlines()
    assert " INFO kvmesh.test request_id=req-8 hello" in line


def leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from leaf_parsers(sub)


def test_every_command_accepts_the_log_flags() -> None:
    from control_plane.main import build_parser as control_parser
    from kvmesh.service.options import parser as worker_parser

    parsers = [*leaf_parsers(build_parser()), ("control", control_parser())]
    parsers += [(role, worker_parser(role)) for role in ("prefill", "decode", "colocated")]
    assert len(parsers) > 15
    for name, parser in parsers:
        options = {o for action in parser._actions for o in action.option_strings}
        assert {"--log-level", "--log-format"} <= options, name
    args = build_parser().parse_args(["--log-level", "debug", "plan", "m", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")  # the top level's is kept
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "m", "--log-format", "xml"])
