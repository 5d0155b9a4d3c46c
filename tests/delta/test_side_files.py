"""Side files (config, tokenizer) travel in a version, signed: shipped when new or changed, kept from the
base when unchanged, refused when tampered with or named to escape the directory."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deltamesh.delta import (
    BaseMismatchError,
    CorruptError,
    apply_to_dir,
    decode_version,
    dir_manifest,
    encode_delta,
    encode_full,
    load_manifest,
    read_side_files,
    read_weights,
)
from deltamesh.delta.envelope import canonical_json, seal
from deltamesh.delta.hashing import digest, piece_digest
from deltamesh.delta.manifest import FileEntry, Manifest

CONFIG = b'{"model_type": "llama"}'
TOKENIZER = b'{"version": "1.0"}'
GENERATION = b'{"max_new_tokens": 8}'


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, generator=g).to(torch.bfloat16), "b": torch.randn(40, 7, generator=g)}


def _next(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in w.items()}
    out["a"].view(torch.int16)[::17] += 1
    return out


def test_full_then_deltas_carry_side_files_and_reship_only_changes(tmp_path, key, same_weights):
    v0, files = _weights(0), {"config.json": CONFIG, "tokenizer.json": TOKENIZER}
    full = encode_full(v0, model_id="m", version=0, key=key, files=files)
    assert [(f.name, f.piece is not None) for f in full.manifest.files] == [("config.json", True), ("tokenizer.json", True)]
    path = tmp_path / "pool"
    apply_to_dir(path, [(full.manifest, full.pieces)])  # a fresh directory: nothing pre-seeded
    assert (path / "config.json").read_bytes() == CONFIG and (path / "tokenizer.json").read_bytes() == TOKENIZER

    # Unchanged side files are listed (signed) but not shipped: no piece beyond the tensors'.
    v1 = _next(v0)
    base_files = {f.name: f.hash for f in full.manifest.files}
    same = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key, files=files, base_files=base_files)
    assert all(f.piece is None for f in same.manifest.files) and len(same.manifest.files) == 2
    assert all(p.tensors for p in same.manifest.pieces), "only codec pieces"
    apply_to_dir(path, [decode_version(same.manifest, same.pieces)])
    assert (path / "config.json").read_bytes() == CONFIG and same_weights(read_weights(path), v1)

    # A changed and a new side file are shipped, the others still kept.
    v2 = _next(v1)
    changed = {**files, "tokenizer.json": b'{"version": "2.0"}', "generation_config.json": GENERATION}
    delta = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key, files=changed, base_files=base_files)
    shipped = {f.name for f in delta.manifest.files if f.piece is not None}
    assert shipped == {"tokenizer.json", "generation_config.json"}
    assert apply_to_dir(path, [(delta.manifest, delta.pieces)]).version == 2
    assert {n: (path / n).read_bytes() for n in changed} == changed
    assert dir_manifest(path).files == delta.manifest.files


def test_a_chain_takes_each_side_file_from_the_last_step_that_shipped_it(tmp_path, key):
    v0 = _weights(1)
    v1 = _next(v0)
    v2 = _next(v1)
    full = encode_full(v0, model_id="m", version=0, key=key, files={"config.json": CONFIG})
    path = tmp_path / "pool"
    apply_to_dir(path, [(full.manifest, full.pieces)])
    d1 = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key,
                      files={"config.json": b"{}"}, base_files={"config.json": piece_digest(CONFIG)})
    d2 = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key,
                      files={"config.json": b"{}"}, base_files={"config.json": piece_digest(b"{}")})
    apply_to_dir(path, [(d1.manifest, d1.pieces), (d2.manifest, d2.pieces)])
    assert (path / "config.json").read_bytes() == b"{}"


def test_a_delta_whose_unshipped_side_file_is_not_held_is_a_base_mismatch(tmp_path, key, same_weights):
    """A directory without the side file a delta keeps (e.g. filled by an old-format version) cannot
    take the delta: the pool falls back to a full snapshot, which ships every side file."""
    v0 = _weights(2)
    v1 = _next(v0)
    path = tmp_path / "pool"
    full = encode_full(v0, model_id="m", version=0, key=key)
    apply_to_dir(path, [(full.manifest, full.pieces)])
    (path / "config.json").write_bytes(b'{"tampered": true}')  # held, but not the listed bytes
    delta = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key, files={"config.json": CONFIG},
                         base_files={"config.json": piece_digest(CONFIG)})
    with pytest.raises(BaseMismatchError, match="config.json"):
        apply_to_dir(path, [(delta.manifest, delta.pieces)])
    assert dir_manifest(path).version == 0 and same_weights(read_weights(path), v0)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name], "the refused write is cleaned up"


def test_a_tampered_side_file_piece_is_refused_and_nothing_moves(tmp_path, key, same_weights):
    v0 = _weights(3)
    full = encode_full(v0, model_id="m", version=0, key=key, files={"config.json": CONFIG})
    index = full.manifest.files[0].piece
    pieces = list(full.pieces)
    pieces[index] = CONFIG.replace(b"llama", b"evil!")  # same length, other bytes
    with pytest.raises(CorruptError, match=f"piece {index}: hash mismatch"):
        decode_version(full.manifest, pieces)
    path = tmp_path / "pool"
    with pytest.raises(CorruptError):
        apply_to_dir(path, [(full.manifest, pieces)])
    assert not path.exists()
    # The manifest is signed: changing the listed hash to match tampered bytes breaks the signature.
    body = json.loads(json.loads(full.manifest_bytes)["body"])
    body["files"][0][2] = piece_digest(pieces[index])
    envelope = json.loads(full.manifest_bytes)
    envelope["body"] = canonical_json(body).decode()
    with pytest.raises(Exception, match="signature"):
        load_manifest(json.dumps(envelope).encode(), [key.public_key()])


@pytest.mark.parametrize("name", ["../config.json", "a/b.json", "/etc/passwd", "..", ".", ".hidden.json",
                                  "sub\\x.json", "model.safetensors", "model.safetensors.index.json",
                                  "deltamesh-manifest.json", "", "x" * 200, "con\x00fig.json"])
def test_a_side_file_name_that_could_leave_the_directory_is_refused(tmp_path, key, name):
    """Even signed by a trusted key, a manifest naming a path (or a weight file) is refused as corrupt
    before anything is written."""
    data = b"{}"
    good = encode_full(_weights(4), model_id="m", version=0, key=key, files={"config.json": data})
    body = json.loads(good.manifest.body_bytes())
    body["files"][0][0] = name
    with pytest.raises(CorruptError, match="side file"):
        load_manifest(seal(key, canonical_json(body)), [key.public_key()])
    with pytest.raises(CorruptError, match="side file"):
        dataclasses.replace(good.manifest, files=(FileEntry(name, 2, piece_digest(data), good.manifest.files[0].piece),))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_side_file_entries_must_match_their_pieces(key):
    good = encode_full(_weights(5), model_id="m", version=0, key=key, files={"config.json": CONFIG})
    f = good.manifest.files[0]
    for bad, why in [(dataclasses.replace(f, size=f.size + 1), "not exactly its bytes"),
                     (dataclasses.replace(f, piece=0), "not exactly its bytes"),  # a codec piece
                     (dataclasses.replace(f, piece=99), "out of range"),
                     (dataclasses.replace(f, piece=None), "full snapshot ships every side file"),
                     (dataclasses.replace(f, size=1 << 40), "bad size")]:
        with pytest.raises(CorruptError, match=why):
            dataclasses.replace(good.manifest, files=(bad,))
    with pytest.raises(CorruptError, match="sorted and unique"):
        dataclasses.replace(good.manifest, files=(f, f))
    with pytest.raises(CorruptError, match="format 1 manifest has no side files"):
        _older(good.manifest, good.pieces, format_version=1)


def _older(manifest: Manifest, pieces: list[bytes], format_version: int) -> Manifest:
    """`manifest` as a writer of an older format made it: pieces and side files named by xxh3-128."""
    digests = [digest(p) for p in pieces]
    return dataclasses.replace(
        manifest, format_version=format_version,
        pieces=tuple(dataclasses.replace(p, hash=digests[i]) for i, p in enumerate(manifest.pieces)),
        files=tuple(dataclasses.replace(f, hash=digest(pieces[f.piece])) for f in manifest.files if f.piece is not None))


def test_format_1_manifests_are_still_read_and_applied(tmp_path, key, same_weights):
    """A version 1 manifest (no side files) applies as before: the directory's side files carry over."""
    v0 = _weights(6)
    v1 = _next(v0)
    old_full = encode_full(v0, model_id="m", version=0, key=key)
    m0 = _older(old_full.manifest, old_full.pieces, format_version=1)
    assert "files" not in json.loads(m0.body_bytes())
    path = tmp_path / "pool"
    apply_to_dir(path, [(load_manifest(m0.signed(key), [key.public_key()]), old_full.pieces)])
    (path / "config.json").write_bytes(CONFIG)  # pre-seeded by an operator, as before format 2
    delta = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key)
    m1 = Manifest.from_body(_older(delta.manifest, delta.pieces, format_version=1).body_bytes())
    assert m1.format_version == 1 and m1.files == ()
    apply_to_dir(path, [(m1, delta.pieces)])
    assert (path / "config.json").read_bytes() == CONFIG and same_weights(read_weights(path), v1)
    with pytest.raises(CorruptError, match="format_version 5"):
        Manifest.from_body(canonical_json({**json.loads(m1.body_bytes()), "format_version": 5}))


