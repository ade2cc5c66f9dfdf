"""The cluster token and the API keys: where they come from and how they are compared.

The cluster token authenticates every internal call (workers ↔ control plane, control plane →
workers, prefill → decode over the gRPC KV stream). Sources, first found wins: the file named by
`--cluster-token-file` (or `KVMESH_CLUSTER_TOKEN_FILE`; a Kubernetes Secret mounted as a file),
then `KVMESH_CLUSTER_TOKEN` (a Secret as an env var). Never a command-line value: argv is
readable by every user of the host. API keys guard the public door: `--api-key-file` (one key a
line, `#` comments) or `KVMESH_API_KEY` (comma-separated). Every secret is at least 16 printable
ASCII characters without whitespace (it travels in gRPC metadata and HTTP headers). Comparison
is constant-time (`hmac.compare_digest`) against every configured secret.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

TOKEN_ENV = "KVMESH_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "KVMESH_CLUSTER_TOKEN_FILE"
API_KEY_ENV = "KVMESH_API_KEY"
API_KEY_FILE_ENV = "KVMESH_API_KEY_FILE"
MIN_SECRET_CHARS = 16
BEARER = "bearer "


class CredentialError(ValueError):
    """A secret is missing or unusable; the message names the flag or variable to fix."""


def new_token() -> str:
    """A fresh random cluster token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _check(secret: str, source: str) -> str:
    """`secret` when usable: at least MIN_SECRET_CHARS characters, all printable ASCII without
    whitespace (gRPC metadata carries only ASCII); else CredentialError naming `source`."""
    if len(secret) < MIN_SECRET_CHARS:
        raise CredentialError(f"{source}: a secret needs at least {MIN_SECRET_CHARS} characters")
    if not all("!" <= c <= "~" for c in secret):
        raise CredentialError(f"{source}: a secret must be printable ASCII without whitespace")
    return secret


def read_secret_lines(path: str, source: str) -> list[str]:
    """Non-empty, non-comment lines of a secret file (CredentialError naming `source`)."""
    try:
        text = Path(path).read_text()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as error:
        raise CredentialError(f"{source}: cannot read {path}: {error}") from None
    if mode & stat.S_IWOTH:
        raise CredentialError(f"{source}: {path} is writable by every user")
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def cluster_token(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The cluster token from `path`, `KVMESH_CLUSTER_TOKEN_FILE` or `KVMESH_CLUSTER_TOKEN`;
    None when none is set."""
    path = path or environ.get(TOKEN_FILE_ENV) or None
    if path:
        source = "--cluster-token-file"
        lines = read_secret_lines(path, source)
        if len(lines) != 1:
            raise CredentialError(f"{source}: {path} must hold exactly one token line")
        return _check(lines[0], source)
    value = environ.get(TOKEN_ENV, "").strip()
    return _check(value, TOKEN_ENV) if value else None


def api_keys(path: str | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The public door's API keys (empty: the door is open)."""
    path = path or environ.get(API_KEY_FILE_ENV) or None
    if path:
        keys = read_secret_lines(path, "--api-key-file")
        if not keys:
            raise CredentialError(f"--api-key-file: {path} holds no key")
        return tuple(_check(k, "--api-key-file") for k in keys)
    value = environ.get(API_KEY_ENV, "")
    return tuple(_check(k.strip(), API_KEY_ENV) for k in value.split(",") if k.strip())


def matches(presented: str, allowed: Sequence[str]) -> bool:
    """Whether `presented` equals one of `allowed`, comparing every one in constant time."""
    given = presented.encode()
    found = False
    for secret in allowed:
        found |= hmac.compare_digest(given, secret.encode())
    return found


def bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The secret of an `authorization: Bearer SECRET` header, or None."""
    for key, value in metadata or ():
        if key.lower() != "authorization" or not isinstance(value, str):
            continue
        if value[: len(BEARER)].lower() == BEARER:
            return value[len(BEARER) :].strip()
    return None


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `secret` (nothing when None)."""
    return (("authorization", f"Bearer {secret}"),) if secret else ()
