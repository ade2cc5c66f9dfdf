"""Where the cluster token and API keys come from, the refusal to serve without a token, and the
bearer checks themselves."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvmesh.security import CredentialError
from kvmesh.security.credentials import api_keys, bearer, cluster_token, matches, new_token
from kvmesh.security.flags import NO_TOKEN, add_security_flags, security_from_args

TOKEN = "a-cluster-token-0123456789"


def secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def parse(*argv: str, public: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_security_flags(parser, public=public)
    return parser.parse_args(list(argv))


def test_token_sources_in_order_file_then_file_env_then_env(tmp_path: Path) -> None:
    path = secret_file(tmp_path, f"# the token\n{TOKEN}\n")
    env = {"KVMESH_CLUSTER_TOKEN": "from-the-environment-0123"}
    assert cluster_token(path, env) == TOKEN
    assert cluster_token(None, {**env, "KVMESH_CLUSTER_TOKEN_FILE": path}) == TOKEN
    assert cluster_token(None, env) == "from-the-environment-0123"
    assert cluster_token(None, {}) is None
    assert (
        cluster_token(None, {"KVMESH_CLUSTER_TOKEN_FILE": "", **env}) == env["KVMESH_CLUSTER_TOKEN"]
    )


def test_unusable_tokens_are_refused_naming_their_source(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match="KVMESH_CLUSTER_TOKEN: a secret needs at least 16"):
        cluster_token(None, {"KVMESH_CLUSTER_TOKEN": "short"})
    with pytest.raises(CredentialError, match="--cluster-token-file: cannot read"):
        cluster_token(str(tmp_path / "absent"), {})
    with pytest.raises(CredentialError, match="exactly one token line"):
        cluster_token(secret_file(tmp_path, f"{TOKEN}\n{TOKEN}x\n"), {})
    with pytest.raises(CredentialError, match="writable by every user"):
        cluster_token(secret_file(tmp_path, TOKEN, 0o666), {})
    with pytest.raises(CredentialError, match="without whitespace"):
        cluster_token(None, {"KVMESH_CLUSTER_TOKEN": "has a space in the middle"})


def test_non_ascii_secrets_are_refused_naming_their_source(tmp_path: Path) -> None:
    """gRPC metadata carries only ASCII: such a token could never authenticate a call."""
    secret = "t\u00f6ken-t\u00f6ken-t\u00f6ken-t\u00f6ken"
    refused = "a secret must be printable ASCII without whitespace"
    with pytest.raises(CredentialError, match=f"^KVMESH_CLUSTER_TOKEN: {refused}"):
        cluster_token(None, {"KVMESH_CLUSTER_TOKEN": secret})
    with pytest.raises(CredentialError, match=f"^--cluster-token-file: {refused}"):
        cluster_token(secret_file(tmp_path, secret), {})
    with pytest.raises(CredentialError, match=f"^KVMESH_API_KEY: {refused}"):
        api_keys(None, {"KVMESH_API_KEY": f"{TOKEN},{secret}"})
    with pytest.raises(CredentialError, match=f"^--api-key-file: {refused}"):
        api_keys(secret_file(tmp_path, f"{TOKEN}\n{secret}\n"), {})
    every_printable = "".join(chr(c) for c in range(0x21, 0x7F))
    assert cluster_token(None, {"KVMESH_CLUSTER_TOKEN": every_printable}) == every_printable


def test_api_keys_from_file_or_comma_separated_env(tmp_path: Path) -> None:
    keys = ("first-api-key-0123456789", "second-api-key-012345678")
    assert api_keys(secret_file(tmp_path, "\n".join(keys) + "\n"), {}) == keys
    assert api_keys(None, {"KVMESH_API_KEY": ",".join(keys)}) == keys
    assert api_keys(None, {}) == ()
    with pytest.raises(CredentialError, match="holds no key"):
        api_keys(secret_file(tmp_path, "# nothing\n"), {})


def test_serving_without_a_token_needs_insecure_no_auth_explicitly(tmp_path: Path) -> None:
    with pytest.raises(CredentialError) as caught:
        security_from_args(parse(), {})
    assert str(caught.value) == NO_TOKEN
    assert security_from_args(parse("--insecure-no-auth"), {}).token is None
    with pytest.raises(CredentialError, match="contradicts"):
        security_from_args(parse("--insecure-no-auth"), {"KVMESH_CLUSTER_TOKEN": TOKEN})
    path = secret_file(tmp_path, TOKEN)
    security = security_from_args(parse("--cluster-token-file", path), {})
    assert security.token == TOKEN and security.tls is None and security.api_keys == ()
    assert TOKEN not in repr(security)


def test_serve_control_and_a_worker_role_exit_2_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("KVMESH_CLUSTER_TOKEN", "KVMESH_CLUSTER_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    from control_plane.main import run as run_control
    from prefill_svc.main import run as run_prefill

    assert run_control(["--port", "0"]) == 2
    assert "kvmesh serve control: no cluster token" in capsys.readouterr().err
    assert run_prefill(["--model", "/nonexistent"]) == 2  # before any model is looked at
    assert "kvmesh serve prefill: no cluster token" in capsys.readouterr().err


def test_bearer_parsing_and_constant_time_matching() -> None:
    assert bearer([("authorization", f"Bearer {TOKEN}")]) == TOKEN
    assert bearer([("authorization", f"bearer  {TOKEN} ")]) == TOKEN
    assert bearer([("authorization", TOKEN)]) is None
    assert bearer([("x-kvmesh-token", f"Bearer {TOKEN}")]) is None
    assert bearer(None) is None
    assert matches(TOKEN, ["other-token-0123456789", TOKEN])
    assert not matches(TOKEN[:-1], [TOKEN]) and not matches(TOKEN + "x", [TOKEN])
    assert not matches("", [TOKEN])
    first, second = new_token(), new_token()
    assert first != second and len(first) >= 40 and os.sep not in first
