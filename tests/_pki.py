"""Certificates made for the TLS tests: a CA and the certificates it issues, as PEM files.

Each issued certificate names ``localhost`` and ``127.0.0.1`` (the tests' servers, etcd
included, listen on loopback) and lists no key usages, so it serves as a server's and as a
client's certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["Pki"]


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            False,
        )
    signer = issuer[1] if issuer else key
    return builder.sign(signer, hashes.SHA256())


class Pki:
    """A CA and the certificates it issues, written as PEM files under a directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = _certificate(f"{name} CA", self.key, None)
        self.ca_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, subject: str) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(subject, key, (self.cert, self.key))
        return cert.public_bytes(serialization.Encoding.PEM), _pem(key)

    def write(self, stem: str, data: bytes) -> Path:
        path = self.directory / stem
        path.write_bytes(data)
        return path
