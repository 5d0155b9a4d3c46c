"""Which kinds relays carry: deltas as they follow, a full only on demand or as their anchor.

With a full snapshot every 3 versions, a periodic-full version (delta + full at the origin) crosses
each relayed link as its delta alone while only followers (pools holding the previous version, a
downstream relay) are there. A fresh pool gets a full that its relay fetches on demand, over one
hop or two, and ends bit-exact; each link then carries that full once. The per-link byte counts
(`/metrics` and `/v1/models/{model}/traffic`) match the payloads exactly. Gateways run in this
process on real loopback sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import AsyncIterator

from deltamesh.delta import read_weights
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway.server.app import create_app
from deltamesh.gateway.server.relay_kinds import anchor_to_fetch, deltas_to_follow
from deltamesh.http import HttpError, client_session, request_bytes, request_json, serving
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "tiny"
PIECE = 4096


# -- the choice itself ------------------------------------------------------------------------------
def _d(v: int) -> PlanStep:
    return PlanStep(v, "delta", v - 1, 10, 1)


def _f(v: int) -> PlanStep:
    return PlanStep(v, "full", None, 1000, 1)


def test_a_relay_follows_deltas_and_fetches_a_full_only_when_it_could_not_follow_otherwise():
    upstream = [_f(0), *[_d(v) for v in range(1, 7)], _f(3), _f(6)]
    following = deltas_to_follow(upstream, keep_deltas=4)
    assert [s.version for s in following] == [3, 4, 5, 6]
    # No full here yet (a first sync): the newest full that chains to the head over the kept deltas.
    assert anchor_to_fetch(MODEL, [], following, upstream, keep_deltas=4) == _f(6)
    assert anchor_to_fetch(MODEL, [], following, upstream[:-1], keep_deltas=4) == _f(3)
    assert anchor_to_fetch(MODEL, [], following[-2:], upstream[:-1], keep_deltas=2) is None  # none chains
    # Holding v0's full: the periodic fulls of v3 and v6 are not fetched, not even once retention
    # has dropped the deltas that led from v0 to the head.
    local = [_f(0), *[_d(v) for v in range(3, 7)]]
    assert anchor_to_fetch(MODEL, local, following, upstream, keep_deltas=4) is None
    # A full on its way (held, pieces still arriving) is an anchor too.
    assert anchor_to_fetch(MODEL, [_f(3)], following, upstream, keep_deltas=4) is None
    # A version published as a full alone (a restarted trainer): no delta leads there, so fetch it.
    restarted = [*upstream, _f(7)]
    assert anchor_to_fetch(MODEL, local, following, restarted, keep_deltas=4) == _f(7)
    assert anchor_to_fetch(MODEL, [*local, _f(7)], following, restarted, keep_deltas=4) is None


# -- real gateways ------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def chain(kit, tmp_path: Path, names: tuple[str, ...], **kw) -> AsyncIterator[dict[str, str]]:
    """Gateways in this process, each relaying from the one before: origin -> A -> B."""
    urls: dict[str, str] = {}
    async with contextlib.AsyncExitStack() as stack:
        for i, name in enumerate(names):
            port = kit.free_port()
            url = f"http://127.0.0.1:{port}"
            config = kit.config(tmp_path / name, region=name, listen=f"127.0.0.1:{port}", advertise=url,
                                upstreams=[urls[names[i - 1]]] if i else [], stall_timeout_s=3.0,
                                piece_wait_s=1.5, **kw)
            await stack.enter_async_context(serving(create_app(config), config.listen))
            urls[name] = url
        yield urls


def _pool(kit, tmp_path: Path, name: str, gateway: str) -> PoolSyncConfig:
    return PoolSyncConfig(gateways=[gateway], token="region-token-1", name=name, dir=str(tmp_path / "pools" / name),
                          trusted_keys=[str(kit.key.public)], model=MODEL, stall_timeout_s=3.0, give_up_s=20.0)


async def _held(s, url: str) -> dict[tuple[int, str], dict]:
    try:
        listing = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/versions")
    except HttpError as e:
        if e.status == 404:  # the model is not there yet
            return {}
        raise
    return {(v["version"], v["kind"]): v for v in listing["versions"]}


async def _received(s, url: str, version: int) -> dict[str, int]:
    """kind -> bytes this gateway received from upstream for `version`."""
    answer = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/traffic")
    out: dict[str, int] = {}
    for v in answer["versions"]:
        if v["version"] == version:
            for r in v["received"]:
                out[r["kind"]] = out.get(r["kind"], 0) + r["bytes"]
    return out


async def _metric(s, url: str, name: str, **labels: str) -> float:
    text = (await request_bytes(s, "GET", f"{url}/metrics")).decode()
    total = 0.0
    for line in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line[1])
    return total


async def _eventually(check, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_periodic_fulls_cross_relays_only_when_a_pool_needs_them(kit, tmp_path):
    async def main() -> None:
        async with chain(kit, tmp_path, ("origin", "A", "B")) as u, client_session() as s:
            origin, a, b = u["origin"], u["A"], u["B"]
            pub = Publisher(origin, kit.key.key, MODEL, full_every=3, piece_bytes=PIECE)
            w = [kit.tiny_weights()]
            for v in range(1, 7):
                w.append(kit.next_step(w[-1], v))
            payload: dict[tuple[int, str], int] = {}

            async def publish(v: int) -> None:
                result = await pub.publish(w[v])
                payload.update({(m.version, m.kind): m.payload_bytes for m in result.manifests})

            await publish(0)
            async with WeightSync(_pool(kit, tmp_path, "pa", a)) as pa, WeightSync(_pool(kit, tmp_path, "pb", b)) as pb:
                for sync in (pa, pb):
                    await sync.register()

                async def follow_to(version: int) -> None:
                    for sync in (pa, pb):
                        while sync.version != version:
                            await sync.sync_once(wait_s=10)
                        assert kit.same_bits(read_weights(sync.config.dir), w[version]), sync.config.name

                await follow_to(0)
                for v in (1, 2, 3):
                    await publish(v)
                    await follow_to(v)
                assert (3, "full") in payload and (3, "delta") in payload

                # (a, c) Only followers downstream: v3 crosses both relayed links as its delta alone.
                for url in (a, b):
                    await _eventually(lambda url=url: _complete(s, url, (3, "delta")), 10, "v3's delta")
                await asyncio.sleep(1.0)  # time for any pass that (wrongly) wanted the full to start it
                for url in (a, b):
                    assert (3, "full") not in await _held(s, url)
                    assert await _received(s, url, 3) == {"delta": payload[(3, "delta")]}
                assert (0, "full") in await _held(s, b)  # the anchor for first pulls, from v0

                # (b) A fresh pool at A: a full route, whose full A fetches on demand and serves.
                async with WeightSync(_pool(kit, tmp_path, "fresh-a", a)) as fresh:
                    plan = await fresh.fetch_plan()
                    assert plan.reason == "full: first pull" and [(x.version, x.kind) for x in plan.steps] == [(3, "full")]
                    await fresh.persist(await fresh.fetch_decoded(plan))
                    assert kit.same_bits(read_weights(fresh.config.dir), w[3])
                assert await _received(s, a, 3) == {"delta": payload[(3, "delta")], "full": payload[(3, "full")]}
                assert (3, "full") not in await _held(s, b)
                assert await _metric(s, a, "deltamesh_gateway_relay_fetches_total", kind="full", why="demand") == 1

                # (c) Two hops: v6 is delta + full at the origin; neither relay carries the full...
                for v in (4, 5, 6):
                    await publish(v)
                    await follow_to(v)
                for url in (a, b):
                    await _eventually(lambda url=url: _complete(s, url, (6, "delta")), 10, "v6's delta")
                await asyncio.sleep(1.0)
                for url in (a, b):
                    assert (6, "full") not in await _held(s, url)
                    assert await _received(s, url, 6) == {"delta": payload[(6, "delta")]}
                # ... until a fresh pool at B needs it: B asks A, which asks the origin, cut-through.
                async with WeightSync(_pool(kit, tmp_path, "fresh-b", b)) as fresh:
                    plan = await fresh.fetch_plan()
                    assert [(x.version, x.kind) for x in plan.steps] == [(6, "full")]
                    await fresh.persist(await fresh.fetch_decoded(plan))
                    assert kit.same_bits(read_weights(fresh.config.dir), w[6])
                for url in (a, b):
                    assert await _received(s, url, 6) == {"delta": payload[(6, "delta")], "full": payload[(6, "full")]}

                # (d) The counters: every relayed byte once, by kind and upstream; served by peer.
                deltas = sum(n for (v, kind), n in payload.items() if kind == "delta")
                for url, upstream, fulls in ((a, origin, [0, 3, 6]), (b, a, [0, 6])):
                    name = "deltamesh_gateway_upstream_bytes_total"
                    assert await _metric(s, url, name, model=MODEL, kind="delta", upstream=upstream) == deltas
                    assert await _metric(s, url, name, model=MODEL, kind="full", upstream=upstream) == \
                        sum(payload[(v, "full")] for v in fulls)
                    assert await _metric(s, url, "deltamesh_gateway_relay_fetches_total", kind="full", why="anchor") == 1
                served = "deltamesh_gateway_served_bytes_total"
                assert await _metric(s, a, served, model=MODEL, kind="delta", role="downstream", peer="B") == deltas
                assert await _metric(s, a, served, model=MODEL, kind="full", role="downstream", peer="B") == \
                    payload[(0, "full")] + payload[(6, "full")]
                assert await _metric(s, a, served, model=MODEL, kind="delta", role="pool", peer="pa") == deltas
                assert await _metric(s, b, served, model=MODEL, kind="full", role="pool", peer="pb") == payload[(0, "full")]
                # The fresh pools did not register: their bytes count, under no name.
                assert await _metric(s, b, served, model=MODEL, kind="full", role="pool", peer="") == payload[(6, "full")]
                traffic = await request_json(s, "GET", f"{a}/v1/models/{MODEL}/traffic")
                v6 = next(v for v in traffic["versions"] if v["version"] == 6)
                assert v6["received_bytes"] == payload[(6, "delta")] + payload[(6, "full")]
                assert {(x["kind"], x["role"], x["peer"]): x["bytes"] for x in v6["served"]} == {
                    ("delta", "downstream", "B"): payload[(6, "delta")], ("delta", "pool", "pa"): payload[(6, "delta")],
                    ("full", "downstream", "B"): payload[(6, "full")]}

    asyncio.run(main())


async def _complete(s, url: str, key: tuple[int, str]) -> bool:
    entry = (await _held(s, url)).get(key)
    return entry is not None and entry["complete"]


def test_a_relay_keeps_its_anchor_and_takes_a_full_alone_version(kit, tmp_path):
    """keep_deltas=3 and a full every 3 versions: the relay takes v0's full (its first sync) and then
    deltas only, also once retention has dropped the deltas that led from v0 to the head. A version
    published as a full alone (a restarted trainer) cannot be followed by a delta: that full it takes."""
    async def main() -> None:
        async with chain(kit, tmp_path, ("origin", "A"), keep_deltas=3, keep_fulls=1) as u, \
                client_session() as s:
            origin, a = u["origin"], u["A"]
            fetches = "deltamesh_gateway_relay_fetches_total"

            async def publish(v: int, *kinds: str) -> None:
                for kind in kinds:
                    m, raw, pieces = kit.version(MODEL, v, kind)
                    await upload_version(s, origin, m, raw, pieces)
                await _eventually(lambda: _complete(s, a, (v, kinds[0])), 10, f"A to hold v{v}")
                await asyncio.sleep(0.5)  # time for any pass that wants a full to start it

            await publish(0, "full")
            for v in range(1, 8):
                await publish(v, *(("delta", "full") if v % 3 == 0 else ("delta",)))
            held = await _held(s, a)
            assert sorted(held) == [(0, "full"), (5, "delta"), (6, "delta"), (7, "delta")]
            assert await _metric(s, a, fetches, kind="full", why="anchor") == 1
            assert await _metric(s, a, fetches, kind="delta", why="follow") == 7
            await publish(8, "full")
            assert sorted(k for k in await _held(s, a) if k[1] == "full") == [(8, "full")]
            assert await _metric(s, a, fetches, kind="full", why="anchor") == 2
            # A first pull is planned over what A holds and what the origin can serve it.
            plan = await request_json(s, "GET", f"{a}/v1/models/{MODEL}/plan")
            assert [(x["version"], x["kind"]) for x in plan["steps"]] == [(8, "full")]

    asyncio.run(main())
