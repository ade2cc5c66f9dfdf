"""Command-line options of authentication and TLS, shared by `kvmesh serve ROLE` and `kvmesh up`.

Policy: a serving role refuses to start without a cluster token unless `--insecure-no-auth` is
given explicitly (`kvmesh up` always makes one and hands it to its children in the environment).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from kvmesh.security.credentials import CredentialError, api_keys, cluster_token
from kvmesh.security.policy import Security
from kvmesh.security.tls import TlsConfig

NO_TOKEN = (
    "no cluster token: set --cluster-token-file PATH or KVMESH_CLUSTER_TOKEN (kvmesh up makes "
    "one), or pass --insecure-no-auth to run internal ports unauthenticated"
)


def add_tls_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    add = parser.add_argument
    add("--tls-cert", default=None, metavar="PEM", help="certificate chain: TLS on every port "
        "this process serves; the client certificate of its internal calls")  # fmt: skip
    add("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    add("--tls-ca", default=None, metavar="PEM", help="CA that verifies peers; internal ports "
        "then require client certificates it signed (mutual TLS)")  # fmt: skip


def add_security_flags(parser: argparse.ArgumentParser, *, public: bool = False) -> None:
    """Token and TLS flags of a serving role; `public` adds the public door's API keys."""
    group = parser.add_argument_group("authentication and transport security")
    add = group.add_argument
    add("--cluster-token-file", default=None, metavar="PATH",
        help="file holding the cluster token every internal call must carry (env "
        "KVMESH_CLUSTER_TOKEN_FILE; or the token itself in KVMESH_CLUSTER_TOKEN)")  # fmt: skip
    add("--insecure-no-auth", action="store_true",
        help="serve internal ports without a cluster token (trusted networks only)")  # fmt: skip
    add_tls_flags(group)
    if public:
        add("--api-key-file", default=None, metavar="PATH",
            help="API keys the public door requires, one a line (env KVMESH_API_KEY: "
            "comma-separated keys; default: the public door is open)")  # fmt: skip
        add("--tls-public-client-auth", action="store_true",
            help="the public door requires client certificates from --tls-ca too")  # fmt: skip


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    client_auth = bool(getattr(args, "tls_public_client_auth", False))
    if cert is None and key is None and ca is None and not client_auth:
        return None
    return TlsConfig(cert, key, ca, client_auth)


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Security:
    """The Security the parsed flags and `environ` name (CredentialError naming the flag)."""
    environ = os.environ if environ is None else environ
    token = cluster_token(args.cluster_token_file, environ)
    if token is None and not args.insecure_no_auth:
        raise CredentialError(NO_TOKEN)
    if token is not None and args.insecure_no_auth:
        raise CredentialError("--insecure-no-auth contradicts the cluster token that is set")
    keys = api_keys(getattr(args, "api_key_file", None), environ)
    return Security(token=token, tls=tls_from_args(args), api_keys=keys)
