"""Signed head statements at gateways: the origin keeps the newest valid one, relays mirror it.

Real gateways in this process on loopback sockets. The publisher uploads a statement after each
version; the origin serves it as the exact signed bytes (with an entity tag), refuses one that is not
newer, not validly signed, about another model, for a version it never accepted or with another
weights hash, and keeps it across a restart; a relay refuses uploads and mirrors the origin's newest
statement as soon as it changes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from deltamesh.delta import generate_key, load_statement, sign_statement
from deltamesh.http import HttpError, client_session, request_bytes
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
PIECE = 4096


async def put(s, url: str, body: bytes, model: str = MODEL) -> int:
    async with s.put(f"{url}/v1/models/{model}/statement", data=body,
                     headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        return resp.status


async def get(s, url: str, model: str = MODEL, etag: str | None = None) -> bytes | int:
    try:
        return await request_bytes(s, "GET", f"{url}/v1/models/{model}/statement",
                                   headers={"If-None-Match": etag} if etag else None)
    except HttpError as e:
        return e.status


def test_the_origin_keeps_the_newest_valid_statement(kit, tmp_path):
    keys = [kit.key.key.public_key()]

    async def main():
        config = kit.config(tmp_path)
        async with kit.running_gateway(config) as url, client_session(timeout_s=10) as s:
            assert await get(s, url) == 404
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE)
            w0 = kit.tiny_weights()
            first = await pub.publish(w0)
            second = await pub.publish(kit.next_step(w0, 1))
            raw = await get(s, url)
            st = load_statement(raw, keys, model=MODEL)
            assert (st.version, st.weights_hash) == (1, second.manifests[0].weights_hash)
            assert abs(st.age_s()) < 30
            async with s.get(f"{url}/v1/models/{MODEL}/statement") as resp:
                etag = resp.headers["ETag"]
            assert await get(s, url, etag=etag) == 304

            h0, h1 = first.manifests[0].weights_hash, second.manifests[0].weights_hash
            now = int(time.time() * 1000)
            assert await put(s, url, raw) == 200  # the same bytes again: kept as they are
            assert await put(s, url, sign_statement(kit.key.key, MODEL, 1, h1, st.issued_ms - 1)) == 409  # older
            assert await put(s, url, sign_statement(kit.key.key, MODEL, 0, h0, now + 1000)) == 409  # older version
            assert await put(s, url, sign_statement(generate_key(), MODEL, 1, h1, now + 1000)) == 403  # untrusted
            tampered = raw.replace(b'\\"version\\":1', b'\\"version\\":2')
            assert tampered != raw and await put(s, url, tampered) == 403
            assert await put(s, url, sign_statement(kit.key.key, "other", 1, h1, now + 1000)) == 400  # URL's model
            assert await put(s, url, sign_statement(kit.key.key, MODEL, 5, h1, now + 1000)) == 409  # not published
            assert await put(s, url, sign_statement(kit.key.key, MODEL, 1, "0" * 32, now + 1000)) == 409  # 2nd hash
            assert await put(s, url, b"x" * 5000) == 413
            assert await put(s, url, b"{oops") == 400
            assert await get(s, url) == raw

            assert await pub.publish_statement() is True  # a fresh one for the same version
            fresh = load_statement(await get(s, url), keys)
            assert fresh.version == 1 and fresh.issued_ms > st.issued_ms
        async with kit.running_gateway(config) as url, client_session(timeout_s=10) as s:  # a restart keeps it
            assert load_statement(await get(s, url), keys) == fresh

    asyncio.run(main())


def test_a_relay_mirrors_the_origin_s_statement_and_refuses_uploads(kit, tmp_path: Path):
    keys = [kit.key.key.public_key()]

    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session(timeout_s=10) as s:
            pub = Publisher(origin, kit.key.key, MODEL, piece_bytes=PIECE)
            await pub.publish(kit.tiny_weights())
            relay_cfg = kit.config(tmp_path / "r", region="A", upstreams=[origin])
            async with kit.running_gateway(relay_cfg) as relay:
                async def mirrored(raw: bytes) -> None:
                    for _ in range(100):
                        if await get(s, relay) == raw:
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"the relay did not mirror the statement: {await get(s, relay)!r:.200}")

                await mirrored(await get(s, origin))
                assert await pub.publish_statement()  # a fresh statement moves the origin's heads: at once
                fresh = await get(s, origin)
                await mirrored(fresh)
                assert load_statement(fresh, keys).version == 0
                assert await put(s, relay, fresh) == 405

    asyncio.run(main())
