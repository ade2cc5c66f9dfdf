"""TLS and mutual TLS from PEM files, for grpc servers and channels.

A process with `cert` and `key` serves TLS on every port. With `ca`, internal ports require a
client certificate signed by it (mutual TLS), and the process's own channels verify servers
against it and present `cert` as their client certificate. The public door requires client
certificates only with `public_client_auth`. Without `ca`, channels verify servers against the
system roots. Certificates must name the address callers dial (an IP or DNS subjectAltName).
The files are checked when the config is made, with the standard library's `ssl`: `cert` and
`ca` must hold PEM certificates, and `key` the unencrypted PEM private key of `cert`; anything
else is a CredentialError naming the flag (`--tls-cert`, `--tls-key`, `--tls-ca`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvmesh.security.credentials import CredentialError


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise CredentialError(f"{flag}: cannot read {path}: {error}") from None


def _check_certificates(path: str, flag: str) -> None:
    """CredentialError naming `flag` unless `path` holds at least one valid PEM certificate."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError:
        raise CredentialError(f"{flag}: {path} holds no valid PEM certificate") from None


def _check_key(cert: str, key: str) -> None:
    """CredentialError naming --tls-key unless `key` is the unencrypted PEM private key of the
    (already checked) certificate `cert`; an encrypted key fails without asking for a password."""

    def refuse_password() -> bytes:
        raise CredentialError(f"--tls-key: {key} is encrypted; grpc needs an unencrypted key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, refuse_password)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise CredentialError(
                f"--tls-key: {key} is not the private key of --tls-cert {cert}"
            ) from None
        raise CredentialError(f"--tls-key: {key} holds no valid PEM private key") from None


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None  # PEM certificate chain (server, and client for mutual TLS)
    key: str | None = None  # its PEM private key
    ca: str | None = None  # PEM roots that verify peers; enables mutual TLS on internal ports
    public_client_auth: bool = False  # the public door requires client certificates too

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise CredentialError("--tls-cert and --tls-key go together")
        files = ((self.cert, "--tls-cert"), (self.key, "--tls-key"), (self.ca, "--tls-ca"))
        for path, flag in files:
            _read(path, flag)  # a missing file fails at startup, naming its flag
        if self.public_client_auth and self.ca is None:
            raise CredentialError("--tls-public-client-auth needs --tls-ca")
        self._check_contents()

    def _check_contents(self) -> None:
        """CredentialError naming the flag of a file that is not what it should be (module doc)."""
        if self.cert is not None and self.key is not None:
            _check_certificates(self.cert, "--tls-cert")
            _check_key(self.cert, self.key)
        if self.ca is not None:
            _check_certificates(self.ca, "--tls-ca")

    def server_credentials(self, *, public: bool = False) -> grpc.ServerCredentials:
        """Credentials of a server port; client certificates required on internal ports when a
        CA is set (on the public one only with `public_client_auth`)."""
        cert, key = _read(self.cert, "--tls-cert"), _read(self.key, "--tls-key")
        if cert is None or key is None:
            raise CredentialError(
                "serving TLS needs --tls-cert and --tls-key (--tls-ca alone only verifies the"
                " servers this process calls)"
            )
        require = self.ca is not None and (self.public_client_auth or not public)
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=_read(self.ca, "--tls-ca") if require else None,
            require_client_auth=require,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel: verify the server against `ca` (system roots without it),
        present `cert` as the client certificate when set."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca"),
            private_key=_read(self.key, "--tls-key"),
            certificate_chain=_read(self.cert, "--tls-cert"),
        )
