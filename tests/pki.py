"""A throwaway PKI for TLS tests: a CA, a node certificate for loopback signed by it (server and
client use), and a second, unrelated CA with its own node certificate (a rogue peer).

Import as `from tests.pki import make_pki` (the repository root is on the test path)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: str  # PEM of the CA certificate
    cert: str  # node certificate (127.0.0.1, localhost), server and client auth
    key: str
    rogue_ca: str  # another CA and a node certificate it signed
    rogue_cert: str
    rogue_key: str


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _builder(subject: str, issuer: str, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _authority(directory: Path, label: str) -> tuple[str, str, str]:
    """(CA pem, node cert pem, node key pem) of one fresh authority, written to `directory`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = f"kvmesh test CA {label}"
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    usage = x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    node = (
        _builder(f"kvmesh node {label}", ca_name, node_key.public_key())
        .add_extension(san, critical=False)
        .add_extension(usage, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return (
        _write_cert(ca, directory / f"ca-{label}.pem"),
        _write_cert(node, directory / f"node-{label}.pem"),
        _write_key(node_key, directory / f"node-{label}.key"),
    )


def make_pki(directory: Path) -> Pki:
    """Write both authorities under `directory` and return the file paths."""
    ca, cert, key = _authority(directory, "cluster")
    rogue_ca, rogue_cert, rogue_key = _authority(directory, "rogue")
    return Pki(ca, cert, key, rogue_ca, rogue_cert, rogue_key)
