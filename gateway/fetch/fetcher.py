"""Fetching a version's pieces from gateways: parallel, ranged, verified, failing over between sources,
and bounded when those sources are slow or hostile.

Relays (mirroring their upstreams) and pool agents (pulling a plan) fetch the same way. Each piece
comes over its own request from the best source; what arrived is kept when a source dies, stalls or
falls below the minimum useful rate (the progress deadline of `deltamesh.gateway.fetch.http_reads`), and
the next source is asked only for the rest (HTTP Range). The last pieces of a version are split into
ranges over all connections, so they finish together (`deltamesh.gateway.fetch.lanes`), and a request
that stalls there is taken over by a connection with nothing left to do (`deltamesh.gateway.fetch.hedge`),
so one connection backing off on a lossy link does not hold the version. A piece is
accepted only when its length and digest (BLAKE3-256) match the (signed) manifest. A source that served
something wrong is penalised for the version and for a while, asked again only after a backoff, and
dropped for a piece after `source_tries` such failures; a piece that no source serves intact fails
the version with one FetchError naming the piece and what each source did
(`deltamesh.gateway.fetch.judge`, `deltamesh.gateway.fetch.scoring`). A piece announced but not yet arrived at a source (503) is asked again.

The manifest request can carry the first wave of piece requests with it (`prefetch`), so data flows
one round trip after the version is known instead of two; those pieces are held unverified until
the manifest is, then checked like any other. A manifest that came inline in a head answer
(`inline`) needs no request at all. A cold fetcher opens its connections beside its first request
(`open_connections`), so the pieces leave one round trip sooner; or, before it even knows the version,
asks for parts of the newest one on them (`ask_parts`, `deltamesh.gateway.fetch.parts`), which
`pieces()` takes once the manifest is verified."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

import aiohttp

from deltamesh.delta.errors import CodecError, CorruptError
from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.fetch.hedge import HEDGE_AFTER_S, Flights, TakenOver, race_span
from deltamesh.gateway.fetch.http_reads import Result, Span, receive_span
from deltamesh.gateway.fetch.judge import FetchError, Key, SourceJudge, Turn, name
from deltamesh.gateway.fetch.lanes import MIN_SPAN, run_lanes  # noqa: F401 - MIN_SPAN re-exported
from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.fetch.manifests import Inline, ManifestFetch, NotAnnounced  # noqa: F401 - re-exported
from deltamesh.gateway.fetch.parts import EarlyParts, early_limit, take_parts
from deltamesh.gateway.fetch.sources import Source, order_sources
from deltamesh.gateway_client import PEER_HEADER, version_url
from deltamesh.http import open_connections

log = logging.getLogger(__name__)

MIN_RATE_BPS = 64 * 1024.0
"""Default floor of a request's useful rate (bytes/s, after a grace of the stall timeout)."""
MIN_RATE_FRACTION = 0.05
"""Default share of a source's own measured rate below which it is dropped when an alternate exists."""
SOURCE_TRIES = 3
"""Default number of served-something-wrong failures after which a source is not asked for a piece again."""


