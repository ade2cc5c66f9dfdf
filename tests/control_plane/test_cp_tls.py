"""TLS and mutual TLS on loopback with a CA made in the test: the public door (gRPC and HTTPS)
and the internal door; the control plane's calls to TLS workers; plaintext to a TLS port, a
missing client certificate and one from another CA all fail."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cp_harness import Harness, control_plane
from cp_workers import FakeWorker

from kvmesh.client import AsyncClient, KvmeshError, channel_credentials
from kvmesh.security import Security, TlsConfig
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.pki import Pki, make_pki

TOKEN = "cp-tls-cluster-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def tls_cluster(pki: Pki, public_client_auth: bool = False) -> AsyncIterator[Harness]:
    """A control plane serving TLS (mutual TLS inside) with a TLS prefill and decode worker."""
    tls = TlsConfig(pki.cert, pki.key, pki.ca, public_client_auth)
    security = Security(token=TOKEN, tls=tls)
    async with control_plane(security=security, http_port=0) as cp:
        await cp.add("p0", "prefill", security=security)
        await cp.add("d0", "decode", security=security)
        yield cp


async def register_with(cp: Harness, credentials: grpc.ChannelCredentials | None) -> Any:
    """A Register carrying the right token on a channel with `credentials` (None: plaintext);
    the status code it ends with."""
    target = cp.server.internal_address
    channel = (
        grpc.aio.insecure_channel(target)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials)
    )
    info = FakeWorker("intruder", "prefill").info(address="127.0.0.1:9")
    stub = worker_pb2_grpc.ControlServiceStub(channel)
    try:
        await stub.Register(
            worker_pb2.RegisterRequest(worker=info),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=3,
        )
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        await channel.close(None)


def test_tls_end_to_end_and_refused_peers(pki: Pki) -> None:
    async def scenario() -> None:
        async with tls_cluster(pki) as cp:
            address = cp.server.address
            async with AsyncClient(address, timeout=10, ca=pki.ca) as client:
                assert (await client.complete("hello", max_tokens=3)).token_ids
            async with AsyncClient(address, timeout=3) as plaintext:
                with pytest.raises(KvmeshError) as caught:
                    await plaintext.model_info()
                assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            async with AsyncClient(address, timeout=3, ca=pki.rogue_ca) as wrong_ca:
                with pytest.raises(KvmeshError):
                    await wrong_ca.model_info()
            # The internal door: mutual TLS with a certificate from the cluster CA only.
            assert await register_with(cp, None) == grpc.StatusCode.UNAVAILABLE
            no_cert = channel_credentials(ca=pki.ca)
            assert await register_with(cp, no_cert) == grpc.StatusCode.UNAVAILABLE
            rogue = channel_credentials(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)
            assert await register_with(cp, rogue) == grpc.StatusCode.UNAVAILABLE
            assert cp.server.cluster.registry.get("intruder") is None
            good = channel_credentials(ca=pki.ca, cert=pki.cert, key=pki.key)
            assert await register_with(cp, good) == grpc.StatusCode.OK

    asyncio.run(scenario())


def https_status(url: str, context: ssl.SSLContext | None) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, ssl.SSLError) as error:
        return type(error).__name__


def test_public_client_auth_and_https_door(pki: Pki) -> None:
    async def scenario() -> None:
        async with tls_cluster(pki, public_client_auth=True) as cp:
            address = cp.server.address
            async with AsyncClient(address, timeout=3, ca=pki.ca) as no_cert:
                with pytest.raises(KvmeshError) as caught:
                    await no_cert.model_info()
                assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            mutual = {"ca": pki.ca, "cert": pki.cert, "key": pki.key}
            async with AsyncClient(address, timeout=10, **mutual) as client:
                assert (await client.model_info()).model_name == "tiny"
            assert cp.server.http is not None
            url = f"{cp.server.http.url}/health"
            assert url.startswith("https://")
            with_cert = ssl.create_default_context(cafile=pki.ca)
            with_cert.load_cert_chain(pki.cert, pki.key)
            assert await asyncio.to_thread(https_status, url, with_cert) == 200
            without = ssl.create_default_context(cafile=pki.ca)
            assert await asyncio.to_thread(https_status, url, without) != 200
            plain = url.replace("https://", "http://")
            assert await asyncio.to_thread(https_status, plain, None) != 200

    asyncio.run(scenario())


def test_tls_config_names_the_flag_of_a_bad_file(tmp_path: Path, pki: Pki) -> None:
    from kvmesh.security import CredentialError

    with pytest.raises(CredentialError, match="--tls-cert and --tls-key"):
        TlsConfig(cert=pki.cert)
    with pytest.raises(CredentialError, match="--tls-ca: cannot read"):
        TlsConfig(pki.cert, pki.key, str(tmp_path / "missing.pem"))
    with pytest.raises(CredentialError, match="--tls-public-client-auth needs --tls-ca"):
        TlsConfig(pki.cert, pki.key, None, True)


def test_tls_config_refuses_files_that_are_not_what_their_flag_needs(
    tmp_path: Path, pki: Pki
) -> None:
    """Checked when the config is made (not at bind time, as "cannot bind", nor as calls that
    all fail UNAVAILABLE), naming the flag; an encrypted key fails without a password prompt."""
    from cryptography.hazmat.primitives import serialization

    from kvmesh.security import CredentialError

    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem\n")
    key = serialization.load_pem_private_key(Path(pki.key).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    refused = {
        "--tls-cert: .* holds no valid PEM certificate": (str(junk), pki.key, pki.ca),
        "--tls-key: .* holds no valid PEM private key": (pki.cert, str(junk), pki.ca),
        "--tls-key: .* is not the private key of --tls-cert": (pki.cert, pki.rogue_key, None),
        "--tls-key: .* is encrypted": (pki.cert, str(encrypted), None),
        "--tls-ca: .* holds no valid PEM certificate": (pki.cert, pki.key, str(junk)),
    }
    for message, (cert, key_file, ca) in refused.items():
        with pytest.raises(CredentialError, match=f"^{message}"):
            TlsConfig(cert, key_file, ca)
    with pytest.raises(CredentialError, match=r"^--tls-ca: .* holds no valid PEM certificate"):
        TlsConfig(ca=pki.key)  # a key is not a certificate
    assert TlsConfig(pki.cert, pki.key, pki.ca).ca == pki.ca


def test_a_server_with_a_ca_but_no_certificate_refuses_to_start(pki: Pki) -> None:
    """TLS asked for (a CA, client certificates required) without a certificate to serve it:
    the door does not start, naming the flags, instead of serving plaintext."""
    from kvmesh.security import CredentialError

    security = Security(token=TOKEN, tls=TlsConfig(ca=pki.ca, public_client_auth=True))

    async def scenario() -> None:
        with pytest.raises(CredentialError, match="--tls-cert and --tls-key"):
            async with control_plane(security=security):
                pass

    asyncio.run(scenario())
