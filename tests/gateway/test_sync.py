"""Publisher and pool weight sync through real gateways: plans, atomic apply, fallbacks, untrusted relays."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from deltamesh.delta import dir_manifest, read_weights
from deltamesh.http import request_json
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
PIECE = 4096


def _pool(kit, tmp_path: Path, name: str, gateways: list[str], **kw) -> PoolSyncConfig:
    kw.setdefault("stall_timeout_s", 3.0)
    kw.setdefault("give_up_s", 20.0)
    return PoolSyncConfig(gateways=gateways, token="region-token-1", name=name, dir=str(tmp_path / name),
                          trusted_keys=[str(kit.key.public)], model=MODEL, heartbeat_s=0.3, **kw)


def test_publish_then_sync_by_plans(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            pub = Publisher(url, kit.key.key, MODEL, full_every=3, piece_bytes=PIECE)
            w = [kit.tiny_weights()]
            for v in range(1, 5):
                w.append(kit.next_step(w[-1], v))
            first = await pub.publish(w[0])
            assert first.version == 0 and [m.kind for m in first.manifests] == ["full"]
            async with WeightSync(_pool(kit, tmp_path, "p1", [url])) as sync:
                assert await sync.sync_once() is True
                assert sync.version == 0 and kit.same_bits(read_weights(sync.config.dir), w[0])
                for v in (1, 2, 3):
                    r = await pub.publish(w[v])
                    assert [m.kind for m in r.manifests] == (["delta", "full"] if v == 3 else ["delta"])
                # Three versions behind: a chain of three deltas, not the full snapshot of v3.
                plan = await sync.fetch_plan()
                assert plan.reason == "delta chain" and [s.version for s in plan.steps] == [1, 2, 3]
                decoded = await sync.fetch_decoded(plan)
                assert [(d.version, d.kind) for d in decoded] == [(1, "delta"), (2, "delta"), (3, "delta")]
                assert sync.version == 0, "nothing is applied before persist"
                final = await sync.persist(decoded)
                assert final.version == 3 and sync.version == 3 and sync.since_full == 3
                assert kit.same_bits(read_weights(sync.config.dir), w[3])
                # Nothing newer: a sync with no wait returns at once without moving.
                assert await sync.sync_once() is False
                await pub.publish(w[4])
                assert await sync.sync_once(wait_s=5) is True and sync.version == 4
                assert dir_manifest(sync.config.dir).version == 4
                await sync.heartbeat()
                pools = (await request_json(sync._session, "GET", f"{url}/v1/pools"))["pools"]
                assert pools[0]["name"] == "p1" and pools[0]["version"] == 4 and pools[0]["versions_behind"] == 0

    asyncio.run(main())


def test_delta_for_other_weights_falls_back_to_full(kit, tmp_path):
    """A directory whose weights are not the delta's base (here: another lineage) takes a full snapshot."""
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "x")) as x, \
                kit.running_gateway(kit.config(tmp_path / "y")) as y:
            wx, wy = kit.tiny_weights(1), kit.tiny_weights(2)
            px, py = Publisher(x, kit.key.key, MODEL, piece_bytes=PIECE), Publisher(y, kit.key.key, MODEL, piece_bytes=PIECE)
            await px.publish(wx)
            await py.publish(wy)
            wy1 = kit.next_step(wy, 1)
            await py.publish(wy1)
            async with WeightSync(_pool(kit, tmp_path, "p", [x])) as sync:
                await sync.sync_once()
                assert kit.same_bits(read_weights(sync.config.dir), wx)
            async with WeightSync(_pool(kit, tmp_path, "p", [y])) as sync:
                assert sync.version == 0
                assert await sync.sync_once() is True
                assert sync.version == 1 and kit.same_bits(read_weights(sync.config.dir), wy1)

    asyncio.run(main())


async def _tampering_relay(real: str, log: list[str]) -> tuple[web.AppRunner, str]:
    """A relay that passes everything through from `real` but flips a byte in every piece it serves.

    It stands for a compromised or faulty relay: pools must never trust what a relay sends.
    """
    session = ClientSession()

    async def proxy(request: web.Request) -> web.Response:
        async with session.get(f"{real}{request.path_qs}") as r:
            body = bytearray(await r.read())
            status = r.status
        if "/pieces/" in request.path and status == 200 and body:
            body[len(body) // 2] ^= 0x40
            log.append(request.path)
        return web.Response(body=bytes(body), status=status, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    app.on_cleanup.append(lambda _app: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_pool_detects_a_tampering_relay_and_never_applies_its_bytes(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            w0 = kit.tiny_weights()
            await Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE).publish(w0)
            served: list[str] = []
            runner, evil = await _tampering_relay(url, served)
            try:
                async with WeightSync(_pool(kit, tmp_path, "p", [evil, url])) as sync:
                    assert await sync.sync_once() is True
                    assert kit.same_bits(read_weights(sync.config.dir), w0)
                    assert served  # the bad relay was asked first and its pieces were refused
                    assert sync.sources[0].bad_until > 0
            finally:
                await runner.cleanup()

    asyncio.run(main())


@pytest.mark.slow
def test_fifty_pools_pull_the_same_version_at_once(kit, spawn_gateway, tmp_path):
    gw = spawn_gateway("origin")

    async def main():
        w0 = kit.tiny_weights()
        w1 = kit.next_step(w0, 1)
        pub = Publisher(gw.url, kit.key.key, MODEL, piece_bytes=PIECE)
        await pub.publish(w0)
        syncs = [WeightSync(_pool(kit, tmp_path, f"p{i:02d}", [gw.url], connections=2)) for i in range(50)]
        for s in syncs:
            await s.__aenter__()
        try:
            # All wait on the head together; one publish releases all fifty at once.
            waits = [asyncio.create_task(s.sync_once(wait_s=0)) for s in syncs]
            assert all(await asyncio.gather(*waits))
            waits = [asyncio.create_task(s.sync_once(wait_s=30)) for s in syncs]
            await asyncio.sleep(0.5)
            await pub.publish(w1)
            assert all(await asyncio.gather(*waits))
            for s in syncs:
                assert s.version == 1 and kit.same_bits(read_weights(s.config.dir), w1)
        finally:
            for s in syncs:
                await s.__aexit__(None, None, None)

    asyncio.run(main())


def test_run_follows_the_head_heartbeats_and_stops_promptly(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE)
            w = kit.tiny_weights()
            await pub.publish(w)
            stop = asyncio.Event()

            async def reaches(sync: WeightSync, version: int) -> None:
                while sync.version != version:
                    assert sync.version is None or sync.version < version, "versions come in order"
                    await asyncio.sleep(0.02)

            async with WeightSync(_pool(kit, tmp_path, "runner", [url], poll_wait_s=30)) as sync:
                task = asyncio.create_task(sync.run(stop))
                await asyncio.wait_for(reaches(sync, 0), 10)
                for v in (1, 2):
                    w = kit.next_step(w, v)
                    await pub.publish(w)
                    await asyncio.wait_for(reaches(sync, v), 10)
                assert kit.same_bits(read_weights(sync.config.dir), w)
                await asyncio.sleep(0.5)
                pools = (await request_json(sync._session, "GET", f"{url}/v1/pools"))["pools"]
                assert [(p["name"], p["version"], p["state"]) for p in pools] == [("runner", 2, "idle")]
                # Stopping interrupts the long poll at once, not after its 30 s.
                stop.set()
                await asyncio.wait_for(task, 3)

    asyncio.run(main())
