"""The signed head statement: round trip, signature, model and age checks, and no confusion with manifests."""

import dataclasses
import json

import pytest

from deltamesh.delta import CorruptError, SignatureError, StaleStatementError, check_fresh, load_statement
from deltamesh.delta.keys import generate_key, key_id, sign
from deltamesh.delta.manifest import Manifest, TensorEntry, load_manifest
from deltamesh.delta.statement import HeadStatement, sign_statement

H = "ab" * 16


def test_signed_round_trip_and_its_order():
    key = generate_key()
    raw = sign_statement(key, "m1", 7, H, issued_ms=1_700_000_000_000)
    st = load_statement(raw, [generate_key().public_key(), key.public_key()], model="m1")
    assert st == HeadStatement("m1", 7, H, 1_700_000_000_000)
    assert HeadStatement("m1", 7, H, 2).supersedes(HeadStatement("m1", 7, H, 1))
    assert HeadStatement("m1", 8, H, 2).supersedes(HeadStatement("m1", 7, H, 1))
    assert not HeadStatement("m1", 6, H, 2).supersedes(HeadStatement("m1", 7, H, 1))  # an older version
    assert not HeadStatement("m1", 7, H, 1).supersedes(HeadStatement("m1", 7, H, 1))


def test_bad_signature_untrusted_key_and_other_model_are_refused():
    key = generate_key()
    raw = sign_statement(key, "m1", 7, H)
    with pytest.raises(SignatureError, match="not trusted"):
        load_statement(raw, [generate_key().public_key()])
    with pytest.raises(SignatureError, match="no trusted keys"):
        load_statement(raw, [])
    env = json.loads(raw)
    env["body"] = env["body"].replace('"version":7', '"version":8')
    with pytest.raises(SignatureError, match="bad signature"):
        load_statement(json.dumps(env).encode(), [key.public_key()])
    with pytest.raises(CorruptError, match="about m1, not m2"):
        load_statement(raw, [key.public_key()], model="m2")


def test_an_old_statement_is_stale_and_a_fresh_one_is_not():
    st = HeadStatement("m1", 1, H, issued_ms=1_000_000)
    with pytest.raises(StaleStatementError, match="over the 60s accepted"):
        check_fresh(st, 60, now=1_000 + 61)
    check_fresh(st, 60, now=1_000 + 59)
    check_fresh(st, 0, now=10**9)  # 0: any age


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"body": 1}', b'{"body": "{}", "key_id": "k", "signature": "zz"}',
                                  b"x" * 5000])
def test_malformed_envelopes_are_corrupt(data):
    with pytest.raises(CorruptError):
        load_statement(data, [generate_key().public_key()])


def test_statements_and_manifests_cannot_stand_in_for_each_other():
    key = generate_key()
    manifest = Manifest(model_id="m1", version=7, base_version=None, kind="full", codec="test",
                        tensors=(TensorEntry("w", "BF16", (2,), H),), pieces=())
    # A format 2 or 3 manifest is refused by its format_version, a format 1 one by its missing keys.
    with pytest.raises(CorruptError, match="head statement format_version 3"):
        load_statement(manifest.signed(key), [key.public_key()])
    old = dataclasses.replace(manifest, format_version=1)
    with pytest.raises(CorruptError, match="malformed head statement body"):
        load_statement(old.signed(key), [key.public_key()])
    with pytest.raises(CorruptError, match="malformed manifest body"):
        load_manifest(sign_statement(key, "m1", 7, H), [key.public_key()])


def test_an_unknown_format_version_is_refused_by_name():
    key = generate_key()
    body = json.dumps({"format_version": 2, "type": "deltamesh-head", "anything": "new"}, sort_keys=True,
                      separators=(",", ":"))
    raw = json.dumps({"body": body, "key_id": key_id(key), "signature": sign(key, body.encode()).hex()}).encode()
    with pytest.raises(CorruptError, match="format_version 2, this reader knows 1"):
        load_statement(raw, [key.public_key()])


@pytest.mark.parametrize("kw", [{"model_id": "../x"}, {"version": -1}, {"version": True}, {"weights_hash": "0"},
                                {"issued_ms": "now"}])
def test_invalid_statements_are_refused(kw):
    args = {"model_id": "m1", "version": 1, "weights_hash": H, "issued_ms": 1, **kw}
    with pytest.raises(CorruptError):
        HeadStatement(**args)