@dataclass
class Fetcher(ManifestFetch):
    """Fetches pieces of signed manifests from a list of sources."""

    session: aiohttp.ClientSession
    sources: Sequence[Source]
    peer: str
    monitor: LinkMonitor | None = None
    stall_timeout_s: float = 20.0
    """No answer (or no byte) for this long is a stall; it is also the credit before `min_rate_bps` applies."""
    give_up_s: float = 120.0
    """Longest a piece (or manifest) may stay unavailable (unreachable sources, not arrived) before FetchError."""
    penalty_s: float = 5.0
    """First penalty of a failing source; it doubles with each failure in a row."""
    min_rate_bps: float = MIN_RATE_BPS
    min_rate_fraction: float = MIN_RATE_FRACTION
    source_tries: int = SOURCE_TRIES
    wait_session: aiohttp.ClientSession | None = None
    """Session of the requests that wait at a source for a version not announced yet: kept apart (when
    given) so that such long polls never hold the connections transfers need."""
    max_requests: int = 0
    """Most piece requests in flight at once (0: no bound); set to what `session` can carry, so a request
    never queues for a connection while its progress deadline runs."""
    hedge_after_s: float = HEDGE_AFTER_S
    """At a version's end, a request that moved no byte for this long is taken over by an idle connection
    (0: never)."""
    on_bytes: Callable[[int], None] | None = None
    on_received: Callable[[Source, Key, int], None] | None = None
    """Told of piece bytes as they arrive: from which source, for which (model, version, kind)."""
    on_rejected: Callable[[Source, Key, CodecError], None] | None = None
    """Told of each manifest a source served that `accept` refused, and why (a pool books refusals per gateway)."""
    _early: dict[Key, dict[int, asyncio.Task]] = field(default_factory=dict, init=False, repr=False)
    _judge: SourceJudge = field(init=False, repr=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False, repr=False)
    _flights: dict[Key, Flights] = field(default_factory=dict, init=False, repr=False)
    _arrived: dict[Key, dict[int, int]] = field(default_factory=dict, init=False, repr=False)
    """Bytes of each prefetched piece that have arrived (how a stalled one is told from a moving one)."""

    def __post_init__(self) -> None:
        self._judge = SourceJudge(self.sources, self.penalty_s, self.source_tries, self.monitor)
        if self.max_requests > 0:
            self._slots = asyncio.Semaphore(self.max_requests)

    async def open_connections(self, count: int) -> int:
        """Open `count` connections to the preferred source in each session piece requests use, beside
        a cold fetcher's first request (`deltamesh.http.open_connections`); the fewest that answered."""
        url = f"{order_sources(self.sources)[0].url.rstrip('/')}/healthz" if self.sources else ""
        sessions = {id(s): s for s in (self.session, self.wait_session) if s is not None and url}
        return min(await asyncio.gather(*(open_connections(s, url, count, headers={PEER_HEADER: self.peer},
                                                           timeout_s=self.stall_timeout_s)
                                          for s in sessions.values())), default=0)

    def ask_parts(self, model: str, kind: str, of: int) -> EarlyParts:
        """Ask the preferred source at once for `of` parts of the newest `kind` it holds whole, before the
        version is known (`deltamesh.gateway.fetch.parts`); `pieces(..., parts=...)` takes them."""
        source = order_sources(self.sources)[0]

        async def on_chunk(n: int) -> None:
            await self._received(source, None, n)

        return EarlyParts.ask(self.session, source, self.peer, model, kind, of, self._rule(source, False),
                              early_limit(of), on_chunk)

    # -- pieces ------------------------------------------------------------------------------------
    async def piece(self, manifest: Manifest, index: int, prefix: bytes = b"",
                    prefix_source: Source | None = None, hedged: bool = True) -> bytearray:
        """One verified piece, resuming across sources with Range requests (from `prefix`, the bytes that
        `prefix_source` already delivered, if any); `hedged` as for `_fill`."""
        key = (manifest.model_id, manifest.version, manifest.kind)
        data = bytearray(manifest.pieces[index].length)
        span = Span(data, 0, len(data))
        if prefix and prefix_source is not None and len(prefix) < len(data):
            data[:len(prefix)] = prefix
            span.filled = len(prefix)
            span.sources.append(prefix_source)
        deadline = time.monotonic() + self.give_up_s
        while True:
            await self._fill(manifest, index, span, deadline, hedged)
            try:
                manifest.check_piece(index, data)
                return data
            except CorruptError as e:
                for source in span.sources:  # which of them sent the bad bytes is unknown: all are suspects
                    self._judge.served_bad(source, key, index, f"bad bytes ({e})")
                span = Span(data, 0, len(data))
                if time.monotonic() > deadline:
                    raise FetchError(f"piece {index} of {name(key)}: no source served it intact within "
                                     f"{self.give_up_s:.0f}s ({self._judge.tries(key, index).describe()})") from e

    async def _fill(self, manifest: Manifest, index: int, span: Span, deadline: float, hedged: bool = True) -> None:
        """Receive `span` of a piece into its buffer from the best source that has it, continuing from
        another source (with what arrived) when one fails; at a version's end, a stalled request is
        taken over on another connection (unless not `hedged`: a take-over itself)."""
        key = (manifest.model_id, manifest.version, manifest.kind)
        pending_since: float | None = None

        async def ask(source: Source, alternates: bool):
            nonlocal pending_since
            result = await self._try(source, manifest, index, span, alternates)
            if result.outcome == "done":
                return result
            if result.outcome in ("pending", "missing"):
                # Not there yet (not arrived, or the version not even announced there): wait for
                # the preferred source, which is about to get it, unless it has kept us waiting
                # for longer than a stall; then ask the others too.
                pending_since = pending_since or time.monotonic()
                return Turn.WAIT if time.monotonic() - pending_since < self.stall_timeout_s else Turn.NOT_YET
            self._judge.failed(source, key, index, result.reason, wrong=result.outcome == "wrong")
            return Turn.FAILED

        def timed_out() -> str:
            return (f"piece {index} of {name(key)}: no source delivered bytes {span.start}-{span.end} "
                    f"within {self.give_up_s:.0f}s ({span.filled - span.start} arrived; "
                    f"{self._judge.tries(key, index).describe()})")

        work = self._judge.rounds(key, index, deadline, ask, f"piece {index} of {name(key)}: no source served it intact",
                                  timed_out)
        flights = self._flights.get(key) if hedged else None
        if flights is None:
            await work
            return
        await race_span(flights, work, span, lambda twin: self._fill(manifest, index, twin, deadline, False),
                        f"piece {index} of {name(key)} (bytes {span.start}-{span.end})")

    async def _try(self, source: Source, manifest: Manifest, index: int, span: Span, alternates: bool) -> Result:
        """One request for the rest of a span (see `deltamesh.gateway.fetch.http_reads.receive_span`)."""
        key = (manifest.model_id, manifest.version, manifest.kind)
        headers = {PEER_HEADER: self.peer}
        if not (span.whole and span.filled == 0):
            headers["Range"] = f"bytes={span.filled}-{span.end - 1}"
            # Only the bytes of this very piece may continue it: any other answers whole (200).
            headers["If-Range"] = f'"{manifest.pieces[index].hash}"'
        url = f"{version_url(source.url, *key)}/pieces/{index}"
        if source.delay_s:
            await asyncio.sleep(source.delay_s)

        flights = self._flights.get(key)
        asked = 0.0

        async def on_chunk(n: int) -> None:
            nonlocal asked
            if asked and flights is not None:  # the link's round trip, as the stall threshold's measure
                flights.note_first_byte(time.monotonic() - asked)
            asked = 0.0
            await self._received(source, key, n)

        rule = self._rule(source, alternates)
        if self._slots is None:
            asked = time.monotonic()
            result = await receive_span(self.session, url, headers, span, rule, on_chunk)
        else:
            async with self._slots:
                asked = time.monotonic()
                result = await receive_span(self.session, url, headers, span, rule, on_chunk)
        if result.received and source not in span.sources:
            span.sources.append(source)
        self._booked(source, result.received, result.seconds)
        if result.outcome == "done":
            source.served(result.received, result.seconds)
        return result

    async def pieces(self, manifest: Manifest, indices: Iterable[int], connections: int,
                     on_piece: Callable[[int, bytearray], Awaitable[None]], parts: EarlyParts | None = None) -> None:
        """Fetch `indices` with `connections` parallel requests (spread as `deltamesh.gateway.fetch.lanes`
        says), handing each verified piece to `on_piece`. Pieces prefetched with the manifest
        (`manifest_bytes(prefetch=...)`) are taken first, checked like any other; a bad one is fetched
        again the usual way, and one that broke off continues from what arrived. With `parts` (asked
        for before the version was known, `ask_parts`), the pieces they fill are taken from them, and
        only the rest is asked for."""
        key = (manifest.model_id, manifest.version, manifest.kind)
        order = list(indices)
        early = self._early.pop(key, {})
        arrived = self._arrived.get(key, {})
        flights = Flights(self.hedge_after_s) if self.hedge_after_s > 0 else None
        if flights is not None:
            self._flights[key] = flights

        async def whole(i: int) -> bytearray:
            task = early.pop(i, None)
            if task is None:
                return await self.piece(manifest, i)
            # A prefetched piece that stalls is taken over like any other request.
            came = await (task if flights is None else flights.race(
                task, lambda: manifest.pieces[i].length - arrived.get(i, 0),
                lambda: self.piece(manifest, i, hedged=False), f"prefetched piece {i} of {name(key)}"))
            if isinstance(came, TakenOver):
                return came.value
            source, got = came
            if got.outcome == "done":
                try:
                    manifest.check_piece(i, got.data)
                    return bytearray(got.data)
                except CorruptError as e:
                    self._judge.served_bad(source, key, i, f"bad prefetched bytes ({e})")
            elif got.outcome == "wrong":
                self._judge.failed(source, key, i, got.reason, wrong=True)
                return await self.piece(manifest, i, got.data, source)
            return await self.piece(manifest, i)

        async def fill_range(i: int, span: Span) -> None:
            await self._fill(manifest, i, span, time.monotonic() + self.give_up_s)

        async def assembled_bad(i: int, senders: list[Source], error: CorruptError) -> bytearray:
            for source in senders:  # which range was bad is unknown: every sender is a suspect
                self._judge.served_bad(source, key, i, f"bad bytes in a range ({error})")
            return await self.piece(manifest, i)

        try:
            if parts is not None:
                order = await take_parts(parts, manifest, order, on_piece, self._judge)
            for i in set(early) - set(order):
                early.pop(i).cancel()
            await run_lanes(manifest, sorted(order, key=lambda i: i not in early), connections, set(early),
                            whole=whole, fill_range=fill_range, assembled_bad=assembled_bad, on_piece=on_piece,
                            hedge=flights.hedge if flights is not None else None)
        finally:
            if parts is not None:
                await parts.close()
            for task in early.values():
                task.cancel()
            await asyncio.gather(*early.values(), return_exceptions=True)
            self._judge.forget(key)
            self._arrived.pop(key, None)
            if self._flights.get(key) is flights:
                self._flights.pop(key, None)
