"""The signed manifest: round trip, signature checks, and rejection of malformed bodies."""

import json

import pytest

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.keys import generate_key
from deltamesh.delta.manifest import Manifest, PieceEntry, TensorEntry, load_manifest, load_manifest_unverified

H = "0" * 32


def _manifest(**kw) -> Manifest:
    args = dict(
        model_id="m1", version=3, base_version=2, kind="delta", codec="test", base_hash="1" * 32,
        tensors=(TensorEntry("w", "BF16", (2, 3), H),), pieces=(PieceEntry(10, H, (0,)),),
    )
    args.update(kw)
    return Manifest(**args)


def test_signed_round_trip():
    key = generate_key()
    m = _manifest()
    assert load_manifest(m.signed(key), [generate_key().public_key(), key.public_key()]) == m


def test_wrong_key_and_tampering_are_signature_errors():
    key, other = generate_key(), generate_key()
    data = _manifest().signed(key)
    with pytest.raises(SignatureError, match="not trusted"):
        load_manifest(data, [other.public_key()])
    env = json.loads(data)
    env["body"] = env["body"].replace('"version":3', '"version":4')
    with pytest.raises(SignatureError, match="bad signature"):
        load_manifest(json.dumps(env).encode(), [key.public_key()])
    with pytest.raises(SignatureError, match="no trusted keys"):
        load_manifest(data, [])


@pytest.mark.parametrize(
    "kw",
    [
        {"model_id": "../etc"},
        {"model_id": ""},
        {"version": -1},
        {"kind": "full"},  # a full snapshot with a base
        {"base_version": 3},
        {"tensors": (TensorEntry("w", "X7", (1,), H),)},
        {"pieces": (PieceEntry(1, H, (5,)),)},
    ],
)
def test_invalid_manifests_rejected(kw):
    with pytest.raises(CorruptError):
        _manifest(**kw)


@pytest.mark.parametrize("cut", [0, 1, 10, 50, -1])
def test_truncated_envelope_is_corrupt(cut):
    data = _manifest().signed(generate_key())
    with pytest.raises(CorruptError):
        load_manifest_unverified(data[:cut])


def test_check_piece():
    from deltamesh.delta.hashing import digest

    payload = b"0123456789"
    m = _manifest(pieces=(PieceEntry(10, digest(payload), (0,)),))
    m.check_piece(0, payload)
    with pytest.raises(CorruptError, match="hash mismatch"):
        m.check_piece(0, b"0123456788")
    with pytest.raises(CorruptError, match="bytes"):
        m.check_piece(0, payload[:-1])
    with pytest.raises(CorruptError, match="out of range"):
        m.check_piece(1, payload)
