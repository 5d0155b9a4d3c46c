"""The version store on real files (restart, corruption, retention with leases) and the transfer planner."""

from __future__ import annotations

import asyncio
import time

import pytest

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.keys import generate_key
from deltamesh.gateway.plan import NoPlanError, PlanStep, make_plan
from deltamesh.gateway.server.ledger import ConflictError
from deltamesh.gateway.server.store import VersionStore

MODEL = "m"


async def _put(store: VersionStore, kit, version: int, kind: str, **kw):
    m, raw, pieces = kit.version(MODEL, version, kind, **kw)
    entry, _ = await store.put_manifest(raw)
    for i, p in enumerate(pieces):
        await store.put_piece(entry, i, p)
    return entry, pieces


def _damage(path, offset: int):
    """Flip one bit of a stored piece file, as a failing disk would."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def test_store_survives_restart_and_drops_temp_files(kit, tmp_path):
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        full, full_pieces = await _put(store, kit, 0, "full")
        m1, raw1, p1 = kit.version(MODEL, 1, "delta")
        half, _ = await store.put_manifest(raw1)
        await store.put_piece(half, 0, p1[0])
        (half.path / "pieces" / ".2.123.tmp").write_bytes(b"half-written")

        again = VersionStore(tmp_path, [kit.key.key.public_key()])
        assert again.load() == 2
        assert again.head(MODEL) == 1
        e0 = again.get(MODEL, 0, "full")
        assert e0.complete and [await again.read_piece(e0, i) for i in range(3)] == full_pieces
        e1 = again.get(MODEL, 1, "delta")
        assert e1.present == {0} and e1.missing == [1, 2]
        assert not (half.path / "pieces" / ".2.123.tmp").exists()
        # A store that no longer trusts the key ignores what that key signed.
        stranger = VersionStore(tmp_path, [generate_key().public_key()])
        assert stranger.load() == 0

    asyncio.run(main())


def test_store_refuses_bad_input(kit, tmp_path):
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        m, raw, pieces = kit.version(MODEL, 1, "full")
        with pytest.raises(SignatureError):
            await store.put_manifest(m.signed(generate_key()))
        entry, new = await store.put_manifest(raw)
        assert new and (await store.put_manifest(raw))[1] is False
        other, other_raw, _ = kit.version(MODEL, 1, "full", seed=9)
        with pytest.raises(ConflictError):
            await store.put_manifest(other_raw)
        with pytest.raises(CorruptError):
            await store.put_piece(entry, 0, pieces[1])
        assert entry.present == set()

    asyncio.run(main())


def test_corrupted_piece_on_disk_is_detected_and_dropped(kit, tmp_path):
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        reported = []
        store.on_piece_corrupt.append(lambda e, i: reported.append((e.version, i)))
        entry, pieces = await _put(store, kit, 0, "full")
        path = _damage(entry.piece_path(1), 17)
        with pytest.raises(CorruptError, match="damaged on disk"):
            await store.read_piece(entry, 1)
        assert reported == [(0, 1)] and 1 not in entry.present and not path.exists()
        assert await store.read_piece(entry, 0) == pieces[0]

    asyncio.run(main())


def test_a_piece_read_back_is_checked_against_the_signed_digest_once_then_against_its_own(kit, tmp_path, monkeypatch):
    """Reading a piece back from disk checks it against the manifest's BLAKE3 digest only when the
    store has not verified those bytes itself (the first read after a restart); from then on against
    the xxh3 it recorded, which still catches a piece damaged on disk."""
    from deltamesh.delta.manifest import Manifest

    signed_checks = []
    check_piece = Manifest.check_piece

    def counted(self, index, data):
        signed_checks.append(index)
        return check_piece(self, index, data)

    monkeypatch.setattr(Manifest, "check_piece", counted)

    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        entry, pieces = await _put(store, kit, 0, "full")
        assert signed_checks == [0, 1, 2]  # as each piece was stored
        assert [await store.read_piece(entry, i) for i in range(3)] == pieces
        assert signed_checks == [0, 1, 2]

        again = VersionStore(tmp_path, [kit.key.key.public_key()])
        again.load()
        e0 = again.get(MODEL, 0, "full")
        assert [await again.read_piece(e0, 0) for _ in range(3)] == [pieces[0]] * 3
        assert signed_checks == [0, 1, 2, 0]
        path = _damage(e0.piece_path(0), 5)
        with pytest.raises(CorruptError, match="damaged on disk"):
            await again.read_piece(e0, 0)
        assert 0 not in e0.present and not path.exists() and signed_checks == [0, 1, 2, 0]

    asyncio.run(main())


def test_retention_keeps_newest_and_never_collects_what_is_in_use(kit, tmp_path):
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        entries = {}
        for v in range(8):
            entries[(v, "delta")] = (await _put(store, kit, v, "delta"))[0] if v else None
            if v % 3 == 0:
                entries[(v, "full")] = (await _put(store, kit, v, "full"))[0]
        store.lease([entries[(2, "delta")]], 60)
        with store.using(entries[(3, "full")]):
            removed = store.collect(keep_deltas=3, keep_fulls=1)
        assert sorted((e.version, e.kind) for e in removed) == [(0, "full"), (1, "delta"), (3, "delta"), (4, "delta")]
        kept = sorted((e.version, e.kind) for e in store.entries(MODEL))
        assert kept == [(2, "delta"), (3, "full"), (5, "delta"), (6, "delta"), (6, "full"), (7, "delta")]
        assert not (tmp_path / "models" / MODEL / "4").exists()
        # Once nobody uses them, they go too.
        entries[(2, "delta")].lease_until = 0
        removed = store.collect(keep_deltas=3, keep_fulls=1)
        assert sorted((e.version, e.kind) for e in removed) == [(2, "delta"), (3, "full")]

    asyncio.run(main())


def test_retention_keeps_the_newest_complete_full_while_a_newer_one_arrives(kit, tmp_path):
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        await _put(store, kit, 0, "full")
        _, raw, pieces = kit.version(MODEL, 3, "full")
        arriving, _ = await store.put_manifest(raw)
        assert store.collect(keep_deltas=3, keep_fulls=1) == []
        for i, p in enumerate(pieces):
            await store.put_piece(arriving, i, p)
        assert [(e.version, e.kind) for e in store.collect(keep_deltas=3, keep_fulls=1)] == [(0, "full")]

    asyncio.run(main())


def _manifests(kit, spec):
    """spec: [(version, kind, pieces)] -> plan steps of signed manifests (payload: 1000 bytes per piece)."""
    return [PlanStep.of(kit.version(MODEL, v, k, pieces=n)[0]) for v, k, n in spec]


def test_plan_picks_the_cheapest_route(kit):
    ms = _manifests(kit, [(0, "full", 8), *[(v, "delta", 1) for v in range(1, 13)], (10, "full", 8)])
    p = make_plan(MODEL, ms, None, 12)
    assert p.reason == "full: first pull" and [(s.version, s.kind) for s in p.steps] == [(10, "full"), (11, "delta"), (12, "delta")]
    p = make_plan(MODEL, ms, 8, 12)
    assert p.reason == "delta chain" and [s.version for s in p.steps] == [9, 10, 11, 12]
    assert p.payload_bytes == 4000
    assert make_plan(MODEL, ms, 12, 12).steps == ()
    # A chain longer (in bytes) than the full route loses to it.
    p = make_plan(MODEL, ms, 0, 12)
    assert p.reason == "full: smaller than the delta chain" and p.steps[0].version == 10
    # A broken chain (delta 11 missing) forces the full route.
    broken = [m for m in ms if not (m.version == 11 and m.kind == "delta")]
    with pytest.raises(NoPlanError):
        make_plan(MODEL, broken, 8, 12)
    p = make_plan(MODEL, broken, 8, 10)
    assert [s.version for s in p.steps] == [9, 10]
    # Periodic full sync: 7 deltas since the last full plus 3 more reaches full_every=10.
    p = make_plan(MODEL, ms, 9, 12, since_full=7, full_every=10)
    assert p.reason == "full: periodic full sync" and p.is_full
    p = make_plan(MODEL, ms, 9, 12, since_full=2, full_every=10)
    assert p.reason == "delta chain"
    # To a version before the newest full: the older full plus its deltas.
    p = make_plan(MODEL, ms, None, 3)
    assert [(s.version, s.kind) for s in p.steps] == [(0, "full"), (1, "delta"), (2, "delta"), (3, "delta")]


def test_store_notes_when_a_version_became_whole(kit, tmp_path):
    """`stored_at` (in the listing's entries): the wall time of the last piece, none while one is missing;
    after a restart, the time the newest piece was written."""
    async def main():
        store = VersionStore(tmp_path, [kit.key.key.public_key()])
        store.load()
        m, raw, pieces = kit.version(MODEL, 1, "delta")
        entry, _ = await store.put_manifest(raw)
        for i, p in enumerate(pieces[:-1]):
            await store.put_piece(entry, i, p)
        assert entry.stored_at is None and entry.describe()["stored_at"] is None
        before = time.time()
        await store.put_piece(entry, len(pieces) - 1, pieces[-1])
        assert before <= entry.stored_at <= time.time()
        assert entry.describe()["stored_at"] == entry.stored_at
        _, raw2, pieces2 = kit.version(MODEL, 2, "delta")
        half, _ = await store.put_manifest(raw2)
        await store.put_piece(half, 0, pieces2[0])

        again = VersionStore(tmp_path, [kit.key.key.public_key()])
        again.load()
        # File times come from the kernel's coarse clock: equal to the write's time within a tick.
        assert again.get(MODEL, 1, "delta").stored_at == pytest.approx(entry.stored_at, abs=0.5)
        assert again.get(MODEL, 2, "delta").stored_at is None

    asyncio.run(main())
