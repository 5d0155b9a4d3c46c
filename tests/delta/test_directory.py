"""Safetensors directories: sharded read/write, atomic apply of snapshots and delta chains, crash
safety (a real subprocess SIGKILLed mid-apply leaves exactly the old or the new version), and the
weights a writer holds in memory between applies."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltamesh.delta import (
    BaseMismatchError,
    CodecError,
    CorruptError,
    HeldWeights,
    apply_to_dir,
    decode_version,
    dir_manifest,
    encode_delta,
    encode_full,
    read_weights,
    save_keypair,
    weights_hash,
    write_weights,
)

WORKER = Path(__file__).with_name("apply_worker.py")


def _model(seed: int, tensors: int = 6, numel: int = 1 << 19) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {f"layers.{k}.weight": (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16).view(512, -1) for k in range(tensors)}
    w["norm.weight"] = torch.ones(512, dtype=torch.float32)
    return w


def _next(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in weights.items():
        t = t.clone()
        flat = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
        chosen = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[chosen] += 1
        new[name] = t
    return new


def test_sharded_write_and_read_like_transformers(tmp_path, same_weights):
    w = _model(0)
    write_weights(tmp_path, w, max_shard_bytes=2 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in w.values())
    for file in files:  # each shard is a plain safetensors file
        with safe_open(tmp_path / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == file and torch.equal(f.get_tensor(name), w[name])
    assert same_weights(read_weights(tmp_path), w)
    single = tmp_path / "single"
    write_weights(single, w)
    assert [p.name for p in single.iterdir()] == ["model.safetensors"]
    assert same_weights(read_weights(single), w)


def test_unreadable_directories(tmp_path):
    with pytest.raises(CodecError, match="no safetensors"):
        read_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CorruptError):
        read_weights(tmp_path)


def test_full_then_delta_chain_keeps_layout_and_cleans_up(tmp_path, key, same_weights):
    v1 = _model(1)
    v2, v3, v4 = _next(v1, 2), None, None
    v3 = _next(v2, 3)
    v4 = _next(v3, 4)
    plain = tmp_path / "model"
    write_weights(plain, v1, max_shard_bytes=2 << 20)  # a transformers-style directory to start from
    layout = json.loads((plain / "model.safetensors.index.json").read_text())["weight_map"]
    d12 = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key, piece_bytes=4096)
    assert apply_to_dir(plain, [(d12.manifest, d12.pieces)]).version == 2  # base check by hashing
    assert plain.is_symlink() and dir_manifest(plain).version == 2
    assert same_weights(read_weights(plain), v2)
    d23 = encode_delta(v2, v3, model_id="m", version=3, base_version=2, key=key)
    d34 = encode_delta(v3, v4, model_id="m", version=4, base_version=3, key=key)
    final = apply_to_dir(plain, [(d23.manifest, d23.pieces), (d34.manifest, d34.pieces)])
    assert final.version == 4 and dir_manifest(plain).weights_hash == weights_hash(v4)
    assert same_weights(read_weights(plain), v4)
    assert json.loads((plain / "model.safetensors.index.json").read_text())["weight_map"] == layout
    versions = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".model.v"))
    assert len(versions) == 2  # the current one and the one before, for readers still on it
    full = encode_full(v1, model_id="m", version=5, key=key)
    apply_to_dir(plain, [(full.manifest, full.pieces)])
    assert same_weights(read_weights(plain), v1) and dir_manifest(plain).version == 5


def test_wrong_base_leaves_directory_untouched(tmp_path, key, same_weights):
    v1, target = _model(5, tensors=2), tmp_path / "w"
    v2 = _next(v1, 6)
    v3 = _next(v2, 7)
    d23 = encode_delta(v2, v3, model_id="m", version=3, base_version=2, key=key)
    with pytest.raises(BaseMismatchError, match="holds no weights"):
        apply_to_dir(target, [(d23.manifest, d23.pieces)])
    full = encode_full(v1, model_id="m", version=1, key=key)
    apply_to_dir(target, [(full.manifest, full.pieces)])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(BaseMismatchError):
        apply_to_dir(target, [(d23.manifest, d23.pieces)])
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert same_weights(read_weights(target), v1) and dir_manifest(target).version == 1
    assert apply_to_dir(target, []).version == 1


def test_decoded_versions_are_only_read(tmp_path, key, same_weights):
    """A full snapshot then two deltas, decoded once, persisted to two directories: each gets the right
    weights and the decoded versions (whose full tensors the chain builds on) are left as decoded."""
    v1 = _model(20, tensors=3)
    v2 = _next(v1, 21)
    v3 = _next(v2, 22)
    full = encode_full(v1, model_id="m", version=1, key=key)
    d12 = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key)
    d23 = encode_delta(v2, v3, model_id="m", version=3, base_version=2, key=key)
    decoded = [decode_version(e.manifest, e.pieces) for e in (full, d12, d23)]
    for target in (tmp_path / "a", tmp_path / "b"):
        assert apply_to_dir(target, decoded).version == 3
        assert same_weights(read_weights(target), v3)
        whole = {full.manifest.tensors[i].name: t for i, t in decoded[0].whole.items()}
        assert same_weights(whole, v1)
    assert apply_to_dir(tmp_path / "a", decoded[:0]).version == 3


@pytest.fixture
def worker_setup(tmp_path, key):
    """A 6-tensor bf16 model in 3+ shards at v1 under tmp/model, and the steps the worker loops."""
    v1 = _model(10)
    v2 = _next(v1, 11)
    target, steps = tmp_path / "model", tmp_path / "steps"
    steps.mkdir()
    write_weights(target, v1, max_shard_bytes=2 << 20)
    to_v1 = encode_full(v1, model_id="m", version=1, key=key, piece_bytes=1 << 20)
    apply_to_dir(target, [(to_v1.manifest, to_v1.pieces)])
    to_v2 = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key, piece_bytes=1 << 16)
    for name, enc in (("to_v1", to_v1), ("to_v2", to_v2)):
        (steps / f"{name}.manifest").write_bytes(enc.manifest_bytes)
        for i, piece in enumerate(enc.pieces):
            (steps / f"{name}.{i}.piece").write_bytes(piece)
    save_keypair(key, tmp_path / "key")
    return target, steps, tmp_path / "key.pub", {1: v1, 2: v2}


def _start_worker(target, steps, public):
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(target), str(steps), str(public)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"worker did not start: {line!r} {proc.stderr.read()}")
    return proc


@pytest.mark.slow
def test_sigkill_mid_apply_leaves_old_or_new_version(worker_setup, key, same_weights):
    target, steps, public, versions = worker_setup
    rng = random.Random(1234)
    seen_versions, reads = set(), 0
    for attempt in range(4):
        proc = _start_worker(target, steps, public)
        try:
            # Read concurrently while the worker swaps versions: every read is one whole version.
            deadline = time.monotonic() + rng.uniform(0.05, 0.8)
            while time.monotonic() < deadline:
                try:
                    w = read_weights(target)
                except CodecError:
                    continue  # a version directory removed under a slow reader: an error, never a mix
                assert same_weights(w, versions[1]) or same_weights(w, versions[2])
                reads += 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        manifest = dir_manifest(target)
        weights = read_weights(target)
        assert same_weights(weights, versions[manifest.version]), f"attempt {attempt}: directory is not v{manifest.version}"
        seen_versions.add(manifest.version)
    assert reads > 0
    # Whatever killed appliers left behind is cleared by the next apply, which still works.
    full = encode_full(versions[1], model_id="m", version=1, key=key)
    apply_to_dir(target, [(full.manifest, full.pieces)])
    names = [p.name for p in target.parent.iterdir()]
    assert not [n for n in names if ".partial-" in n or ".link-" in n]
    assert len([n for n in names if n.startswith(".model.v")]) <= 2
    assert same_weights(read_weights(target), versions[1])


def test_a_reader_of_a_version_being_removed_gets_all_of_it_or_an_error(tmp_path, key, same_weights, monkeypatch):
    """A reader still on a version's directory while an apply removes it (a reader slower than two
    applies) must never get part of it: the removal is stopped midway (index and first shard gone,
    the other shards still there) and the reader reads then, from the path it had resolved: it gets
    the whole version or an error, never a few of its shards."""
    import deltamesh.delta.directory as directory

    v1 = _model(30, tensors=4)
    v2, v3 = _next(v1, 31), _next(_next(v1, 31), 32)
    target = tmp_path / "model"
    write_weights(target, v1, max_shard_bytes=2 << 20)  # a plain sharded directory to start from
    full = encode_full(v1, model_id="m", version=1, key=key)
    apply_to_dir(target, [(full.manifest, full.pieces)])
    read_path = target.resolve()  # where a slow reader is
    assert len(list(read_path.glob("*.safetensors"))) >= 3
    reads = []
    real_rmtree = directory.shutil.rmtree

    def rmtree_read_midway(path, *args, **kwargs):
        path = Path(path)
        doomed = sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors"))[:1]
        for file in doomed:
            file.unlink()
        try:
            reads.append(read_weights(read_path))
        except CodecError as e:
            reads.append(e)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(directory.shutil, "rmtree", rmtree_read_midway)
    for version, (old, new) in ((2, (v1, v2)), (3, (v2, v3))):
        d = encode_delta(old, new, model_id="m", version=version, base_version=version - 1, key=key)
        apply_to_dir(target, [(d.manifest, d.pieces)])
    assert len(reads) == 2, "the plain directory (at v2's apply) and v1's (at v3's) were to be removed"
    for got in reads:
        assert isinstance(got, CodecError) or same_weights(got, v1), f"a reader got part of a version: {sorted(got)}"
    # v1's directory went aside whole before its files went: that reader fails whole, and
    # read_weights, given the symlink, starts over on the current version.
    assert isinstance(reads[1], CodecError)
    assert same_weights(read_weights(target), v3)


def test_migration_killed_between_its_renames_is_recovered(tmp_path, key, same_weights):
    """A plain directory is moved aside before the symlink takes its place; a kill in between
    leaves no path at all, and the next apply puts the original back before going on."""
    v1 = _model(20, tensors=2)
    v2 = _next(v1, 21)
    target = tmp_path / "model"
    write_weights(tmp_path / ".model.v-original-dead", v1)  # what the killed apply left behind
    delta = encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=key)
    assert apply_to_dir(target, [(delta.manifest, delta.pieces)]).version == 2
    assert same_weights(read_weights(target), v2)


def test_side_files_travel_with_every_version(tmp_path):
    """config.json and tokenizer files stay beside the weights, so the path remains a loadable model dir."""
    import torch

    from deltamesh.delta import apply_to_dir, encode_delta, encode_full, generate_key, read_weights

    key = generate_key()
    v0 = {"w": torch.arange(64, dtype=torch.float32).to(torch.bfloat16)}
    v1 = {"w": v0["w"].clone()}
    v1["w"][3] = 7.5
    path = tmp_path / "model"
    full = encode_full(v0, model_id="m", version=0, key=key)
    apply_to_dir(path, [(full.manifest, full.pieces)])
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    delta = encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=key)
    apply_to_dir(path, [(delta.manifest, delta.pieces)])
    assert (path / "config.json").read_text() == '{"model_type": "llama"}'
    assert (path / "tokenizer.json").exists()
    assert torch.equal(read_weights(path)["w"].view(torch.int16), v1["w"].view(torch.int16))


# -- weights held in memory between applies by the directory's one writer (`HeldWeights`, as a
# `deltamesh pool sync` agent keeps them) -------------------------------------------------------------
def _versions(key, seed: int, count: int):
    """Weights v1..v`count` and their encodings: a full snapshot of v1, then a delta per version."""
    weights = [_model(seed, tensors=3)]
    for k in range(1, count):
        weights.append(_next(weights[-1], seed + k))
    encoded = [encode_full(weights[0], model_id="m", version=1, key=key)]
    encoded += [encode_delta(weights[k - 1], weights[k], model_id="m", version=k + 1, base_version=k, key=key)
                for k in range(1, count)]
    return weights, encoded


def _damage(directory) -> None:
    """Overwrite every weights file of the version `directory` holds with zeros of the same size."""
    for file in directory.resolve().glob("*.safetensors"):
        file.write_bytes(bytes(file.stat().st_size))


def test_the_next_delta_patches_the_held_weights_not_the_files(tmp_path, key, same_weights):
    weights, encoded = _versions(key, 40, 4)
    decoded = [decode_version(e.manifest, e.pieces) for e in encoded]
    target, held = tmp_path / "w", HeldWeights()
    apply_to_dir(target, decoded[:2], held=held)
    # The files are damaged behind the writer's back: only weights held in memory can give v3 and v4
    # (each apply checks its result against the signed manifest; patched from these files, it fails).
    _damage(target)
    assert apply_to_dir(target, [decoded[2]], held=held).version == 3
    assert apply_to_dir(target, [(encoded[3].manifest, encoded[3].pieces)], held=held).version == 4
    assert same_weights(read_weights(target), weights[3]) and dir_manifest(target).version == 4
    # The full snapshot's tensors, which the chain started from, are left as decoded.
    whole = {encoded[0].manifest.tensors[i].name: t for i, t in decoded[0].whole.items()}
    assert same_weights(whole, weights[0])


def test_without_held_weights_the_damaged_files_are_refused(tmp_path, key):
    """The converse of the test above: the same damage, read from the files, fails the apply."""
    _, encoded = _versions(key, 40, 3)
    target = tmp_path / "w"
    apply_to_dir(target, [(e.manifest, e.pieces) for e in encoded[:2]])
    _damage(target)
    with pytest.raises(CodecError):
        apply_to_dir(target, [(encoded[2].manifest, encoded[2].pieces)])
    assert dir_manifest(target).version == 2


def test_a_failed_apply_drops_the_held_weights(tmp_path, key, same_weights):
    weights, encoded = _versions(key, 50, 3)
    target, held = tmp_path / "w", HeldWeights()
    apply_to_dir(target, [(encoded[0].manifest, encoded[0].pieces)], held=held)
    with pytest.raises(BaseMismatchError):  # v3's delta does not apply to v1
        apply_to_dir(target, [(encoded[2].manifest, encoded[2].pieces)], held=held)
    assert held.take(target.resolve()) is None
    assert dir_manifest(target).version == 1
    # The next apply reads the directory again.
    assert apply_to_dir(target, [(e.manifest, e.pieces) for e in encoded[1:]], held=held).version == 3
    assert same_weights(read_weights(target), weights[2])


def test_weights_held_for_a_version_the_directory_left_are_not_used(tmp_path, key, same_weights):
    """Another writer moved the directory on (v2 -> v3) since these weights were held (v2): the next
    apply (v3 -> v4) reads the directory, where the held v2 would fail its result check."""
    weights, encoded = _versions(key, 60, 4)
    target, held = tmp_path / "w", HeldWeights()
    apply_to_dir(target, [(e.manifest, e.pieces) for e in encoded[:2]], held=held)
    apply_to_dir(target, [(encoded[2].manifest, encoded[2].pieces)])  # another writer, holding nothing
    assert apply_to_dir(target, [(encoded[3].manifest, encoded[3].pieces)], held=held).version == 4
    assert same_weights(read_weights(target), weights[3])


def test_decoded_tensors_are_held_uncopied_only_when_adopted(tmp_path, key):
    """Tensors a full snapshot wrote whole belong to its DecodedVersion, which a caller may have given an
    engine too: held as copies, unless the writer says its decoded versions are the directory's alone."""
    _, encoded = _versions(key, 70, 1)
    for adopt in (False, True):
        decoded = decode_version(encoded[0].manifest, encoded[0].pieces)
        target, held = tmp_path / f"w-{adopt}", HeldWeights(adopt=adopt)
        apply_to_dir(target, [decoded], held=held)
        kept = held.take(target.resolve())
        whole = {encoded[0].manifest.tensors[i].name: t for i, t in decoded.whole.items()}
        assert kept is not None and kept.keys() == whole.keys()
        assert all((kept[n] is whole[n]) == adopt for n in whole), adopt
