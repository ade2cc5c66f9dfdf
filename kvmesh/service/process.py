"""A worker process: engine thread, gRPC server, metrics, control-plane agent, drain on signal.

Each role module supplies `install(runtime, server, args) -> RoleServices`, which adds its
servicers to the server and reports what it holds for heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, Protocol

from kvmesh.engine.errors import InvalidParameterError, UnsupportedModelError
from kvmesh.service.engine_flags import engine_flags
from kvmesh.service.options import ROLES, build_runtime, engine_config, parse
from kvmesh.service.runtime import WorkerRuntime
from kvmesh.service.server import WorkerServer, print_ready, run_until_signal
from kvmesh.telemetry.logs import setup_from_args
from kvmesh.telemetry.metrics import WorkerMetrics, serve_metrics
from kvmesh.telemetry.tier_metrics import register_tier_metrics
from kvmesh.v1 import worker_pb2

LOG = logging.getLogger("kvmesh.service")


class RoleServices(Protocol):
    """What a role exposes to the process around it."""

    transfer_endpoints: dict[str, str]

    def held(self) -> list[worker_pb2.HeldBlockSet]: ...

    async def release(self, request_id: str, reason: str, generation: int = 0) -> bool:
        """Free what is held for `request_id` (at `generation` only; 0: any)."""
        ...

    async def close(self) -> None: ...


Install = Callable[
    [WorkerRuntime, WorkerServer, argparse.Namespace, WorkerMetrics], Awaitable[RoleServices]
]


def serve_role(
    role: str,
    argv: Sequence[str] | None,
    install: Install,
    preflight: Callable[[argparse.Namespace], None] = lambda args: None,
) -> int:
    """Parse options, start everything, print the ready line, run until SIGTERM/SIGINT, drain,
    and end the process with the exit code. `preflight(args)` runs before the model loads and
    raises OSError for what `install` could not bind (exit 2, nothing served)."""
    args = parse(role, argv, transfer=role != "colocated")
    setup_from_args(args, f"kvmesh-{role}")
    from kvmesh.security.flags import security_from_args
    from kvmesh.telemetry.tracing import setup_tracing

    try:  # before the model loads: a missing token or a bad OTEL_* variable fails in one line
        security = security_from_args(args)
        setup_tracing(f"kvmesh-{role}")
    except ValueError as error:
        print(f"kvmesh serve {role}: {error}", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)  # resolves --model: a bad one fails before anything starts
    except InvalidParameterError as error:
        print(f"kvmesh serve {role}: {error}", file=sys.stderr)
        return 2

    async def main(stop: asyncio.Event) -> None:
        metrics = WorkerMetrics(role)
        server = WorkerServer(
            args.host,
            args.port,
            reflection=args.reflection,
            max_message_bytes=args.max_message_bytes,
            max_connection_idle_seconds=args.max_connection_idle_seconds,
            security=security,
            on_refused=metrics.auth_refused.inc,
        )
        server.bind("--port")  # a busy port fails before the model loads
        check_port(args.host, args.metrics_port, "--metrics-port")
        preflight(args)
        # Loaded off the loop thread, so that a stop signal meanwhile is seen when it ends.
        runtime = await asyncio.to_thread(
            build_runtime, config, role, args.worker_id, args.served_model_name
        )
        try:
            if not stopped(stop, "loading the model"):
                await serve(runtime, server, metrics, stop)
        finally:
            await server.stop()
            runtime.prepare_pool.close()
            await runtime.engine.shutdown()

    async def serve(
        runtime: WorkerRuntime, server: WorkerServer, metrics: WorkerMetrics, stop: asyncio.Event
    ) -> None:
        bind_engine_metrics(metrics, runtime)
        register_tier_metrics(metrics.registry, lambda: runtime.engine.engine)
        services = await install(runtime, server, args, metrics)
        try:  # whatever fails from here on, the role's receivers and senders are closed
            if not stopped(stop, "installing the role"):
                await serve_installed(runtime, server, metrics, services, stop)
        finally:
            await services.close()

    async def serve_installed(
        runtime: WorkerRuntime,
        server: WorkerServer,
        metrics: WorkerMetrics,
        services: RoleServices,
        stop: asyncio.Event,
    ) -> None:
        await server.start()
        metrics_address = ""
        if args.metrics_port is not None:
            port = serve_metrics_on(metrics, args.host, args.metrics_port, "--metrics-port")
            metrics_address = f"{args.host}:{port}"
        if stopped(stop, "starting the server"):
            return
        info = worker_info(runtime, role, server.address, services, metrics_address)
        agent = None
        if args.control:
            from kvmesh.service.agent import ControlAgent

            agent = ControlAgent(args.control, info, runtime, services, security)
            agent.start()
        print_ready(
            role,
            server.address,
            runtime.worker_id,
            epoch=runtime.epoch,
            metrics_address=metrics_address,
            transfer_endpoints=services.transfer_endpoints,
            warmup=runtime.warmup,
        )
        await stop.wait()
        LOG.info("%s %s draining", role, runtime.worker_id)
        started = time.monotonic()
        await server.drain(args.drain_seconds)
        if agent is not None:
            await agent.stop()
        LOG.info("%s %s drained in %.2f s", role, runtime.worker_id, time.monotonic() - started)

    try:
        code = run_until_signal(main, f"kvmesh serve {role}")
    except UnsupportedModelError as error:  # raised while loading, before the ready line
        print(f"kvmesh serve {role}: model: {error}", file=sys.stderr)
        code = 2
    except InvalidParameterError as error:  # an option the loaded model refuses (while loading)
        print(f"kvmesh serve {role}: {option_error(error)}", file=sys.stderr)
        code = 2
    return exit_process(code)


def option_error(error: InvalidParameterError) -> str:
    """`--flag: message` of an engine option refused once the model is known (max_model_len
    beyond its positions, a KV budget without one block): the flag that sets the field."""
    flags = {flag.field: flag.flags[0] for flag in engine_flags()}
    return f"{flags.get(error.field, error.field)}: {error.message}"


def stopped(stop: asyncio.Event, what: str) -> bool:
    """Whether a stop signal came (while `what`): the worker then ends without serving, with
    no ready line and no registration."""
    if stop.is_set():
        LOG.info("stop signal while %s: exiting without serving", what)
    return stop.is_set()


def check_port(host: str, port: int | None, flag: str) -> None:
    """OSError "FLAG: cannot bind HOST:PORT: reason" when `port` is taken (None and 0: nothing
    to check). The port is bound again for real later: this only fails early."""
    if not port:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(f"{flag}: cannot bind {host}:{port}: {reason}") from None


def serve_metrics_on(metrics: WorkerMetrics, host: str, port: int, flag: str) -> int:
    """Serve `metrics` on host:port; the port bound (OSError naming `flag` if it cannot be)."""
    try:
        return serve_metrics(metrics, port, host)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(f"{flag}: cannot bind {host}:{port}: {reason}") from None


def exit_process(code: int) -> NoReturn:
    """End the worker process once it has stopped everything it started: atexit hooks run
    (trace export, transfer pools), then the process exits without interpreter teardown, which
    would only destroy torch and grpc globals (1-2 s) and can abort in the C++ destructor of a
    thread some library still holds."""
    logging.shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def worker_info(
    runtime: WorkerRuntime,
    role: str,
    address: str,
    services: RoleServices,
    metrics_address: str = "",
) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=runtime.worker_id,
        role=ROLES[role],
        address=address,
        epoch=runtime.epoch,
        layout=runtime.layout,
        num_blocks=runtime.engine.load().total_blocks,
        transfer_endpoints=services.transfer_endpoints,
        model=runtime.model,
        metrics_address=metrics_address,
    )


def bind_engine_metrics(metrics: WorkerMetrics, runtime: WorkerRuntime) -> None:
    """Engine families read the engine's load snapshot at every scrape (read-only); block
    gauges too; the engine thread observes the tokens of every step."""
    load = runtime.engine.load
    metrics.blocks.labels("used").set_function(lambda: load().total_blocks - load().free_blocks)
    metrics.blocks.labels("free").set_function(lambda: load().free_blocks)
    # cached: the free blocks still holding a reusable prefix (a subset of free), not every
    # block published in the prefix index (those in use by requests included)
    metrics.blocks.labels("cached").set_function(lambda: load().evictable_blocks)
    observe = metrics.bind_engine(load, runtime.model.model_name)
    runtime.engine.engine.step_observers.append(observe)
