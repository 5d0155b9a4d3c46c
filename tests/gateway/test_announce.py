"""Downstream announcements (`POST /v1/gateways`): only a gateway credential announces, and only itself; the
table is bounded and its entries lapse unless renewed; an announced URL is probed only when the
announcement was authenticated; a relay with a gateway token follows, mirrors and announces itself."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from deltamesh.gateway.server.app import GATEWAY_KEY, create_app
from deltamesh.http import bearer, client_session, request_bytes, serving
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.upload import upload_version

MODEL = "tiny-1"


async def announce(s, url: str, region: str, target: str, token: str | None) -> tuple[int, dict]:
    headers = bearer(token) if token else {}
    async with s.post(f"{url}/v1/gateways", json={"region": region, "url": target}, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


class Probed:
    """A server that counts the requests it gets: it stands for an announced URL."""

    def __init__(self) -> None:
        self.hits = 0
        self.app = web.Application()
        self.app.router.add_get("/healthz", self.health)

    async def health(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.json_response({"ok": True})


def test_only_a_gateway_announces_and_only_itself(kit, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tok = {name: add_token(tokens, TokenSpec(name, role)) for name, role in
           (("A", "gateway"), ("B", "gateway"), ("C", "gateway"), ("p1", "pool"), ("ops", "admin"))}

    async def main():
        app = create_app(kit.config(tmp_path, tokens_file=str(tokens), max_downstreams=2, downstream_ttl_s=2.0))
        gw = app[GATEWAY_KEY]
        async with serving(app, "127.0.0.1:0") as url, client_session(timeout_s=10) as s:
            target = "http://127.0.0.1:9"
            for token, expect in ((None, 401), ("dm_" + "y" * 43, 401), (tok["p1"], 403), (tok["ops"], 403),
                                  (tok["B"], 403)):
                status, body = await announce(s, url, "A", target, token)
                assert status == expect and "error" in body, (expect, body)
            assert len(gw.downstreams) == 0 and gw.links.find("A", "downstream") is None

            status, body = await announce(s, url, "A", target, tok["A"])
            assert status == 200 and body == {"region": "origin", "ttl_s": 2.0}
            assert (await announce(s, url, "B", target, tok["B"]))[0] == 200
            status, body = await announce(s, url, "C", target, tok["C"])
            assert status == 429 and "2 downstream" in body["error"] and "C" not in gw.downstreams
            # A keeps announcing within its TTL and stays; B does not and lapses, which makes room for C.
            for _ in range(5):
                await asyncio.sleep(0.6)
                assert (await announce(s, url, "A", target, tok["A"]))[0] == 200
            assert (await announce(s, url, "C", target, tok["C"]))[0] == 200
            assert sorted(d.region for d in gw.downstreams) == ["A", "C"]
            assert gw.links.find("B", "downstream") is None and gw.links.find("A", "downstream") is not None

    asyncio.run(main())


def test_announced_urls_are_probed_only_when_authenticated(kit, tmp_path):
    tokens = tmp_path / "tokens.toml"
    token = add_token(tokens, TokenSpec("A", "gateway"))

    async def main():
        probed = Probed()
        async with serving(probed.app, "127.0.0.1:0") as target, client_session(timeout_s=10) as s:
            anonymous = create_app(kit.config(tmp_path / "anon", probe_interval_s=0.1))
            async with serving(anonymous, "127.0.0.1:0") as url:
                assert (await announce(s, url, "A", target, None))[0] == 200  # taken, to name the link
                await asyncio.sleep(1.0)
                assert probed.hits == 0
                link = anonymous[GATEWAY_KEY].links.find("A", "downstream")
                assert link is not None and link.url == "" and not link.rtts
            app = create_app(kit.config(tmp_path / "auth", tokens_file=str(tokens), probe_interval_s=0.1))
            async with serving(app, "127.0.0.1:0") as url:
                assert (await announce(s, url, "A", target, token))[0] == 200
                for _ in range(50):
                    await asyncio.sleep(0.1)
                    if probed.hits:
                        break
                assert probed.hits > 0 and app[GATEWAY_KEY].links.find("A", "downstream").url == target

    asyncio.run(main())


def test_a_relay_with_a_gateway_token_mirrors_and_announces(kit, tmp_path):
    tokens = tmp_path / "tokens.toml"
    relay_token = add_token(tokens, TokenSpec("A", "gateway"))
    trainer = add_token(tokens, TokenSpec("t", "trainer"))
    admin = add_token(tokens, TokenSpec("ops", "admin"))

    async def main():
        origin_app = create_app(kit.config(tmp_path / "o", tokens_file=str(tokens), probe_interval_s=0.2,
                                           downstream_ttl_s=1.5))
        async with serving(origin_app, "127.0.0.1:0") as origin, client_session(timeout_s=10) as s:
            port = kit.free_port()
            relay_url = f"http://127.0.0.1:{port}"
            # The relay is anonymous to its own callers here: its credential towards the origin is the subject.
            relay_cfg = kit.config(tmp_path / "r", region="A", listen=f"127.0.0.1:{port}", advertise=relay_url,
                                   upstreams=[origin], upstream_token=relay_token, probe_interval_s=0.2)
            relay_app = create_app(relay_cfg)
            async with serving(relay_app, relay_cfg.listen) as url:
                m, raw, pieces = kit.version(MODEL, 1, "full", pieces=3)
                async with client_session(headers=bearer(trainer)) as pub:
                    await upload_version(pub, origin, m, raw, pieces)
                for i, p in enumerate(pieces):
                    got = await request_bytes(s, "GET", f"{url}/v1/models/{MODEL}/versions/1/full/pieces/{i}",
                                              params={"wait": 10})
                    assert got == p
                links = origin_app[GATEWAY_KEY].links
                for _ in range(50):
                    link = links.find("A", "downstream")
                    if link is not None and link.rtts:
                        break
                    await asyncio.sleep(0.1)
                assert link.url == relay_url and link.rtts
                # Announcements are renewed before the origin's 1.5 s TTL lapses.
                await asyncio.sleep(2.0)
                assert "A" in origin_app[GATEWAY_KEY].downstreams
                listing = await request_bytes(s, "GET", f"{origin}/v1/links", headers=bearer(admin))
                assert '"peer": "A"' in listing.decode() or '"peer":"A"' in listing.decode()

    asyncio.run(main())
