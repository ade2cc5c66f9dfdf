"""`kvmesh serve control`: run the control plane until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from control_plane.config import ControlConfig
from control_plane.server import ControlServer


def build_parser(prog: str = "kvmesh serve control") -> argparse.ArgumentParser:
    defaults = ControlConfig()
    parser = argparse.ArgumentParser(prog=prog, description="Run the kvmesh control plane.")
    add = parser.add_argument
    add("--host", default=defaults.host, help="address to bind (default %(default)s)")
    add("--port", type=int, default=defaults.port, help="front-door port (default %(default)s)")
    add("--reflection", action="store_true", help="serve gRPC server reflection")
    add("--max-inflight", type=int, default=defaults.max_inflight,
        help="requests in flight before RESOURCE_EXHAUSTED (default %(default)s)")  # fmt: skip
    add("--lease-seconds", type=float, default=defaults.lease_seconds,
        help="worker is dead after this long without heartbeat (default %(default)s)")  # fmt: skip
    add("--heartbeat-interval", type=float, default=defaults.heartbeat_interval_seconds,
        help="heartbeat interval told to workers (default %(default)s)")  # fmt: skip
    add("--reservation-lease", type=float, default=defaults.reservation_lease_seconds,
        help="seconds a decode reservation waits for Decode (default %(default)s)")  # fmt: skip
    add("--max-request-seconds", type=float, default=defaults.max_request_seconds,
        help="upper bound of any request's deadline (default %(default)s)")  # fmt: skip
    add("--drain-seconds", type=float, default=defaults.drain_seconds,
        help="bounded wait for in-flight requests at shutdown (default %(default)s)")  # fmt: skip
    add("--transfer-backends", default=",".join(defaults.transfer_backends),
        help="KV transfer backends in order of preference (default %(default)s)")  # fmt: skip
    add("--metrics-port", type=int, default=0, help="Prometheus endpoint port (0: off)")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def config_from_args(args: argparse.Namespace) -> ControlConfig:
    return ControlConfig(
        host=args.host,
        port=args.port,
        reflection=args.reflection,
        max_inflight=args.max_inflight,
        lease_seconds=args.lease_seconds,
        heartbeat_interval_seconds=args.heartbeat_interval,
        reap_interval_seconds=min(0.5, args.lease_seconds),
        reservation_lease_seconds=args.reservation_lease,
        max_request_seconds=args.max_request_seconds,
        drain_seconds=args.drain_seconds,
        transfer_backends=tuple(b for b in args.transfer_backends.split(",") if b),
        metrics_port=args.metrics_port,
    )


async def serve(config: ControlConfig) -> None:
    """Serve until a stop signal, then drain."""
    server = ControlServer(config)
    await server.start()
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
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvmesh serve control: {error}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        runner.run(serve(config))
    return 0
