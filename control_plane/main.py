"""`kvmesh serve control`: run the control plane until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Mapping, Sequence

from control_plane.config import ControlConfig
from control_plane.limits import RequestLimits
from control_plane.server import ControlServer
from kvmesh.security.flags import add_security_flags, security_from_args
from kvmesh.telemetry.logs import add_log_flags, setup_from_args
from kvmesh.telemetry.tracing import setup_tracing

# flag -> (ControlConfig field, help); type and default come from the field's default.
TUNABLES: dict[str, tuple[str, str]] = {
    "--max-inflight": ("max_inflight", "requests in flight before RESOURCE_EXHAUSTED"),
    "--lease-seconds": ("lease_seconds", "worker is dead after this long without heartbeat"),
    "--heartbeat-interval": (
        "heartbeat_interval_seconds",
        "heartbeat interval told to workers (at most a third of --lease-seconds)",
    ),
    "--reservation-lease": (
        "reservation_lease_seconds",
        "seconds a decode reservation waits for Decode",
    ),
    "--max-request-seconds": ("max_request_seconds", "upper bound of any request's deadline"),
    "--drain-seconds": (
        "drain_seconds",
        "at most this long for in-flight requests at shutdown (the wait is sized from the "
        "longest of them)",
    ),
    "--drain-token-seconds": (
        "drain_token_seconds",
        "per-token time assumed by the drain bound for a request not streaming yet",
    ),
    "--retry-after-ms": ("retry_after_ms", "retry delay sent with RESOURCE_EXHAUSTED"),
    "--max-message-bytes": ("max_message_bytes", "largest gRPC message of the front door"),
    "--worker-max-message-bytes": (
        "worker_max_message_bytes",
        "largest message on the channels to workers",
    ),
    "--max-http-body-bytes": ("max_http_body_bytes", "largest HTTP request body (beyond: 413)"),
    "--max-connection-idle-seconds": (
        "max_connection_idle_seconds",
        "a gRPC connection without calls for this long is closed (GOAWAY)",
    ),
}
# flag -> RequestLimits field: every per-request bound, named as its field.
LIMIT_FLAGS = {"--" + name.replace("_", "-"): name for name in RequestLimits.__dataclass_fields__}


def build_parser(prog: str = "kvmesh serve control") -> argparse.ArgumentParser:
    defaults = ControlConfig()
    parser = argparse.ArgumentParser(prog=prog, description="Run the kvmesh control plane.")
    add = parser.add_argument
    add("--host", default=defaults.host, help="address to bind (default %(default)s)")
    add("--port", type=int, default=defaults.port,
        help="public front-door port: the client API only (default %(default)s)")  # fmt: skip
    add("--internal-port", type=int, default=defaults.internal_port,
        help="internal port of ControlService (workers' --control; 0: pick a free one; "
        "default %(default)s)")  # fmt: skip
    add("--internal-host", default=None, help="address of the internal port (default: --host)")
    add("--http-port", type=int, default=None,
        help="OpenAI-compatible HTTP API port (0: pick a free one; default: off)")  # fmt: skip
    add("--reflection", action="store_true", help="serve gRPC server reflection")
    for flag, (name, text) in TUNABLES.items():
        default = getattr(defaults, name)
        add(flag, type=type(default), default=default, dest=name,
            metavar=flag[2:].upper().replace("-", "_"),
            help=f"{text} (default %(default)s)")  # fmt: skip
    for flag, name in LIMIT_FLAGS.items():
        add(flag, type=int, default=getattr(defaults.limits, name), dest=f"limit_{name}",
            metavar="N", help=f"per-request bound {name} (default %(default)s)")  # fmt: skip
    add("--transfer-backends", default=",".join(defaults.transfer_backends),
        help="KV transfer backends in order of preference (default %(default)s)")  # fmt: skip
    add("--metrics-port", type=int, default=None,
        help="Prometheus endpoint port (0: pick a free one; default: off)")  # fmt: skip
    add("--trace-message-content", action="store_true",
        help="record prompt and output text on request spans (default: never; also "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)")  # fmt: skip
    add_log_flags(parser)
    add_security_flags(parser, public=True)
    return parser


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ControlConfig:
    """The ControlConfig the parsed flags (and the secrets in `environ`) name (ValueError names
    an out-of-range field or a missing secret)."""
    return ControlConfig(
        host=args.host,
        port=args.port,
        internal_port=args.internal_port,
        internal_host=args.internal_host,
        security=security_from_args(args, environ),
        http_port=args.http_port,
        reflection=args.reflection,
        reap_interval_seconds=min(0.5, args.lease_seconds),
        transfer_backends=tuple(b for b in args.transfer_backends.split(",") if b),
        metrics_port=args.metrics_port,
        trace_message_content=args.trace_message_content,
        limits=RequestLimits(**{n: getattr(args, f"limit_{n}") for n in LIMIT_FLAGS.values()}),
        **{name: getattr(args, name) for name, _ in TUNABLES.values()},
    )


async def serve(config: ControlConfig) -> None:
    """Serve until a stop signal, then drain."""
    server = ControlServer(config)
    await server.start()
    if server.http is not None:  # printed first: `kvmesh up` reads it before the next line
        print(f"kvmesh control plane OpenAI-compatible API on {server.http.url}/v1", flush=True)
    if server.metrics_address:  # printed before the next two: `kvmesh up` reads it first
        print(f"kvmesh control plane metrics on {server.metrics_address}", flush=True)
    # `kvmesh up` reads these two in this order; the last one means everything is serving.
    print(f"kvmesh control plane internal ControlService on {server.internal_address}", flush=True)
    print(f"kvmesh control plane listening on {server.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.drain()


def _loop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # not available on this platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_from_args(args, "kvmesh-control")
    try:
        config = config_from_args(args)
        setup_tracing("kvmesh-control")
    except ValueError as error:  # TracingConfigError too
        print(f"kvmesh serve control: {error}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=_loop_factory) as runner:
            runner.run(serve(config))
    except OSError as error:  # a port that cannot be bound: before anything serves
        print(f"kvmesh serve control: {flag_named(str(error))}", file=sys.stderr)
        return 2
    return 0


def flag_named(message: str) -> str:
    """`message` with a leading ControlConfig field ("internal_port: ...") named as its flag
    ("--internal-port: ...")."""
    field, sep, rest = message.partition(": ")
    if sep and field in ControlConfig.__dataclass_fields__:
        return f"--{field.replace('_', '-')}: {rest}"
    return message
