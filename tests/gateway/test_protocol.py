"""The gateway's HTTP protocol against a real socket: publish, read back, ranges, long polls, and refusals."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from deltamesh.delta.keys import generate_key
from deltamesh.http import client_session, request_bytes, request_json
from deltamesh.trainer.upload import upload_version

MODEL = "tiny-1"


async def _status(session: aiohttp.ClientSession, method: str, url: str, **kw) -> tuple[int, dict]:
    async with session.request(method, url, **kw) as resp:
        body = await resp.read()
        try:
            return resp.status, json.loads(body)
        except ValueError:
            return resp.status, {"raw": body}


def test_publish_and_read_back_with_ranges(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            m, raw, pieces = kit.version(MODEL, 1, "full", pieces=4, piece_size=5000)
            sent = await upload_version(s, url, m, raw, pieces, connections=2)
            assert sent == 20000
            base = f"{url}/v1/models/{MODEL}/versions/1/full"
            assert await request_bytes(s, "GET", f"{base}/manifest") == raw
            for i, p in enumerate(pieces):
                assert await request_bytes(s, "GET", f"{base}/pieces/{i}") == p
            async with s.get(f"{base}/pieces/2", headers={"Range": "bytes=100-"}) as r:
                assert r.status == 206
                assert r.headers["Content-Range"] == "bytes 100-4999/5000"
                assert await r.read() == pieces[2][100:]
            async with s.get(f"{base}/pieces/2", headers={"Range": "bytes=10-19"}) as r:
                assert r.status == 206 and await r.read() == pieces[2][10:20]
            status, body = await _status(s, "GET", f"{base}/pieces/2", headers={"Range": "bytes=6000-"})
            assert status == 416 and "outside" in body["error"]
            listing = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/versions")
            assert listing["head"] == 1 and listing["versions"][0]["complete"] is True
            # Publishing again is idempotent and sends nothing.
            assert await upload_version(s, url, m, raw, pieces) == 0

    asyncio.run(main())


def test_long_poll_wakes_at_once_and_pending_piece_is_served_when_it_lands(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path, piece_wait_s=5.0)) as url, client_session() as s:
            m1, raw1, p1 = kit.version(MODEL, 1, "full")
            await upload_version(s, url, m1, raw1, p1)
            poll = asyncio.create_task(
                request_json(s, "GET", f"{url}/v1/models/{MODEL}/head", params={"after": 1, "wait": 20}))
            now = await request_json(s, "GET", f"{url}/v1/heads")  # a new follower is answered at once
            assert now["heads"] == {MODEL: 1}
            params = {"since": now["epoch"], "instance": now["instance"], "wait": 20}
            heads = asyncio.create_task(request_json(s, "GET", f"{url}/v1/heads", params=params))
            await asyncio.sleep(0.3)
            assert not poll.done()
            m2, raw2, p2 = kit.version(MODEL, 2, "delta")
            t0 = time.monotonic()
            await request_bytes(s, "PUT", f"{url}/v1/models/{MODEL}/versions/2/delta/manifest", data=raw2)
            assert (await poll)["head"] == 2
            assert time.monotonic() - t0 < 1.0  # woken by the publish, not by a polling period
            assert (await heads)["heads"] == {MODEL: 2}
            # The version is announced; its piece 0 is not here yet: a reader waits for it.
            piece = asyncio.create_task(request_bytes(s, "GET", f"{url}/v1/models/{MODEL}/versions/2/delta/pieces/0"))
            await asyncio.sleep(0.3)
            assert not piece.done()
            await request_bytes(s, "PUT", f"{url}/v1/models/{MODEL}/versions/2/delta/pieces/0", data=p2[0])
            assert await piece == p2[0]

    asyncio.run(main())


def test_a_version_asked_for_ahead_is_answered_when_announced_and_refused_once_superseded(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            m1, raw1, p1 = kit.version(MODEL, 1, "full")
            await upload_version(s, url, m1, raw1, p1)
            base2 = f"{url}/v1/models/{MODEL}/versions/2/delta"
            # Not announced, not waited for: 404 at once, as before.
            status, _ = await _status(s, "GET", f"{base2}/manifest")
            assert status == 404
            manifest = asyncio.create_task(request_bytes(s, "GET", f"{base2}/manifest", params={"wait": 20}))
            piece = asyncio.create_task(request_bytes(s, "GET", f"{base2}/pieces/1", params={"wait": 20}))
            full = asyncio.create_task(_status(s, "GET", f"{url}/v1/models/{MODEL}/versions/2/full/manifest",
                                               params={"wait": 20}))
            await asyncio.sleep(0.3)
            assert not (manifest.done() or piece.done() or full.done())
            m2, raw2, p2 = kit.version(MODEL, 2, "delta")
            t0 = time.monotonic()
            await request_bytes(s, "PUT", f"{base2}/manifest", data=raw2)
            assert await manifest == raw2
            assert time.monotonic() - t0 < 1.0
            assert not piece.done()  # announced, but its piece 1 has not landed yet
            await request_bytes(s, "PUT", f"{base2}/pieces/1", data=p2[1])
            assert await piece == p2[1]
            await asyncio.sleep(0.2)
            assert not full.done()  # a full of v2 may still follow its delta
            m3, raw3, _ = kit.version(MODEL, 3, "delta")
            await request_bytes(s, "PUT", f"{url}/v1/models/{MODEL}/versions/3/delta/manifest", data=raw3)
            status, body = await full  # v3 came first: no full of v2 is coming
            assert status == 404 and "not in this gateway's store" in body["error"]
            t0 = time.monotonic()  # waiting ends at `wait` when nothing comes
            status, _ = await _status(s, "GET", f"{url}/v1/models/{MODEL}/versions/4/delta/manifest",
                                      params={"wait": 0.5})
            assert status == 404 and 0.4 < time.monotonic() - t0 < 3.0

    asyncio.run(main())


def test_pending_piece_times_out_with_503(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path, piece_wait_s=0.3)) as url, client_session() as s:
            m, raw, _ = kit.version(MODEL, 1, "full")
            await request_bytes(s, "PUT", f"{url}/v1/models/{MODEL}/versions/1/full/manifest", data=raw)
            status, body = await _status(s, "GET", f"{url}/v1/models/{MODEL}/versions/1/full/pieces/1")
            assert status == 503 and "not arrived" in body["error"]

    asyncio.run(main())


def test_bad_publishes_are_refused_with_reasons(kit, tmp_path):
    async def main():
        cfg = kit.config(tmp_path, max_piece_bytes=1 << 20)
        async with kit.running_gateway(cfg) as url, client_session() as s:
            base = f"{url}/v1/models/{MODEL}/versions/1/full"
            m, raw, pieces = kit.version(MODEL, 1, "full")
            # Signed by a key the gateway does not trust.
            stranger = m.signed(generate_key())
            status, body = await _status(s, "PUT", f"{base}/manifest", data=stranger)
            assert status == 403 and "not trusted" in body["error"]
            # Trusted key id, forged signature.
            env = json.loads(raw)
            env["signature"] = "ab" * 64
            status, body = await _status(s, "PUT", f"{base}/manifest", data=json.dumps(env).encode())
            assert status == 403 and "bad signature" in body["error"]
            # Unsigned, and malformed signature.
            unsigned = json.dumps({"body": env["body"]}).encode()
            status, body = await _status(s, "PUT", f"{base}/manifest", data=unsigned)
            assert status == 401 and "not signed" in body["error"]
            env["signature"] = "zz"
            status, body = await _status(s, "PUT", f"{base}/manifest", data=json.dumps(env).encode())
            assert status == 401 and "malformed signature" in body["error"]
            # Malformed JSON, and a manifest for another version than the URL names.
            status, body = await _status(s, "PUT", f"{base}/manifest", data=b"{not json")
            assert status == 400 and "malformed JSON" in body["error"]
            status, body = await _status(s, "PUT", f"{url}/v1/models/{MODEL}/versions/7/full/manifest", data=raw)
            assert status == 400 and "URL says" in body["error"]
            # Oversized manifest body.
            status, body = await _status(s, "PUT", f"{base}/manifest", data=b" " * (9 * 1024 * 1024))
            assert status == 413
            # A manifest that declares a piece over the limit.
            big, big_raw, _ = kit.version(MODEL, 2, "full", pieces=1, piece_size=(1 << 20) + 1)
            status, body = await _status(s, "PUT", f"{url}/v1/models/{MODEL}/versions/2/full/manifest", data=big_raw)
            assert status == 413 and "over" in body["error"]
            # Nothing of the refused ones was stored.
            status, body = await _status(s, "GET", f"{url}/v1/models/{MODEL}/versions")
            assert status == 404

            # Pieces: before the manifest, wrong bytes, too many bytes, bad names.
            status, body = await _status(s, "PUT", f"{base}/pieces/0", data=pieces[0])
            assert status == 404 and "not in this gateway's store" in body["error"]
            await request_bytes(s, "PUT", f"{base}/manifest", data=raw)
            status, body = await _status(s, "PUT", f"{base}/pieces/0", data=b"x" * len(pieces[0]))
            assert status == 400 and "hash mismatch" in body["error"]
            status, body = await _status(s, "PUT", f"{base}/pieces/0", data=pieces[0] + b"extra")
            assert status == 413
            status, body = await _status(s, "PUT", f"{base}/pieces/0", data=pieces[0][:-1])
            assert status == 400 and "bytes" in body["error"]
            status, body = await _status(s, "GET", f"{base}/pieces/0")
            assert status == 503  # nothing bad was stored in its place

    asyncio.run(main())


@pytest.mark.parametrize("path", [
    "/v1/models/..%2F..%2Fetc/versions/1/full/manifest",
    "/v1/models/.hidden/versions/1/full/manifest",
    "/v1/models/tiny-1/versions/1/full/pieces/..%2Fmanifest.json",
    "/v1/models/tiny-1/versions/1/full/pieces/-1",
    "/v1/models/tiny-1/versions/1/full/pieces/0x1",
    "/v1/models/tiny-1/versions/1/..%2Ffull/manifest",
    "/v1/models/tiny-1/versions/01e3/full/manifest",
    "/v1/models/tiny-1/versions/1/full/pieces/%C2%B2",
])
def test_path_traversal_and_bad_names_are_refused(kit, tmp_path, path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            m, raw, pieces = kit.version(MODEL, 1, "full")
            await upload_version(s, url, m, raw, pieces)
            for method in ("GET", "PUT"):
                status, body = await _status(s, method, f"{url}{path}", data=b"x")
                assert status == 400, (method, path, status, body)
                assert "invalid" in body["error"]

    asyncio.run(main())
