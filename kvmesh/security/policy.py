"""`Security`: the secrets and TLS settings one process applies to its ports and channels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.security.credentials import bearer_metadata
from kvmesh.security.interceptors import BearerAuth, attach_metadata
from kvmesh.security.tls import TlsConfig
from kvmesh.telemetry.tracing import client_interceptors

Options = Sequence[tuple[str, int | str]]


@dataclass(frozen=True)
class Security:
    """`token`: the cluster token internal ports require and internal channels present (None:
    internal calls are not authenticated, `--insecure-no-auth`). `api_keys`: what the public
    door requires (empty: open). `tls`: certificates for every port and channel (None:
    plaintext)."""

    token: str | None = None
    tls: TlsConfig | None = None
    api_keys: tuple[str, ...] = ()

    def __repr__(self) -> str:  # never print a secret
        return (f"Security(token={'set' if self.token else None}, tls={self.tls!r}, "
                f"api_keys={len(self.api_keys)})")  # fmt: skip

    def internal_interceptors(
        self, on_refused: Callable[[], object] | None = None
    ) -> list[grpc.aio.ServerInterceptor]:
        """Interceptors of an internal port: the cluster token is required."""
        if not self.token:
            return []
        return [BearerAuth((self.token,), "cluster token", on_refused=on_refused)]

    def public_interceptors(
        self, on_refused: Callable[[], object] | None = None
    ) -> list[grpc.aio.ServerInterceptor]:
        """Interceptors of the public door: an API key is required when keys are set."""
        if not self.api_keys:
            return []
        return [BearerAuth(self.api_keys, "API key", on_refused=on_refused)]

    def add_port(
        self, server: grpc.aio.Server, address: str, *, public: bool = False, field: str = "port"
    ) -> int:
        """Bind `address` on `server`, with TLS whenever TLS is configured; the port bound.
        OSError "FIELD: cannot bind ADDRESS: reason" when it cannot be bound (in use, a bad
        host): `field` names the flag or setting that chose it. CredentialError when TLS is
        configured without a certificate to serve it (a CA alone only verifies the servers this
        process calls): never plaintext instead."""
        try:
            if self.tls is not None:
                port = server.add_secure_port(address, self.tls.server_credentials(public=public))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as error:  # grpcio: "Failed to bind to address ..."
            raise OSError(
                f"{field}: cannot bind {address}: {bind_reason(address, error)}"
            ) from None
        if port == 0:  # older grpcio reported a failed bind as port 0
            raise OSError(f"{field}: cannot bind {address}: {bind_reason(address, None)}")
        return port

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata that authenticates an internal call."""
        return bearer_metadata(self.token)

    def aio_channel(self, target: str, options: Options = ()) -> grpc.aio.Channel:
        """An internal grpc.aio channel: every call carries the token and the trace context
        (a CLIENT span per call), over TLS when set."""
        interceptors: Any = client_interceptors()
        if self.token:
            interceptors += attach_metadata(self.call_metadata())
        if self.tls is not None:
            credentials = self.tls.channel_credentials()
            return grpc.aio.secure_channel(
                target, credentials, options=list(options), interceptors=interceptors
            )
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)

    def channel(self, target: str, options: Options = ()) -> grpc.Channel:
        """An internal blocking channel (callers pass `call_metadata()` on every call)."""
        if self.tls is not None:
            return grpc.secure_channel(target, self.tls.channel_credentials(), options=options)
        return grpc.insecure_channel(target, options=options)


def bind_reason(address: str, error: BaseException | None) -> str:
    """Why `address` could not be bound, in words: grpcio's message names no cause, so a plain
    socket bind of the same address tells (in use, not an address of this host)."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        family, kind, _, _, where = infos[0]
        with socket.socket(family, kind) as probe:
            probe.bind(where)
    except (OSError, ValueError) as cause:
        return getattr(cause, "strerror", None) or str(cause)
    return str(error) if error is not None else "the address could not be bound"


INSECURE = Security()
