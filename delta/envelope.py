"""The signed envelope that manifests and head statements travel in: `{"body", "key_id", "signature"}`.

The body is canonical JSON (sorted keys, no spaces), signed as those exact bytes with the trainer's
Ed25519 key; readers parse the envelope, verify the signature against their trusted keys, and only
then parse the body. One implementation for both documents, so they are sealed and opened alike.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from deltamesh.peer_json import parse_json

from .errors import CorruptError, SignatureError
from .keys import Ed25519PrivateKey, Ed25519PublicKey, key_id, sign, verify


def canonical_json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def seal(key: Ed25519PrivateKey, body: bytes) -> bytes:
    """The envelope of `body`, signed with `key`, as stored and sent."""
    env = {"body": body.decode(), "key_id": key_id(key), "signature": sign(key, body).hex()}
    return json.dumps(env, sort_keys=True).encode()


def unseal(data: bytes, what: str) -> tuple[bytes, str, bytes]:
    """(body, signer key id, signature) of an envelope, unverified; CorruptError naming `what` if malformed."""
    try:
        env = parse_json(data)
        body = env["body"].encode()
        signer = env["key_id"]
        signature = bytes.fromhex(env["signature"])
        if not isinstance(signer, str):
            raise TypeError("key_id must be a string")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptError(f"malformed {what} envelope: {type(e).__name__}: {e}") from e
    return body, signer, signature


def open_sealed(data: bytes, trusted: Iterable[Ed25519PublicKey], what: str) -> bytes:
    """The body of an envelope whose signature verifies against one of `trusted`; raises CorruptError
    (malformed) or SignatureError (no trusted keys, unknown signer, bad signature)."""
    body, signer, signature = unseal(data, what)
    trusted = list(trusted)
    if not trusted:
        raise SignatureError("no trusted keys configured")
    verify(body, signature, signer, trusted)
    return body
