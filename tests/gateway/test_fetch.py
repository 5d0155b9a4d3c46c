"""The fetcher against a real HTTP server on loopback: pieces prefetched with the manifest, a bad
prefetched piece, prefetches past the last piece, the last pieces split into ranges, connections
opened ahead (by a fetcher, and by a pool's weight sync as it starts); and against a real gateway, a version asked for before it is published.

The server is a small aiohttp app (not a gateway) so a test can delay the manifest or corrupt a
piece once, and see every request it got, in order.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from deltamesh.delta import generate_key, save_keypair
from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.fetch.fetcher import MIN_SPAN, Fetcher, NotAnnounced
from deltamesh.gateway.fetch.lanes import MIN_PART, first_spans
from deltamesh.gateway.fetch.sources import Source
from deltamesh.http import client_session, parse_range, serving
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.upload import upload_version

MODEL = "m"


@dataclass
class Behaviour:
    manifest_delay_s: float = 0.0
    bad_once: set[int] = field(default_factory=set)
    unpublished: bool = False
    """Answer every request 404 after its `wait` (a version asked for ahead that never comes)."""
    peers: set = field(default_factory=set)
    """The client ends (address, port) of every request: one per connection used."""
    opened: set = field(default_factory=set)
    """The client ends of the `/healthz` requests (connections opened ahead)."""
    log: list[tuple[float, str, str | None]] = field(default_factory=list)
    """(time, what, Range header) of every request; 'manifest-sent' when a manifest answer goes out."""


@asynccontextmanager
async def piece_server(envelope: bytes, pieces: list[bytes], b: Behaviour):
    async def unpublished(request: web.Request, extra_s: float = 0.0) -> web.Response:
        await asyncio.sleep(float(request.query.get("wait", 0)) + extra_s)
        return web.json_response({"error": "not in this gateway's store"}, status=404)

    async def manifest(request: web.Request) -> web.Response:
        b.peers.add(request.transport.get_extra_info("peername"))
        if b.unpublished:
            return await unpublished(request)
        b.log.append((time.monotonic(), "manifest", None))
        await asyncio.sleep(b.manifest_delay_s)
        b.log.append((time.monotonic(), "manifest-sent", None))
        return web.Response(body=envelope)

    async def piece(request: web.Request) -> web.StreamResponse:
        b.peers.add(request.transport.get_extra_info("peername"))
        if b.unpublished:  # its wait ends just after the manifest's
            return await unpublished(request, 0.05)
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

    async def healthz(request: web.Request) -> web.Response:
        b.opened.add(request.transport.get_extra_info("peername"))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
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


def _ranges(b: Behaviour, i: int, size: int) -> list[tuple[int, int]]:
    """The byte ranges requested of piece `i`, as [start, end)."""
    return sorted(parse_range(rng, size) or (0, size) for rng in requests_for(b, i))


def test_the_last_pieces_are_split_over_idle_connections_without_asking_twice(kit):
    size = 3 * MIN_SPAN  # 4 pieces, 8 connections: a piece per connection would leave half of them idle
    b = Behaviour()
    pieces, got = fetch_all(kit, 4, size, b, prefetch=0, connections=8)
    assert got == dict(enumerate(pieces))
    split = 0
    for i in range(4):
        ranges = _ranges(b, i, size)
        covered = 0
        for start, end in ranges:  # the ranges tile the piece: nothing asked for twice, nothing left out
            assert start == covered, f"piece {i}: ranges {ranges}"
            covered = end
        assert covered == size
        split += len(ranges) > 1
    assert split >= 2, "no piece was split over the idle connections"


def test_with_more_connections_than_pieces_every_piece_is_cut_up_front_over_all_of_them(kit):
    """A cold fetch over a long link: 8 connections, 2 pieces of 2 MiB. Each piece is cut into 4
    equal parts and each part has a connection of its own, so every connection carries bytes from
    the first round trip (shares of 1 MiB at the end would have used 4 of them)."""
    size = 2 * MIN_SPAN
    b = Behaviour()
    pieces, got = fetch_all(kit, 2, size, b, prefetch=0, connections=8)
    assert got == dict(enumerate(pieces))
    for i in range(2):
        assert _ranges(b, i, size) == [(k * size // 4, (k + 1) * size // 4) for k in range(4)]
    assert len(b.peers) >= 8, f"the 8 parts came over {len(b.peers)} connections"


def test_first_spans_tile_each_piece_into_no_more_parts_than_connections(kit):
    manifest, _, _ = kit.version(MODEL, 1, "full", pieces=5, piece_size=3 * MIN_PART + 7)
    order = [4, 0, 1, 2, 3]
    assert first_spans(manifest, order, 5, set()) == [(i, 0, 3 * MIN_PART + 7) for i in order]  # no spare
    for connections, whole_first in ((12, set()), (64, {0}), (11, {1, 2})):
        spans = first_spans(manifest, order, connections, whole_first)
        assert len(spans) <= connections
        assert [i for i, _, _ in spans] == sorted((i for i, _, _ in spans), key=order.index)  # in order
        for i in order:
            mine = [(a, b) for j, a, b in spans if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == manifest.pieces[i].length
            assert all(b1 == a2 for (_, b1), (a2, _) in zip(mine, mine[1:])), f"piece {i}: {mine}"
            if i in whole_first:
                assert len(mine) == 1  # already on its way whole
            else:
                assert all(b - a >= MIN_PART for a, b in mine)
    assert len(first_spans(manifest, order, 64, set())) == 15  # at most 3 parts of >= MIN_PART each


def test_a_piece_assembled_from_bad_ranges_is_fetched_whole_again(kit):
    size = 3 * MIN_SPAN
    b = Behaviour(bad_once={0})
    pieces, got = fetch_all(kit, 2, size, b, prefetch=0, connections=8)
    assert got == dict(enumerate(pieces))
    assert len(_ranges(b, 0, size)) > 2  # its ranges, then the whole piece once more
    assert (0, size) in _ranges(b, 0, size)


def test_a_version_asked_for_ahead_flows_once_published_and_a_skipped_one_is_not_waited_for(kit, tmp_path):
    """Against a real gateway: the manifest and first pieces of v2 are asked for before v2 exists;
    they arrive as it is published. Asking ahead for a version the publisher skipped ends at once."""
    m2, raw2, p2 = kit.version(MODEL, 2, "full", pieces=4, piece_size=4000)

    async def accept(raw: bytes):
        return load_manifest(raw, [kit.key.key.public_key()])

    async def main() -> None:
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session(connections=16) as s:
            m1, raw1, p1 = kit.version(MODEL, 1, "full", pieces=2, piece_size=4000)
            await upload_version(s, url, m1, raw1, p1)
            fetcher = Fetcher(s, [Source(url)], "test", stall_timeout_s=5, give_up_s=30)
            ahead = asyncio.create_task(fetcher.manifest_bytes(MODEL, 2, "full", accept, prefetch=2, wait_s=20))
            await asyncio.sleep(0.3)
            assert not ahead.done()
            await upload_version(s, url, m2, raw2, p2)
            manifest = await asyncio.wait_for(ahead, 5)
            got: dict[int, bytes] = {}

            async def keep(i: int, data: bytearray) -> None:
                got[i] = bytes(data)

            await fetcher.pieces(manifest, range(4), 2, keep)
            assert got == dict(enumerate(p2))
            m4, raw4, p4 = kit.version(MODEL, 4, "full", pieces=1, piece_size=100)
            skipped = asyncio.create_task(fetcher.manifest_bytes(MODEL, 3, "full", accept, prefetch=1, wait_s=20))
            await asyncio.sleep(0.3)
            await upload_version(s, url, m4, raw4, p4)
            t0 = time.monotonic()
            with pytest.raises(NotAnnounced):
                await skipped
            assert time.monotonic() - t0 < 2.0

    asyncio.run(main())


def test_asking_again_after_a_wait_ran_out_reuses_the_connections(kit):
    """A version asked for ahead that does not come within the wait: the piece requests end on their
    own and their connections are kept, so asking again (and the version, when it comes) does not
    start over on fresh connections in slow start."""
    _, envelope, pieces = kit.version(MODEL, 1, "full", pieces=4, piece_size=1000)
    b = Behaviour(unpublished=True)

    async def accept(raw: bytes):
        return load_manifest(raw, [kit.key.key.public_key()])

    async def main() -> None:
        async with piece_server(envelope, pieces, b) as url, client_session(connections=16) as s:
            fetcher = Fetcher(s, [Source(url)], "test", stall_timeout_s=5, give_up_s=30)
            for _ in range(3):
                with pytest.raises(NotAnnounced):
                    await fetcher.manifest_bytes(MODEL, 2, "full", accept, prefetch=4, wait_s=0.3)

    asyncio.run(main())
    assert len(b.peers) <= 5, f"{len(b.peers)} connections for 3 rounds of 5 requests"


def test_connections_opened_ahead_carry_the_manifest_and_first_pieces(kit):
    """A cold fetcher opens its connections while its first request is on its way: the manifest and
    the prefetched pieces then go out over those, and no connection is opened for them."""
    _, envelope, pieces = kit.version(MODEL, 1, "full", pieces=4, piece_size=1000)
    b = Behaviour()
    got: dict[int, bytes] = {}

    async def accept(raw: bytes):
        return load_manifest(raw, [kit.key.key.public_key()])

    async def keep(i: int, data: bytearray) -> None:
        got[i] = bytes(data)

    async def main() -> set:
        async with piece_server(envelope, pieces, b) as url, client_session(connections=16) as s:
            fetcher = Fetcher(s, [Source(url)], "test", stall_timeout_s=5, give_up_s=30)
            assert await fetcher.open_connections(5) == 5
            opened = set(b.opened)
            m = await fetcher.manifest_bytes(MODEL, 1, "full", accept, prefetch=4)
            await fetcher.pieces(m, range(len(m.pieces)), 4, keep)
            return opened

    opened = asyncio.run(main())
    assert got == dict(enumerate(pieces))
    assert len(opened) == 5, f"{len(opened)} connections opened for 5"
    assert b.peers <= opened, f"{len(b.peers - opened)} requests needed a connection of their own"


def test_opening_connections_to_a_source_that_is_down_does_not_raise():
    async def main() -> int:
        async with serving(web.Application(), "127.0.0.1:0") as url:
            pass  # the port is free again: nothing listens there
        async with client_session(connections=4) as s:
            return await Fetcher(s, [Source(url)], "test", stall_timeout_s=2).open_connections(3)

    assert asyncio.run(main()) == 0


def test_a_pool_opens_its_connections_as_it_starts(kit, tmp_path):
    """A pool's weight sync, entered, opens its parallel connections to its gateway before it has asked
    anything: the first version's requests find them up. (With its model named, a cold pool asks for
    parts of the newest version on them instead: test_fetch_parts.py.)"""
    _, envelope, pieces = kit.version(MODEL, 1, "full", pieces=2, piece_size=1000)
    b = Behaviour()
    public = save_keypair(generate_key(), tmp_path / "trainer.key")

    async def main() -> None:
        async with piece_server(envelope, pieces, b) as url:
            config = PoolSyncConfig(gateways=[url], name="p", dir=str(tmp_path / "weights"), model="",
                                    trusted_keys=[str(public)], connections=3, token="pool-token")
            async with WeightSync(config):
                deadline = time.monotonic() + 10
                while len(b.opened) < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
        assert len(b.opened) == 3, f"{len(b.opened)} connections opened for 3"

    asyncio.run(main())
