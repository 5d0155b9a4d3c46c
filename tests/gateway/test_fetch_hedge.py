"""A request that stalls at the end of a version is taken over on another connection: against a real
HTTP server on loopback that stops sending one piece's body halfway (its connection left open, as a
connection in retransmission backoff on a lossy link looks), the fetch ends within a few seconds
instead of waiting out the stall timeout, asks only for the bytes the stalled request had left, and
every piece is intact. Also the race itself (`Flights`): a request that finishes first is kept, a
failed take-over leaves the request running, and a request that fails while a take-over runs is
saved by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.hedge import Flights, TakenOver
from deltamesh.gateway.fetch.sources import Source
from deltamesh.http import client_session, parse_range, serving

MODEL = "m"
STALL_S = 30.0


@dataclass
class Stall:
    """Stall the first request for piece `index` (prefetched, whole, or its first range) after `after` bytes."""

    index: int
    after: int
    stalled: int = 0
    log: list[tuple[int, str | None, tuple]] = field(default_factory=list)
    """(piece, Range header, client end) of every piece request, in order."""
    release: asyncio.Event | None = None
    """Set once the fetch is over: the stalled answer then ends (or the server could not stop)."""


@asynccontextmanager
async def stalling_server(envelope: bytes, pieces: list[bytes], stall: Stall):
    async def manifest(request: web.Request) -> web.Response:
        return web.Response(body=envelope)

    async def piece(request: web.Request) -> web.StreamResponse:
        i = int(request.match_info["i"])
        header = request.headers.get("Range")
        stall.log.append((i, header, request.transport.get_extra_info("peername")))
        data = pieces[i]
        start, end = parse_range(header, len(data)) or (0, len(data))
        resp = web.StreamResponse(status=206 if header else 200)
        resp.content_length = end - start
        await resp.prepare(request)
        if i == stall.index and not stall.stalled:
            stall.stalled += 1
            await resp.write(data[start:start + stall.after])
            with contextlib.suppress(TimeoutError):  # the connection stays open and silent
                await asyncio.wait_for(stall.release.wait(), STALL_S)
            with contextlib.suppress(ConnectionResetError):  # the client gave up on it: as it should
                await resp.write(data[start + stall.after:end])
        else:
            await resp.write(data[start:end])
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get(f"/v1/models/{MODEL}/versions/{{v}}/{{kind}}/manifest", manifest)
    app.router.add_get(f"/v1/models/{MODEL}/versions/{{v}}/{{kind}}/pieces/{{i}}", piece)
    async with serving(app, "127.0.0.1:0") as url:
        yield url


def fetch(kit, stall: Stall, *, pieces_n: int, piece_size: int, connections: int, prefetch: int = 0,
          hedge_after_s: float = 0.5) -> tuple[list[bytes], dict[int, bytes], float]:
    _, envelope, pieces = kit.version(MODEL, 1, "full", pieces=pieces_n, piece_size=piece_size)
    got: dict[int, bytes] = {}

    async def main() -> float:
        stall.release = asyncio.Event()
        async with stalling_server(envelope, pieces, stall) as url, \
                client_session(connections=2 * connections + 4) as session:
            fetcher = Fetcher(session, [Source(url)], "test", stall_timeout_s=20, give_up_s=60,
                              hedge_after_s=hedge_after_s)

            async def accept(raw: bytes):
                return load_manifest(raw, [kit.key.key.public_key()])

            t0 = time.monotonic()
            m = await fetcher.manifest_bytes(MODEL, 1, "full", accept, prefetch=prefetch)

            async def keep(i: int, data: bytearray) -> None:
                assert i not in got, f"piece {i} handed over twice"
                got[i] = bytes(data)

            await fetcher.pieces(m, range(len(m.pieces)), connections, keep)
            seconds = time.monotonic() - t0
            stall.release.set()
            return seconds

    return pieces, got, asyncio.run(main())


def test_a_range_that_stalls_at_the_end_is_taken_over_for_what_it_had_left(kit):
    size = 1 << 20
    stall = Stall(index=3, after=100_000)
    pieces, got, seconds = fetch(kit, stall, pieces_n=4, piece_size=size, connections=8)
    assert got == dict(enumerate(pieces))
    assert seconds < 10, f"{seconds:.1f}s: the stalled request was waited for"
    asked = [(rng, peer) for i, rng, peer in stall.log if i == 3]
    first, *later = asked
    start = (parse_range(first[0], size) or (0, size))[0]
    takeover = [parse_range(rng, size) for rng, peer in later if rng and parse_range(rng, size)[0] >= start + 100_000]
    assert takeover, f"no request for the bytes the stalled one had left: {asked}"
    assert all(peer != first[1] for rng, peer in later), "asked again on the stalled connection"


def test_a_whole_piece_that_stalls_is_taken_over(kit):
    stall = Stall(index=1, after=50_000)
    pieces, got, seconds = fetch(kit, stall, pieces_n=2, piece_size=300_000, connections=2)
    assert got == dict(enumerate(pieces))
    assert seconds < 10
    ranges = [rng for i, rng, _ in stall.log if i == 1]
    assert ranges[0] is None and ranges[1] == "bytes=50000-299999", ranges


def test_a_prefetched_piece_that_stalls_is_taken_over(kit):
    stall = Stall(index=0, after=10_000)
    pieces, got, seconds = fetch(kit, stall, pieces_n=3, piece_size=200_000, connections=3, prefetch=3)
    assert got == dict(enumerate(pieces))
    assert seconds < 10
    assert [rng for i, rng, _ in stall.log if i == 0] == [None, None]  # asked again whole: its length was unknown


@pytest.mark.slow
def test_without_take_overs_the_stall_holds_the_version(kit):
    """The same stall with take-overs off (`hedge_after_s=0`): the version waits for the stalled request
    until its progress deadline drops it (the stall timeout), then fetches the rest."""
    stall = Stall(index=1, after=50_000)
    pieces, got, seconds = fetch(kit, stall, pieces_n=2, piece_size=300_000, connections=2, hedge_after_s=0)
    assert got == dict(enumerate(pieces))
    assert seconds >= 20


def _run(coro):
    return asyncio.run(coro)


def test_a_request_that_finishes_first_is_kept_and_its_take_over_cancelled():
    async def main():
        flights = Flights(after_s=0.05)
        left = [100]
        cancelled = asyncio.Event()

        async def work() -> str:
            await asyncio.sleep(0.3)  # silent long enough to be taken over
            return "own"

        async def take_over() -> str:
            try:
                await asyncio.sleep(10)
            finally:
                cancelled.set()
            return "taken"

        lane = asyncio.ensure_future(flights.hedge())
        result = await flights.race(work(), lambda: left[0], take_over, "test")
        assert await lane is True
        return result, cancelled.is_set(), flights.taken_over

    assert _run(main()) == ("own", True, 0)


def test_a_failed_take_over_leaves_the_request_running():
    async def main():
        flights = Flights(after_s=0.05)

        async def work() -> str:
            await asyncio.sleep(0.4)
            return "own"

        async def take_over() -> str:
            raise ConnectionError("refused")

        lane = asyncio.ensure_future(flights.hedge())
        result = await flights.race(work(), lambda: 100, take_over, "test")
        await lane
        return result

    assert _run(main()) == "own"


def test_a_request_that_fails_while_taken_over_is_saved_by_the_take_over():
    async def main():
        flights = Flights(after_s=0.05)

        async def work() -> str:
            await asyncio.sleep(0.3)
            raise TimeoutError("stalled")

        async def take_over() -> str:
            await asyncio.sleep(0.4)
            return "taken"

        lane = asyncio.ensure_future(flights.hedge())
        result = await flights.race(work(), lambda: 100, take_over, "test")
        await lane
        return result

    result = _run(main())
    assert isinstance(result, TakenOver) and result.value == "taken"


def test_a_request_that_moves_is_not_taken_over():
    async def main():
        flights = Flights(after_s=0.2)
        left = [1000]

        async def work() -> str:
            for _ in range(10):
                await asyncio.sleep(0.05)
                left[0] -= 10
            return "own"

        async def take_over() -> str:
            raise AssertionError("a moving request was taken over")

        lanes = [asyncio.ensure_future(flights.hedge()) for _ in range(3)]
        result = await flights.race(work(), lambda: left[0], take_over, "test")
        return result, await asyncio.gather(*lanes)

    assert _run(main()) == ("own", [False, False, False])


def test_idle_lanes_let_the_version_end_as_soon_as_its_last_request_does():
    """Lanes waiting for a stall must not hold the version's end by their polling (a quarter second
    per version, on every version, when they slept their poll out)."""
    async def main():
        flights = Flights(after_s=10.0)
        lanes = [asyncio.ensure_future(flights.hedge()) for _ in range(4)]

        async def work() -> str:
            await asyncio.sleep(0.05)
            return "own"

        async def take_over() -> str:
            raise AssertionError("nothing stalled")

        result = await flights.race(work(), lambda: 100, take_over, "test")
        t0 = time.monotonic()
        ended = await asyncio.gather(*lanes)
        return result, ended, time.monotonic() - t0

    result, ended, waited = _run(main())
    assert result == "own" and ended == [False] * 4
    assert waited < 0.05, f"the lanes ended {waited:.3f}s after the last request"


def test_the_stall_threshold_follows_the_links_round_trip(kit):
    """On loopback the requests' first bytes come within milliseconds, so a request silent for a
    fraction of a second is taken over long before the configured 8 s ceiling (which a fixed threshold
    would wait out)."""
    stall = Stall(index=3, after=100_000)
    pieces, got, seconds = fetch(kit, stall, pieces_n=4, piece_size=1 << 20, connections=8, hedge_after_s=8.0)
    assert got == dict(enumerate(pieces))
    assert seconds < 4, f"{seconds:.1f}s: the take-over waited for the 8 s ceiling"


def test_stall_after_is_two_round_trips_within_its_bounds():
    async def main() -> list[float]:
        flights = Flights(1.0)
        seen = [flights.stall_after()]
        for s in (0.3, 0.3):
            flights.note_first_byte(s)
        seen.append(flights.stall_after())  # too few samples yet: the ceiling
        flights.note_first_byte(0.3)
        seen.append(flights.stall_after())
        for _ in range(10):
            flights.note_first_byte(0.001)
        seen.append(flights.stall_after())
        for _ in range(30):
            flights.note_first_byte(2.0)
        seen.append(flights.stall_after())
        return seen

    assert asyncio.run(main()) == [1.0, 1.0, pytest.approx(0.6), 0.25, 1.0]
