"""The fetcher against a real HTTP server on loopback: pieces prefetched with the manifest, a bad
prefetched piece, prefetches past the last piece.

The server is a small aiohttp app (not a gateway) so a test can delay the manifest or corrupt a
piece once, and see every request it got, in order.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.fetch import Fetcher
from deltamesh.gateway.sources import Source
from deltamesh.gateway.http import client_session, parse_range, serving

MODEL = "m"


@dataclass
class Behaviour:
    manifest_delay_s: float = 0.0
    bad_once: set[int] = field(default_factory=set)
    log: list[tuple[float, str, str | None]] = field(default_factory=list)
    """(time, what, Range header) of every request; 'manifest-sent' when a manifest answer goes out."""


@asynccontextmanager
async def piece_server(envelope: bytes, pieces: list[bytes], b: Behaviour):
    async def manifest(request: web.Request) -> web.Response:
        b.log.append((time.monotonic(), "manifest", None))
        await asyncio.sleep(b.manifest_delay_s)
        b.log.append((time.monotonic(), "manifest-sent", None))
        return web.Response(body=envelope)

    async def piece(request: web.Request) -> web.StreamResponse:
        i = int(request.match_info["i"])
        header = request.headers.get("Range")
        b.log.append((time.monotonic(), f"piece {i}", header))
        if i >= len(pieces):
            return web.json_response({"error": "no such piece"}, status=404)
        data = pieces[i]
        if i in b.bad_once:
            b.bad_once.discard(i)
            data = bytes([data[0] ^ 1]) + data[1:]
        start, end = parse_range(header, len(data)) or (0, len(data))
        return web.Response(body=data[start:end], status=206 if header else 200)

    app = web.Application()
    app.router.add_get(f"/v1/models/{MODEL}/versions/{{v}}/{{kind}}/manifest", manifest)
    app.router.add_get(f"/v1/models/{MODEL}/versions/{{v}}/{{kind}}/pieces/{{i}}", piece)
    async with serving(app, "127.0.0.1:0") as url:
        yield url


def fetch_all(kit, pieces_n: int, piece_size: int, b: Behaviour, *, prefetch: int, connections: int):
    manifest, envelope, pieces = kit.version(MODEL, 1, "full", pieces=pieces_n, piece_size=piece_size)
    got: dict[int, bytes] = {}

    async def main() -> None:
        async with piece_server(envelope, pieces, b) as url, client_session(connections=2 * connections + 4) as s:
            fetcher = Fetcher(s, [Source(url)], "test", stall_timeout_s=5, give_up_s=30)

            async def accept(raw: bytes):
                return load_manifest(raw, [kit.key.key.public_key()])

            m = await fetcher.manifest_bytes(MODEL, 1, "full", accept, prefetch=prefetch)

            async def keep(i: int, data: bytearray) -> None:
                assert i not in got, f"piece {i} handed over twice"
                got[i] = bytes(data)

            await fetcher.pieces(m, range(len(m.pieces)), connections, keep)

    asyncio.run(main())
    return pieces, got


def requests_for(b: Behaviour, i: int) -> list[str | None]:
    return [rng for _, what, rng in b.log if what == f"piece {i}"]


def test_prefetched_pieces_are_requested_with_the_manifest_and_not_again(kit):
    b = Behaviour(manifest_delay_s=0.3)
    pieces, got = fetch_all(kit, 5, 3000, b, prefetch=3, connections=3)
    assert got == dict(enumerate(pieces))
    sent = next(t for t, what, _ in b.log if what == "manifest-sent")
    for i in range(3):
        assert len(requests_for(b, i)) == 1
        assert next(t for t, what, _ in b.log if what == f"piece {i}") < sent, "prefetch did not overlap the manifest"
    for i in (3, 4):  # the rest waited for the manifest
        assert next(t for t, what, _ in b.log if what == f"piece {i}") > sent


def test_a_bad_prefetched_piece_is_fetched_again_and_checked(kit):
    b = Behaviour(bad_once={1})
    pieces, got = fetch_all(kit, 4, 2000, b, prefetch=4, connections=2)
    assert got == dict(enumerate(pieces))
    assert len(requests_for(b, 1)) == 2


def test_prefetching_past_the_last_piece_is_harmless(kit):
    b = Behaviour()
    pieces, got = fetch_all(kit, 2, 1500, b, prefetch=6, connections=6)
    assert got == dict(enumerate(pieces))
    assert [len(requests_for(b, i)) for i in range(6)] == [1, 1, 1, 1, 1, 1]  # 2..5 answered 404, once
