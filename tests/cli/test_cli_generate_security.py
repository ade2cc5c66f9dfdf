"""`kvmesh generate --target` security flags: API key from a file or KVMESH_API_KEY, TLS files,
extra metadata; a malformed header exits with a message naming it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.cli.generate import register
from kvmesh.cli.generate_remote import client_options


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["generate", "hello", "--target", "127.0.0.1:1", *argv])


def test_flags_become_client_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_API_KEY", "from-env-key-0123456789,second")
    assert client_options(parse())["api_key"] == "from-env-key-0123456789"
    keys = tmp_path / "keys"
    keys.write_text("# the front door's keys\nfrom-file-key-0123456789\nother\n")
    options = client_options(parse("--api-key-file", str(keys), "--tls-ca", "ca.pem",
                                   "--tls-cert", "c.pem", "--tls-key", "k.pem",
                                   "--header", "X-Tenant=a", "--header", "x-b=1=2"))  # fmt: skip
    assert options == {"api_key": "from-file-key-0123456789", "tls": False, "ca": "ca.pem",
                       "cert": "c.pem", "key": "k.pem",
                       "metadata": (("x-tenant", "a"), ("x-b", "1=2"))}  # fmt: skip


def test_a_malformed_header_exits_naming_it() -> None:
    with pytest.raises(SystemExit, match="--header 'nope' is not KEY=VALUE"):
        client_options(parse("--header", "nope"))
