"""Spreading one version's pieces over parallel connections so that they all finish together.

Each request asks for at most 1/`connections` of the bytes not yet asked for (and at least
`MIN_SPAN`): whole pieces while much is left, and at the end the last pieces split into ranges over
every connection, so that they all finish together instead of a few connections carrying the last
whole pieces while the others sit idle. With more connections than pieces (many connections fill a
long link sooner from a cold start, each starting at 10 segments), every piece is cut up front into
its share of the connections (`first_spans`), so that each connection has a part in the first round
trip and none waits for a second. No byte is requested twice while any is left to ask for; a lane
with nothing left may take over a stalled request (`hedge`, `deltamesh.gateway.fetch.hedge`). How one
piece or range is fetched (sources, deadlines, verification) is the caller's:
`deltamesh.gateway.fetch.fetcher.Fetcher.pieces`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Callable, Collection, Sequence

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.fetch.http_reads import Span

MIN_SPAN = 1024 * 1024
"""Smallest range of a piece a request asks for when the last pieces are split over the connections:
about one connection's share of a long link's bytes in flight, so splitting never starves them."""

MIN_PART = 256 * 1024
"""Smallest part a piece is cut into up front (`first_spans`): a request's round trip and headers stay
small next to its bytes."""


async def run_lanes(
    manifest: Manifest,
    order: Sequence[int],
    connections: int,
    whole_first: Collection[int],
    *,
    whole: Callable[[int], Awaitable[bytearray]],
    fill_range: Callable[[int, Span], Awaitable[None]],
    assembled_bad: Callable[[int, list, CorruptError], Awaitable[bytearray]],
    on_piece: Callable[[int, bytearray], Awaitable[None]],
    hedge: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Fetch the pieces `order` names over `connections` lanes: `whole(i)` a verified whole piece (always
    for those in `whole_first`, already on their way), `fill_range(i, span)` one range of a split piece;
    a split piece that fails its hash once assembled goes to `assembled_bad(i, senders, error)`, which
    returns it fetched again. Every verified piece goes to `on_piece`. A lane with nothing left to ask
    for calls `hedge()` until it returns False (it may take over a stalled request meanwhile)."""
    unasked = sum(manifest.pieces[i].length for i in order)
    todo = deque(first_spans(manifest, order, connections, whole_first))
    lanes = max(1, min(connections, max(len(todo), -(-unasked // MIN_SPAN))))  # every first span at once
    split: dict[int, tuple[bytearray, list[int], list]] = {}  # piece -> (buffer, [bytes to come], senders)

    async def part(i: int, start: int, end: int) -> bytearray | None:
        """Receive one range of a split piece; the piece once its last range is in, else None."""
        length = manifest.pieces[i].length
        data, left, senders = split.setdefault(i, (bytearray(length), [length], []))
        span = Span(data, start, end)
        await fill_range(i, span)
        senders.extend(s for s in span.sources if s not in senders)
        left[0] -= end - start
        if left[0]:
            return None
        del split[i]
        try:
            manifest.check_piece(i, data)
            return data
        except CorruptError as e:
            return await assembled_bad(i, senders, e)

    async def worker() -> None:
        nonlocal unasked
        while todo:
            i, start, end = todo.popleft()
            share = max(MIN_SPAN, -(-unasked // lanes))
            if start == 0 and end == manifest.pieces[i].length and (i in whole_first or end <= share + MIN_SPAN // 2):
                unasked -= end
                await on_piece(i, await whole(i))
                continue
            if end - start > share + MIN_SPAN // 2:  # leave the rest for the next free connection
                todo.appendleft((i, start + share, end))
                end = start + share
            unasked -= end - start
            data = await part(i, start, end)
            if data is not None:
                await on_piece(i, data)
        while hedge is not None and await hedge():
            pass

    await run_lanes_of(worker, lanes)


def first_spans(manifest: Manifest, order: Sequence[int], connections: int,
                whole_first: Collection[int]) -> list[tuple[int, int, int]]:
    """(piece, start, end) of the first requests, in `order`: whole pieces, or with more connections
    than pieces each piece not in `whole_first` cut into equal parts, as many as its share of the
    connections left (at least `MIN_PART` bytes each), so that there are no more parts than
    connections."""
    cuttable = [i for i in order if i not in whole_first]
    cut = sum(manifest.pieces[i].length for i in cuttable)
    spare = connections - (len(order) - len(cuttable))
    spans = []
    for i in order:
        length, parts = manifest.pieces[i].length, 1
        if i not in whole_first and spare > len(cuttable):
            parts = max(1, min(length // MIN_PART, spare * length // cut))
        edges = [length * k // parts for k in range(parts + 1)]
        spans.extend((i, a, b) for a, b in zip(edges, edges[1:]))
    return spans


async def run_lanes_of(worker: Callable[[], Awaitable[None]], lanes: int) -> None:
    """Run `lanes` copies of `worker` at once; the first failure cancels the others (and is raised)
    once all have ended, so no lane is left running behind its caller."""
    workers = [asyncio.create_task(worker()) for _ in range(lanes)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
