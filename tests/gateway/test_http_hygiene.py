"""What a gateway makes of odd or hostile HTTP input, and the validators it serves.

Deeply nested JSON and signed manifests declaring absurd shapes are refused with 400 (never a 500);
an unsatisfiable Range gets 416 with `Content-Range: bytes */N`; pieces and manifests carry their
hash as ETag, `If-None-Match` answers 304 and an `If-Range` that does not match gives the whole 200.
A peer's deeply nested JSON answer is an HttpError for the client, not a crash.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from deltamesh.delta.keys import key_id, sign
from deltamesh.http import HttpError, client_session, request_json, serving
from deltamesh.trainer.upload import upload_version

MODEL = "tiny-1"


async def _put_manifest(s: aiohttp.ClientSession, url: str, raw: bytes, version: int = 1) -> tuple[int, dict]:
    async with s.put(f"{url}/v1/models/{MODEL}/versions/{version}/full/manifest", data=raw) as r:
        return r.status, json.loads(await r.read())


def test_nested_json_and_oversized_shapes_are_refused_with_400(kit, tmp_path):
    key = kit.key.key
    m, _, _ = kit.version(MODEL, 1, "full")
    body = m.body()
    body["tensors"] = [["w", "BF16", [2**40, 2**20], "0" * 32]]
    huge = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    signed_huge = json.dumps({"body": huge.decode(), "key_id": key_id(key), "signature": sign(key, huge).hex()})

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            status, answer = await _put_manifest(s, url, b"[" * 100_000 + b"]" * 100_000)
            assert status == 400 and "nested deeper" in answer["error"]
            deep_envelope = json.dumps({"body": "x", "key_id": "k", "signature": "0" * 128,
                                        "extra": json.loads("[" * 80 + "]" * 80)}).encode()
            status, answer = await _put_manifest(s, url, deep_envelope)
            assert status == 400 and "nested deeper" in answer["error"]
            status, answer = await _put_manifest(s, url, signed_huge.encode())
            assert status == 400 and "over the limit" in answer["error"], answer
            assert (await request_json(s, "GET", f"{url}/v1/models"))["models"] == {}

    asyncio.run(main())


def test_ranges_etags_and_conditional_requests(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            m, raw, pieces = kit.version(MODEL, 1, "full", pieces=2, piece_size=5000)
            await upload_version(s, url, m, raw, pieces)
            base = f"{url}/v1/models/{MODEL}/versions/1/full"
            etag = f'"{m.pieces[0].hash}"'
            async with s.get(f"{base}/pieces/0") as r:
                assert r.status == 200 and r.headers["ETag"] == etag
            async with s.get(f"{base}/pieces/0", headers={"Range": "bytes=6000-"}) as r:
                assert r.status == 416 and r.headers["Content-Range"] == "bytes */5000"
            async with s.get(f"{base}/pieces/0", headers={"If-None-Match": etag}) as r:
                assert r.status == 304 and r.headers["ETag"] == etag and await r.read() == b""
            async with s.get(f"{base}/pieces/0", headers={"If-None-Match": '"other", W/' + etag}) as r:
                assert r.status == 304
            async with s.get(f"{base}/pieces/0", headers={"If-None-Match": '"other"'}) as r:
                assert r.status == 200 and await r.read() == pieces[0]
            async with s.get(f"{base}/pieces/0", headers={"Range": "bytes=100-199", "If-Range": etag}) as r:
                assert r.status == 206 and await r.read() == pieces[0][100:200]
            for bogus in ('"0123"', "Wed, 21 Oct 2015 07:28:00 GMT", "W/" + etag):
                async with s.get(f"{base}/pieces/0", headers={"Range": "bytes=100-199", "If-Range": bogus}) as r:
                    assert r.status == 200 and await r.read() == pieces[0], bogus
            async with s.get(f"{base}/manifest") as r:
                manifest_etag = r.headers["ETag"]
                assert await r.read() == raw and manifest_etag.startswith('"') and len(manifest_etag) == 34
            async with s.get(f"{base}/manifest", headers={"If-None-Match": manifest_etag}) as r:
                assert r.status == 304

    asyncio.run(main())


@pytest.mark.parametrize("answer", [b"[" * 100_000 + b"]" * 100_000, json.dumps(json.loads("[" * 80 + "]" * 80)).encode()],
                         ids=["recursion", "too-deep"])
def test_a_peers_deeply_nested_answer_is_an_http_error(answer):
    async def main():
        async def heads(_request: web.Request) -> web.Response:
            return web.Response(body=answer, content_type="application/json")

        app = web.Application()
        app.router.add_get("/v1/heads", heads)
        async with serving(app, "127.0.0.1:0") as url, client_session() as s:
            with pytest.raises(HttpError, match="nested deeper"):
                await request_json(s, "GET", f"{url}/v1/heads")

    asyncio.run(main())
