"""Signed manifests inline in head answers: pools and relays take them (verified as any fetched one),
refuse tampered ones, still sync with a gateway of an earlier release that sends none, and keep
their connections open across versions.

Every gateway here is real (in-process, on a loopback socket); a small HTTP proxy in front of one
records each request (path, and the client's port: one per TCP connection) and can rewrite the head
answers as a tampering relay or an older gateway would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from deltamesh_test_passthrough import pass_through

from deltamesh.delta import dir_manifest, read_weights
from deltamesh.gateway.fetch.errors import SyncError
from deltamesh.http import client_session, serving
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "tiny"
PIECE = 4096


def _tamper(envelope: str) -> str:
    """The envelope with its signed body changed (a later creation time): its signature no longer holds."""
    env = json.loads(envelope)
    env["body"] = env["body"].replace('"created_ms":', '"created_ms":1', 1)
    return json.dumps(env)


class Proxy:
    """An HTTP proxy in front of one gateway that records every request and treats the inline manifests
    of head answers as `mode` says: "pass", "tamper" (a relay forging them) or "strip" (an older gateway)."""

    def __init__(self, target: str, mode: str = "pass"):
        self.target, self.mode = target, mode
        self.requests: list[tuple[str, int]] = []
        self.inline_seen = 0

    def manifest_requests(self, version: int, kind: str = "delta") -> int:
        return sum(1 for path, _ in self.requests if path.endswith(f"/versions/{version}/{kind}/manifest"))

    def piece_requests(self, version: int) -> list[int]:
        """The client port of each request for piece 0 of delta `version`."""
        return [port for path, port in self.requests if path.endswith(f"/versions/{version}/delta/pieces/0")]

    def ports(self) -> set[int]:
        return {port for _, port in self.requests}

    def _rewrite(self, answer: dict) -> dict:
        carried = answer.get("manifests")
        if not carried:
            return answer
        self.inline_seen += 1
        if self.mode == "strip":
            answer.pop("manifests")
        elif self.mode == "tamper":
            if "heads" in answer:  # /v1/heads: {model: {kind: envelope}}
                answer["manifests"] = {m: {k: _tamper(e) for k, e in kinds.items()} for m, kinds in carried.items()}
            else:
                answer["manifests"] = {k: _tamper(e) for k, e in carried.items()}
        return answer

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        handlers: set[asyncio.Task] = set()
        async with aiohttp.ClientSession() as session:
            async def handle(request: web.Request) -> web.Response:
                self.requests.append((request.path, request.transport.get_extra_info("peername")[1]))
                handlers.add(asyncio.current_task())
                try:
                    body, status, headers = await pass_through(session, self.target, request)
                finally:
                    handlers.discard(asyncio.current_task())
                if status == 200 and (request.path == "/v1/heads" or request.path.endswith("/head")):
                    body = json.dumps(self._rewrite(json.loads(body))).encode()
                return web.Response(body=body, status=status, headers=headers)

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            async with serving(app, "127.0.0.1:0") as url:
                try:
                    yield url
                finally:  # long polls still forwarded end with the proxy, not when the gateway answers
                    for task in handlers:
                        task.cancel()


def _pool(kit, tmp_path: Path, gateways: list[str]) -> PoolSyncConfig:
    return PoolSyncConfig(gateways=gateways, token="region-token-1", name="p", dir=str(tmp_path / "p"),
                          trusted_keys=[str(kit.key.public)], model=MODEL, heartbeat_s=0.3, stall_timeout_s=3.0,
                          give_up_s=10.0)


def test_pool_takes_inline_manifests_and_keeps_its_connections(kit, tmp_path):
    """Four deltas in a row: none needs a manifest request, and none opens a connection the pool did
    not already hold after the first two."""
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            proxy = Proxy(url)
            async with proxy.running() as via:
                pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE)
                w = [kit.tiny_weights()]
                await pub.publish(w[0])
                async with WeightSync(_pool(kit, tmp_path, [via])) as sync:
                    assert await sync.sync_once() is True
                    early: set[int] = set()
                    for v in range(1, 5):
                        w.append(kit.next_step(w[-1], v))
                        await pub.publish(w[v])
                        assert await sync.sync_once(wait_s=5) is True and sync.version == v
                        if v == 2:
                            early = proxy.ports()
                    assert kit.same_bits(read_weights(sync.config.dir), w[4])
            assert proxy.inline_seen >= 5
            assert [proxy.manifest_requests(v) for v in range(1, 5)] == [0, 0, 0, 0]
            assert proxy.manifest_requests(0, "full") == 0
            assert proxy.ports() == early, "a later version opened new connections"

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["tamper", "strip"])
def test_pool_refuses_a_tampered_inline_manifest_and_syncs_without_one(kit, tmp_path, mode):
    """A tampered inline manifest fails its signature: with only the tampering gateway, the round fails
    and nothing is applied; beside an honest gateway, the pool takes the version from that one. A gateway
    that sends no inline manifest (an earlier release) is synced from as before."""
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            proxy = Proxy(url, mode)
            async with proxy.running() as via:
                pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE)
                w0 = kit.tiny_weights()
                await pub.publish(w0)
                w1 = kit.next_step(w0, 1)
                if mode == "tamper":
                    async with WeightSync(_pool(kit, tmp_path, [via])) as sync:
                        with pytest.raises(SyncError, match="manifest"):
                            await sync.sync_once()
                        assert sync.version is None and dir_manifest(sync.config.dir) is None
                    gateways = [via, url]
                else:
                    gateways = [via]
                async with WeightSync(_pool(kit, tmp_path, gateways)) as sync:
                    assert await sync.sync_once() is True
                    await pub.publish(w1)
                    assert await sync.sync_once(wait_s=5) is True and sync.version == 1
                    assert kit.same_bits(read_weights(sync.config.dir), w1)
            assert proxy.inline_seen >= 2
            if mode == "strip":  # the older gateway's way: the manifest is asked for
                assert proxy.manifest_requests(1) == 1

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["pass", "tamper", "strip"])
def test_relay_mirrors_a_delta_from_the_inline_manifest_of_its_upstreams_heads(kit, tmp_path, mode):
    """A relay that was not waiting for a delta (its model had only a full snapshot) mirrors it from
    the manifest its upstream's heads answer carried, without asking for it; a tampered one is refused
    (the genuine manifest is fetched instead and nothing else is stored), and an upstream that sends
    none is mirrored as before."""
    m0, raw0, p0 = kit.version(MODEL, 0, "full")
    m1, raw1, p1 = kit.version(MODEL, 1, "delta")

    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin:
            proxy = Proxy(origin, mode)
            async with proxy.running() as via, \
                    kit.running_gateway(kit.config(tmp_path / "a", region="A", upstreams=[via])) as relay, \
                    client_session() as s:
                await upload_version(s, origin, m0, raw0, p0)
                await _until_complete(s, relay, 0, "full")
                await upload_version(s, origin, m1, raw1, p1)
                await _until_complete(s, relay, 1, "delta")
                async with s.get(f"{relay}/v1/models/{MODEL}/versions/1/delta/manifest") as r:
                    assert await r.read() == raw1
        assert proxy.inline_seen >= 1
        assert proxy.manifest_requests(1) == (0 if mode == "pass" else 1)

    asyncio.run(main())


def test_relay_asks_for_the_next_version_on_the_connection_the_last_one_used(kit, tmp_path):
    """Each new delta's piece rides the upstream connection that carried the one before: the request
    for the next version goes out once this one is in, and takes the idle connection released last."""
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin:
            proxy = Proxy(origin)
            async with proxy.running() as via, \
                    kit.running_gateway(kit.config(tmp_path / "a", region="A", upstreams=[via])) as relay, \
                    client_session() as s:
                for v in range(5):
                    m, raw, pieces = kit.version(MODEL, v, "full" if v == 0 else "delta", pieces=1, piece_size=300_000)
                    await upload_version(s, origin, m, raw, pieces)
                    await _until_complete(s, relay, v, m.kind)
                    if v:  # the next delta is asked for ahead before it is published
                        await _until(lambda: proxy.piece_requests(v + 1), f"the relay to ask for v{v + 1}")
        carried = [proxy.piece_requests(v) for v in range(2, 5)]
        assert all(len(ports) == 1 for ports in carried), carried
        assert len({ports[0] for ports in carried}) == 1, f"pieces of v2-v4 came over {carried}"

    asyncio.run(main())


def test_newest_first_session_reuses_the_connection_released_last():
    async def main():
        async def port(request: web.Request) -> web.Response:
            await asyncio.sleep(0.05)  # overlapping requests: several connections
            return web.Response(text=str(request.transport.get_extra_info("peername")[1]))

        app = web.Application()
        app.router.add_get("/", port)
        async with serving(app, "127.0.0.1:0") as url:
            for newest_first in (True, False):
                async with client_session(newest_first=newest_first) as s:
                    async def ask() -> int:
                        async with s.get(url) as r:
                            return int(await r.text())
                    opened = await asyncio.gather(ask(), ask(), ask())
                    last = await ask()  # released last
                    assert (await ask() == last) is newest_first, (opened, last)

    asyncio.run(main())


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _until_complete(s: aiohttp.ClientSession, url: str, version: int, kind: str, timeout: float = 15.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        async with s.get(f"{url}/v1/models/{MODEL}/versions") as r:
            if r.status == 200:
                have = {(v["version"], v["kind"]): v["complete"] for v in (await r.json())["versions"]}
                if have.get((version, kind)):
                    return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not complete v{version} {kind} within {timeout}s")


def test_head_answers_carry_manifests_only_for_callers_with_a_read_credential(kit, tmp_path):
    """`?manifests=1` is a read of the head routes: a caller without a token, or with a wrong one, is
    refused (401) and gets no envelope, and so is a pool's token on the relays' `/v1/heads` (403); a
    downstream gateway's token gets the signed envelope there, a pool's on its model's head."""
    tokens = tmp_path / "tokens.toml"
    trainer, pool = add_token(tokens, TokenSpec("t", "trainer")), add_token(tokens, TokenSpec("p1", "pool"))
    relay = add_token(tokens, TokenSpec("eu", "gateway"))

    async def main():
        async with kit.running_gateway(kit.config(tmp_path, tokens_file=str(tokens))) as url:
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE, token=trainer)
            w0 = kit.tiny_weights()
            await pub.publish(w0)
            await pub.publish(kit.next_step(w0, 1))
            routes = {f"{url}/v1/heads?manifests=1": relay, f"{url}/v1/models/{MODEL}/head?manifests=1": pool}
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/heads?manifests=1", headers={"Authorization": f"Bearer {pool}"}) as r:
                    assert r.status == 403 and b"manifests" not in await r.read()
                for route, token in routes.items():
                    for headers in ({}, {"Authorization": "Bearer dm_" + "x" * 43}):
                        async with s.get(route, headers=headers) as r:
                            assert r.status == 401, (route, headers, r.status)
                            assert b"manifests" not in await r.read()
                    async with s.get(route, headers={"Authorization": f"Bearer {token}"}) as r:
                        assert r.status == 200
                        carried = (await r.json())["manifests"]
                    delta = carried[MODEL]["delta"] if MODEL in carried else carried["delta"]
                    assert json.loads(delta)["signature"]

    asyncio.run(main())
