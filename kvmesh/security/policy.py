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

    def add_port(self, server: grpc.aio.Server, address: str, *, public: bool = False) -> int:
        """Bind `address` on `server`, with TLS whenever TLS is configured; the port (0:
        failed). CredentialError when TLS is configured without a certificate to serve it (a CA
        alone only verifies the servers this process calls): never plaintext instead."""
        if self.tls is not None:
            return server.add_secure_port(address, self.tls.server_credentials(public=public))
        return server.add_insecure_port(address)

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


INSECURE = Security()
