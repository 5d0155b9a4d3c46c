"""A small certificate authority for a mesh: one CA, and server/client certificates it signs.

`deltamesh certs` and the demo use it so TLS is the path exercised every day. Keys are ECDSA
P-256, which every TLS stack accepts for both CA and leaf certificates. A leaf names its holder in the subject's common name (the identity a
server reads from a client certificate: `gateway/REGION`, `pool/NAME`, `trainer/MODEL`) and lists
the hosts it serves as subject alternative names (DNS names or IP addresses). Private keys are
written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 365


@dataclass(frozen=True)
class Issued:
    """Where a certificate and its key were written."""

    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(out_dir: str | Path, *, name: str = "deltamesh CA", days: int = DEFAULT_DAYS) -> Issued:
    """A self-signed CA: `ca.pem` and `ca.key` in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name)).issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    issued = Issued(out / "ca.pem", out / "ca.key")
    _write_cert(issued.cert, cert)
    _write_key(issued.key, key)
    return issued


def issue(ca: Issued, out_dir: str | Path, common_name: str, *, hosts: Sequence[str] = (),
          days: int = DEFAULT_DAYS, file_stem: str | None = None, not_before: datetime.datetime | None = None
          ) -> Issued:
    """A leaf certificate signed by `ca`, good for TLS servers (for `hosts`) and clients alike.

    Written as `STEM.pem` and `STEM.key` (the stem defaults to the common name with `/` as `-`).
    `not_before` exists for tests that need a certificate outside its validity window.
    """
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    stem = file_stem or common_name.replace("/", "-")
    issued = Issued(out / f"{stem}.pem", out / f"{stem}.key")
    _write_cert(issued.cert, cert)
    _write_key(issued.key, key)
    return issued


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
