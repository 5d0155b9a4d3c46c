"""Ed25519 keys of trainers: generate, save, load, sign and verify.

A trainer signs every manifest with its private key; gateways and pools trust a set of public keys.
Keys are stored as PEM (PKCS#8 private, SubjectPublicKeyInfo public). A key id is the first 16 hex
characters of the xxh3-128 of the raw public key: short, stable, and only used to pick the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import KeyFileError, SignatureError
from .hashing import digest

__all__ = [
    "Ed25519PrivateKey",
    "Ed25519PublicKey",
    "generate_key",
    "key_id",
    "load_private_key",
    "load_public_key",
    "public_key_pem",
    "save_keypair",
    "sign",
    "verify",
]


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def key_id(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return digest(raw)[:16]


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def save_keypair(key: Ed25519PrivateKey, private_path: str | Path, public_path: str | Path | None = None) -> Path:
    """Write the private key (mode 0600) and its public key (default: PRIVATE.pub). Returns the public path."""
    private_path = Path(private_path)
    public_path = Path(public_path) if public_path else private_path.with_name(private_path.name + ".pub")
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(public_key_pem(key))
    return public_path


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """The private key in the PEM file at `path`; KeyFileError (one line) when it cannot be read or is
    not an Ed25519 private key."""
    try:
        pem = Path(path).read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read private key {path}: {e.strerror or e}") from None
    if b"PUBLIC KEY-----" in pem:
        raise KeyFileError(f"{path} holds a public key; the private key is the file without .pub")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"cannot load private key {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(source: str | Path | bytes) -> Ed25519PublicKey:
    """Load a public key from a PEM file path or PEM bytes; KeyFileError (one line) when it cannot be
    read or is not an Ed25519 public key. The message names a file, never the bytes (which could be a
    private key given by mistake)."""
    name = "the key given" if isinstance(source, bytes) else str(source)
    try:
        pem = source if isinstance(source, bytes) else Path(source).read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read public key {name}: {e.strerror or e}") from None
    if b"PRIVATE KEY-----" in pem:
        raise KeyFileError(f"{name} holds a private key, which must stay with the trainer: give its public "
                           "key (`deltamesh keys generate` writes it to PATH.pub)")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"cannot load public key {name}: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{name} is not an Ed25519 public key")
    return key


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return key.sign(message)


def verify(message: bytes, signature: bytes, signer_id: str, trusted: Iterable[Ed25519PublicKey]) -> Ed25519PublicKey:
    """Check `signature` with the trusted key whose id is `signer_id`; return that key or raise."""
    for key in trusted:
        if key_id(key) != signer_id:
            continue
        try:
            key.verify(signature, message)
        except InvalidSignature as e:
            raise SignatureError(f"bad signature by key {signer_id}") from e
        return key
    raise SignatureError(f"signed by key {signer_id}, which is not trusted")