def test_a_format_2_version_is_read_and_the_format_3_delta_after_it_reships_its_side_files(tmp_path, key, same_weights):
    """Format 2 named side files by xxh3-128: a pool holding such a version takes the first delta of a
    format 3 writer, which lists them by BLAKE3 and so ships them again, once."""
    v0, files = _weights(7), {"config.json": CONFIG}
    full = encode_full(v0, model_id="m", version=0, key=key, files=files)
    m0 = load_manifest(_older(full.manifest, full.pieces, format_version=2).signed(key), [key.public_key()])
    path = tmp_path / "pool"
    apply_to_dir(path, [(m0, full.pieces)])
    assert dir_manifest(path).format_version == 2 and (path / "config.json").read_bytes() == CONFIG
    v1 = _next(v0)
    delta = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key, files=files,
                         base_files={f.name: f.hash for f in m0.files})
    assert delta.manifest.format_version == 3 and [f.piece is not None for f in delta.manifest.files] == [True]
    assert apply_to_dir(path, [(delta.manifest, delta.pieces)]).version == 1
    assert (path / "config.json").read_bytes() == CONFIG and same_weights(read_weights(path), v1)
    # An xxh3-128 where format 3 wants BLAKE3: the manifest itself is refused as corrupt.
    with pytest.raises(CorruptError, match="bad hash"):
        dataclasses.replace(delta.manifest, files=(dataclasses.replace(delta.manifest.files[0], hash=digest(CONFIG)),))


def test_read_side_files_takes_what_hugging_face_writes_beside_the_weights(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    keep = {"config.json": CONFIG, "generation_config.json": GENERATION, "tokenizer.json": TOKENIZER,
            "tokenizer_config.json": b"{}", "special_tokens_map.json": b"{}", "vocab.json": b"{}",
            "merges.txt": b"#", "tokenizer.model": b"\x00sp", "chat_template.jinja": b"{{ x }}"}
    for name, data in keep.items():
        (d / name).write_bytes(data)
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "modeling_x.py",
                 ".hidden.json", "deltamesh-manifest.json", "README.md"):
        (d / name).write_bytes(b"no")
    (d / "sub.json").mkdir()
    (d / "huge.json").write_bytes(b" " * ((64 << 20) + 1))
    assert read_side_files(d) == keep
