"""The control plane's two gRPC doors: public and internal.

The public door (`port`) serves only the client API: GenerationService, health and, with
`reflection`, reflection; with API keys configured every call but health needs one. The
internal door (`internal_port`) serves ControlService (workers' Register/Heartbeat) and health;
with a cluster token every call but health must carry it. Both use TLS when certificates are
configured (the internal one mutual TLS with a CA). One health servicer answers on both.

Health: the overall service ("") is SERVING while up; "kvmesh.v1.GenerationService" is
SERVING only while a usable worker set is registered (a prefill + decode pair with equal
layouts, or a colocated worker). With `http_port`, the OpenAI-compatible HTTP door serves on the
same loop over the same FrontDoor. Draining sets everything NOT_SERVING, refuses new requests
(both doors), waits (bounded) for in-flight ones, then stops the HTTP server and the gRPC one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from control_plane.cluster import Cluster
from control_plane.config import ControlConfig
from control_plane.control_service import ControlServicer, Reaper
from control_plane.front_door import FrontDoor
from control_plane.generation_service import GenerationServicer
from control_plane.openai_http.app import openai_app
from control_plane.openai_http.server import HttpServer
from kvmesh.telemetry.metrics_http import MetricsServer, start_metrics_server
from kvmesh.telemetry.tracing import server_interceptors
from kvmesh.v1 import generation_pb2, generation_pb2_grpc, wire, worker_pb2, worker_pb2_grpc

LOG = logging.getLogger("kvmesh.control_plane")
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
CONTROL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ControlServer:
    """Owns the two grpc.aio servers (public and internal door) and the control plane's state;
    start() then drain()."""

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.front_door = FrontDoor(self.cluster)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._reaper = Reaper(self.cluster)
        security = config.security
        refused = self.cluster.metrics.auth_refused
        # Tracing first (a SERVER span per call, child of the caller's traceparent, that sees
        # every outcome); then authentication: a refused call's bytes are never parsed; then
        # the decode check.
        decode = wire.DecodeCheck()
        self.public_auth = security.public_interceptors(refused.labels("public").inc)
        self.internal_auth = security.internal_interceptors(refused.labels("internal").inc)
        options = wire.server_options(config.max_message_bytes, config.max_connection_idle_seconds)
        self._server = grpc.aio.server(
            options=options, interceptors=[*server_interceptors(), *self.public_auth, decode]
        )
        self._internal = grpc.aio.server(
            options=options, interceptors=[*server_interceptors(), *self.internal_auth, decode]
        )
        self.port = 0
        self.internal_port = 0
        self.http: HttpServer | None = None
        self.metrics_address = ""  # host:port of the Prometheus endpoint, once started
        self._metrics_http: MetricsServer | None = None
        self.cluster.on_serving_change(self._serving_changed)

    @property
    def address(self) -> str:
        """The public door (clients)."""
        return f"{self.config.host}:{self.port}"

    @property
    def internal_address(self) -> str:
        """The internal door (workers' `--control`)."""
        return f"{self.config.internal_host or self.config.host}:{self.internal_port}"

    def _bind(self, server: grpc.aio.Server, host: str, port: int, field: str, public: bool) -> int:
        return self.config.security.add_port(server, f"{host}:{port}", public=public, field=field)

    def _add_services(self) -> None:
        public, internal = self._server, self._internal
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.front_door), public
        )
        worker_pb2_grpc.add_ControlServiceServicer_to_server(
            ControlServicer(self.cluster), internal
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, public)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, internal)
        if self.config.reflection:
            from grpc_reflection.v1alpha import reflection

            for server, name in ((public, GENERATION_SERVICE), (internal, CONTROL_SERVICE)):
                names = (name, reflection.SERVICE_NAME, health.SERVICE_NAME)
                reflection.enable_server_reflection(names, server)

    async def start(self) -> None:
        """Bind every port, then serve. A port that cannot be bound is OSError "FIELD: cannot
        bind HOST:PORT: reason" (FIELD: port, internal_port, http_port or metrics_port), raised
        before anything serves and with every port bound so far closed."""
        self._add_services()
        try:
            self._bind_ports()
        except OSError:
            await self._close_ports()
            raise
        await self.health.set("", SERVING)
        await self.health.set(CONTROL_SERVICE, SERVING)
        await self.health.set(GENERATION_SERVICE, NOT_SERVING)
        await self._internal.start()
        await self._server.start()
        self._reaper.start()
        if self.http is not None:
            self.http.start()
            LOG.info("OpenAI-compatible API on %s/v1", self.http.url)
        LOG.info("control plane serving on %s (internal %s)", self.address, self.internal_address)

    def _bind_ports(self) -> None:
        """Bind the two gRPC doors, the HTTP door's socket and the metrics endpoint (the only
        one that serves at once, so bound last)."""
        c = self.config
        self.port = self._bind(self._server, c.host, c.port, "port", True)
        internal_host = c.internal_host or c.host
        self.internal_port = self._bind(
            self._internal, internal_host, c.internal_port, "internal_port", False
        )
        if c.http_port is not None:
            self.http = HttpServer(self._openai_app(), c.host, c.http_port, tls=c.security.tls)
        if c.metrics_port is not None:
            try:
                registry = self.cluster.metrics.registry
                self._metrics_http = start_metrics_server(registry, c.metrics_port, c.host)
            except OSError as error:
                reason = error.strerror or str(error)
                raise OSError(
                    f"metrics_port: cannot bind {c.host}:{c.metrics_port}: {reason}"
                ) from None
            self.metrics_address = f"{c.host}:{self._metrics_http.server_port}"

    async def _close_ports(self) -> None:
        """Close what `_bind_ports` bound before it failed (nothing serves yet)."""
        if self.http is not None:
            await self.http.stop()
            self.http = None
        await self._server.stop(None)
        await self._internal.stop(None)

    def _openai_app(self) -> Any:
        c, metrics = self.config, self.cluster.metrics
        return openai_app(
            self.front_door,
            metrics.registry,
            c.security.api_keys,
            metrics.auth_refused.labels("http").inc,
            max_body_bytes=c.max_http_body_bytes,
        )

    async def _serving_changed(self, serving: bool) -> None:
        if not self.front_door.draining:
            await self.health.set(GENERATION_SERVICE, SERVING if serving else NOT_SERVING)

    async def drain(self, grace: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish within the drain bound (sized from
        the longest of them, at most `grace`, default `--drain-seconds`), cut the rest with
        UNAVAILABLE "draining; retry", then stop."""
        cap = self.config.drain_seconds if grace is None else grace
        door = self.front_door
        door.draining = True
        await self.health.enter_graceful_shutdown()
        bound = door.drain_bound(cap)
        if door.inflight:
            LOG.info("drain: %d requests in flight, waiting up to %.1f s", door.inflight, bound)
        if not await door.wait_idle(bound):
            LOG.warning("drain: cutting %d requests still in flight", door.inflight)
            door.cut_all(f"the control plane is draining: the stream was cut after the "
                         f"{bound:.1f} s drain bound; retry")  # fmt: skip
            await door.wait_idle(2.0)
        await self.stop()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.shutdown)
            self._metrics_http.server_close()
        await self._reaper.stop()
        await self._server.stop(grace=1.0)
        await self._internal.stop(grace=1.0)
        await self.cluster.channels.close()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
