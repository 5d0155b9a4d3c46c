"""The signed manifest: round trip, signature checks, and rejection of malformed bodies."""

import json

import pytest

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.keys import generate_key
from deltamesh.delta.manifest import Manifest, PieceEntry, TensorEntry, load_manifest, load_manifest_unverified

H = "0" * 32  # a tensor's digest: xxh3-128
P = "2" * 64  # a piece's digest from format 3: BLAKE3-256


def _manifest(**kw) -> Manifest:
    args = dict(
        model_id="m1", version=3, base_version=2, kind="delta", codec="test", base_hash="1" * 32,
        tensors=(TensorEntry("w", "BF16", (2, 3), H),), pieces=(PieceEntry(10, P, (0,)),),
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
        {"pieces": (PieceEntry(1, P, (5,)),)},
        {"pieces": (PieceEntry(10, H, (0,)),)},  # an xxh3-128 piece digest in a format 3 manifest
        {"pieces": (PieceEntry(10, P, (0,)),), "format_version": 2},  # and a BLAKE3 one in format 2
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
    from deltamesh.delta.hashing import piece_digest

    payload = b"0123456789"
    m = _manifest(pieces=(PieceEntry(10, piece_digest(payload), (0,)),))
    m.check_piece(0, payload)
    with pytest.raises(CorruptError, match="hash mismatch"):
        m.check_piece(0, b"0123456788")
    with pytest.raises(CorruptError, match="bytes"):
        m.check_piece(0, payload[:-1])
    with pytest.raises(CorruptError, match="out of range"):
        m.check_piece(1, payload)


def test_format_3_names_pieces_by_blake3_and_format_2_by_xxh3():
    """The signature binds a piece's bytes through a cryptographic digest from format 3 on: a piece
    whose xxh3-128 is what the manifest lists is refused there, and still accepted in a format 2
    manifest (what older trainers signed, read for stored versions)."""
    import blake3

    from deltamesh.delta.hashing import digest

    payload = b"0123456789"
    assert _manifest().format_version == 3
    current = _manifest(pieces=(PieceEntry(10, blake3.blake3(payload).hexdigest(), (0,)),))
    current.check_piece(0, payload)
    with pytest.raises(CorruptError):  # an xxh3-128 is not even a well-formed format 3 piece digest
        _manifest(pieces=(PieceEntry(10, digest(payload), (0,)),))
    older = _manifest(pieces=(PieceEntry(10, digest(payload), (0,)),), format_version=2)
    older.check_piece(0, payload)
    with pytest.raises(CorruptError, match="hash mismatch"):
        older.check_piece(0, b"0123456788")
    key = generate_key()
    assert load_manifest(older.signed(key), [key.public_key()]) == older


def _signed_body(key, **changes) -> bytes:
    """A signed envelope of `_manifest()`'s body with `changes` written into it, past the constructor's
    checks (as a buggy or compromised signer could send it)."""
    from deltamesh.delta.keys import key_id, sign

    body = _manifest().body()
    body.update(changes)
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({"body": raw.decode(), "key_id": key_id(key), "signature": sign(key, raw).hex()}).encode()


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"tensors": [["w", "BF16", [2**40, 2**20], H]]}, "over the limit"),
        ({"tensors": [["w", "U8", [1] * 17, H]]}, "bad shape"),
        ({"tensors": [[f"w{i}", "F64", [2**32], H] for i in range(200)]}, "tensors total"),
        ({"pieces": [[2**33, P, [0]]]}, "bad length"),
        ({"pieces": [[2**32, P, [0]]] * 1025}, "pieces total"),
    ],
    ids=["huge-tensor", "too-many-dims", "huge-total", "huge-piece", "huge-payload"],
)
def test_signed_manifests_declaring_oversized_shapes_or_sizes_are_corrupt(changes, reason):
    key = generate_key()
    with pytest.raises(CorruptError, match=reason):
        load_manifest(_signed_body(key, **changes), [key.public_key()])


def test_deeply_nested_envelopes_and_bodies_are_corrupt_not_a_crash():
    key = generate_key()
    with pytest.raises(CorruptError, match="nested deeper"):
        load_manifest_unverified(b"[" * 100_000 + b"]" * 100_000)
    nested = json.loads("[" * 70 + "]" * 70)  # signed, so it reaches the body's parser
    with pytest.raises(CorruptError, match="nested deeper"):
        load_manifest(_signed_body(key, tensors=nested), [key.public_key()])
