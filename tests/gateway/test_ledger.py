"""One weights hash per version at the origin, whatever the kind; no version below the head; no replay of an
old signed manifest, even after garbage collection or a restart. Each refusal is a 409 that stores,
announces and bumps nothing."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from deltamesh.gateway.server.app import GATEWAY_KEY, create_app
from deltamesh.gateway.server.ledger import ConflictError, ReplayError, RollbackError
from deltamesh.gateway.server.store import VersionStore
from deltamesh.http import client_session, serving
from deltamesh.tokens import TokenSpec, add_token

MODEL = "tiny-1"


async def put(s, url: str, raw: bytes, version: int, kind: str, token: str) -> tuple[int, dict]:
    async with s.put(f"{url}/v1/models/{MODEL}/versions/{version}/{kind}/manifest", data=raw,
                     headers={"Authorization": f"Bearer {token}"}) as resp:
        return resp.status, json.loads(await resp.read())


def snapshot(gw) -> tuple:
    return ([(e.version, e.kind) for e in gw.store.entries(MODEL)], gw.store.epoch, gw.store.head(MODEL),
            sorted(p.name for p in (gw.store.root / "models" / MODEL).iterdir()))


def store_at(kit, root) -> VersionStore:
    """The version store at `root`, trusting the kit's trainer key, as a gateway (re)starting opens it."""
    return VersionStore(root, [kit.key.key.public_key()])


def test_one_hash_per_version_no_rollback_no_replay_over_http(kit, tmp_path):
    tokens = tmp_path / "tokens.toml"
    trainer = add_token(tokens, TokenSpec("trainer-1", "trainer", [MODEL]))

    async def main():
        app = create_app(kit.config(tmp_path, tokens_file=str(tokens), keep_deltas=1, keep_fulls=1))
        gw = app[GATEWAY_KEY]
        async with serving(app, "127.0.0.1:0") as url, client_session(timeout_s=10) as s:
            published = {}
            for v, kind in [(1, "full"), (2, "delta"), (3, "delta"), (3, "full"), (4, "delta")]:
                _, raw, pieces = kit.version(MODEL, v, kind, pieces=1)
                status, _ = await put(s, url, raw, v, kind, trainer)
                assert status == 201, (v, kind)
                entry = gw.store.get(MODEL, v, kind)
                await gw.store.put_piece(entry, 0, pieces[0])
                published[(v, kind)] = raw
            # Publishing the very same manifest again is how an interrupted publish resumes: allowed.
            assert (await put(s, url, published[(4, "delta")], 4, "delta", trainer))[0] == 200

            gw.store.collect(keep_deltas=1, keep_fulls=1)
            assert [(e.version, e.kind) for e in gw.store.entries(MODEL)] == [(3, "full"), (4, "delta")]
            before = snapshot(gw)
            refusals = [
                # A full of v4 with other weights than v4's delta: mix-and-match.
                (kit.version(MODEL, 4, "full", seed=9)[1], 4, "full", "exactly one"),
                # A new delta under v4's number with other weights.
                (kit.version(MODEL, 4, "delta", seed=9)[1], 4, "delta", "other contents"),
                # Below the head: a rollback, with a manifest never seen before.
                (kit.version(MODEL, 2, "full")[1], 2, "full", "below the newest"),
                # The old signed manifests, replayed after garbage collection took them.
                (published[(2, "delta")], 2, "delta", "below the newest"),
                (published[(1, "full")], 1, "full", "below the newest"),
            ]
            for raw, v, kind, reason in refusals:
                status, body = await put(s, url, raw, v, kind, trainer)
                assert status == 409 and reason in body["error"], (v, kind, body)
                assert snapshot(gw) == before, (v, kind)
            # The same weights under the head's number, as another kind: accepted (a full after its delta).
            _, raw, _ = kit.version(MODEL, 4, "full")
            assert (await put(s, url, raw, 4, "full", trainer))[0] == 201
            assert gw.store.epoch == before[1] + 1

    asyncio.run(main())


def test_the_ledger_survives_restart_and_collection(kit, tmp_path):
    async def main():
        store = store_at(kit, tmp_path)
        store.load()
        raws = {}
        for v, kind in [(1, "full"), (2, "delta"), (3, "delta")]:
            _, raws[(v, kind)], _ = kit.version(MODEL, v, kind, pieces=1)
            await store.put_manifest(raws[(v, kind)], published=True)
        store.collect(keep_deltas=1, keep_fulls=1)  # v2's delta goes; the head and the only full stay
        assert store.get(MODEL, 2, "delta") is None

        again = store_at(kit, tmp_path)  # a restart
        assert again.load() == 2
        epoch = again.epoch
        with pytest.raises(RollbackError):
            await again.put_manifest(raws[(2, "delta")], published=True)
        with pytest.raises(ConflictError, match="exactly one"):
            await again.put_manifest(kit.version(MODEL, 3, "full", seed=5)[1], published=True)
        assert again.epoch == epoch and again.get(MODEL, 3, "full") is None

        # Even with the whole model's directory gone, the ledger remembers: no replay of the head.
        shutil.rmtree(tmp_path / "models" / MODEL)
        wiped = store_at(kit, tmp_path)
        assert wiped.load() == 0
        with pytest.raises(ReplayError):
            await wiped.put_manifest(raws[(3, "delta")], published=True)
        with pytest.raises(RollbackError):
            await wiped.put_manifest(raws[(1, "full")], published=True)
        assert wiped.head(MODEL) is None and wiped.epoch == 0
        # A relay mirrors older versions on demand: only the one-hash rule applies to it.
        relay = store_at(kit, tmp_path / "relay")
        relay.load()
        await relay.put_manifest(raws[(3, "delta")])
        entry, new = await relay.put_manifest(raws[(2, "delta")])
        assert new and entry.version == 2
        with pytest.raises(ConflictError):
            await relay.put_manifest(kit.version(MODEL, 2, "full", seed=5)[1])

    asyncio.run(main())


def test_a_torn_ledger_line_is_dropped(kit, tmp_path):
    async def main():
        store = store_at(kit, tmp_path)
        store.load()
        await store.put_manifest(kit.version(MODEL, 1, "full")[1], published=True)
        with open(tmp_path / "ledger.jsonl", "a") as f:
            f.write('{"model": "tiny-1", "vers')  # a crash in the middle of an append
        again = store_at(kit, tmp_path)
        again.load()
        assert (tmp_path / "ledger.jsonl").read_text().count("\n") == 1
        assert again.ledger.top(MODEL) == 1
        await again.put_manifest(kit.version(MODEL, 2, "delta")[1], published=True)
        assert [json.loads(line)["version"] for line in (tmp_path / "ledger.jsonl").read_text().splitlines()] == [1, 2]

    asyncio.run(main())
