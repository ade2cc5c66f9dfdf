"""Frozen configuration of the control plane (built once from the command line)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from control_plane.limits import MIB, RequestLimits
from control_plane.routing import DEFAULT_TRANSFER_BACKENDS, RoutingConfig
from kvmesh.security import Security

# Heartbeat intervals a lease covers at least: the heartbeat that renewed it, one lost without an
# answer (a worker gives up on a heartbeat after lease - 2 x interval at most), and its retry.
HEARTBEATS_PER_LEASE = 3
# What a field out of range must be, where its name alone does not say.
RANGES = {
    "heartbeat_interval_seconds": "positive and at most a third of lease_seconds, so that one "
    "lost heartbeat does not end a worker's lease",
}


@dataclass(frozen=True)
class ControlConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # the public door: GenerationService, health, reflection
    # The internal door: ControlService (workers' Register/Heartbeat) and health; 0 picks a
    # free port. Its host defaults to `host`.
    internal_port: int = 50052
    internal_host: str | None = None
    # Cluster token (internal port, channels to workers), API keys (public door), TLS.
    security: Security = field(default_factory=Security)
    # Requests in flight at once; beyond it Generate answers RESOURCE_EXHAUSTED.
    max_inflight: int = 256
    # A worker is dead after this long without a heartbeat. The interval is at most a third of
    # the lease (HEARTBEATS_PER_LEASE), so one heartbeat lost without an answer ends no lease.
    lease_seconds: float = 3.0
    heartbeat_interval_seconds: float = 1.0
    # How often the reaper looks for dead workers (never longer than the lease).
    reap_interval_seconds: float = 0.5
    # A decode reservation is reclaimed when Decode has not started within this long.
    reservation_lease_seconds: float = 30.0
    # Upper bound of any request's deadline, whatever the client asked.
    max_request_seconds: float = 600.0
    # Retry delay sent with RESOURCE_EXHAUSTED (RetryInfo, grpc-retry-pushback-ms, retry-after-ms).
    retry_after_ms: int = 200
    # Upper bound of the wait for in-flight requests at shutdown; the wait itself is sized
    # from the longest of them (FrontDoor.drain_bound).
    drain_seconds: float = 30.0
    # Per-token time assumed for a request that has not streamed two tokens yet (drain bound).
    drain_token_seconds: float = 0.05
    # Bound of each Release call.
    release_timeout_seconds: float = 1.0
    # Finished request ids remembered for idempotent Abort.
    history_size: int = 4096
    # Extra queued requests the prefix-affine prefill worker may carry over the least loaded.
    affinity_slack: int = 4
    # KV transfer backends in order of preference.
    transfer_backends: tuple[str, ...] = DEFAULT_TRANSFER_BACKENDS
    reflection: bool = False
    # OpenAI-compatible HTTP API port (0 picks a free one); None disables it.
    http_port: int | None = None
    # Prometheus text endpoint port (0 picks a free one); None disables it.
    metrics_port: int | None = None
    # Record prompt and output text on request spans (also enabled by the GenAI capture env).
    trace_message_content: bool = False
    # Largest gRPC message the front door port takes or sends (beyond: RESOURCE_EXHAUSTED).
    max_message_bytes: int = 4 * MIB
    # Largest message on the control plane's channels to workers (prepared requests).
    worker_max_message_bytes: int = 16 * MIB
    # Largest HTTP request body (beyond: 413).
    max_http_body_bytes: int = 4 * MIB
    # A gRPC connection (either door) with no call for this long is closed with GOAWAY; calls
    # in flight are never cut, and clients reconnect on their next call.
    max_connection_idle_seconds: float = 300.0
    # Per-request size bounds checked before any worker call.
    limits: RequestLimits = field(default_factory=RequestLimits)

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(self.affinity_slack, transfer_backends=self.transfer_backends)

    def __post_init__(self) -> None:
        checks = {
            "max_inflight": self.max_inflight >= 1,
            "lease_seconds": self.lease_seconds > 0,
            "heartbeat_interval_seconds": self._heartbeat_interval_fits(),
            "reap_interval_seconds": 0 < self.reap_interval_seconds <= self.lease_seconds,
            "reservation_lease_seconds": self.reservation_lease_seconds > 0,
            "max_request_seconds": self.max_request_seconds > 0,
            "drain_seconds": self.drain_seconds >= 0,
            "drain_token_seconds": self.drain_token_seconds > 0,
            "port": 0 <= self.port < 65536,
            "internal_port": 0 <= self.internal_port < 65536,
            "http_port": self.http_port is None or 0 <= self.http_port < 65536,
            "retry_after_ms": self.retry_after_ms >= 0,
            "max_message_bytes": self.max_message_bytes >= 1024,
            "worker_max_message_bytes": self.worker_max_message_bytes >= 1024,
            "max_http_body_bytes": self.max_http_body_bytes >= 1024,
            "max_connection_idle_seconds": self.max_connection_idle_seconds > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            rule = RANGES.get(bad[0])
            raise ValueError(f"{bad[0]} is out of range" + (f": it must be {rule}" if rule else ""))

    def _heartbeat_interval_fits(self) -> bool:
        """Positive, and HEARTBEATS_PER_LEASE intervals fit in the lease (0.1 s in 0.3 s too)."""
        needed = HEARTBEATS_PER_LEASE * self.heartbeat_interval_seconds
        fits = needed <= self.lease_seconds or math.isclose(needed, self.lease_seconds)
        return self.heartbeat_interval_seconds > 0 and fits
