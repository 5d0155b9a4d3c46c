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
from deltamesh.gateway.fetch.http_reads import Progress, Result, Span, Whole, Wrong, get_small, receive_span, receive_whole
from deltamesh.gateway.fetch.hedge import HEDGE_AFTER_S, Flights, TakenOver, race_span
from deltamesh.gateway.fetch.parts import EarlyParts, early_limit, take_parts
from deltamesh.gateway.fetch.lanes import MIN_SPAN, run_lanes  # noqa: F401 - MIN_SPAN re-exported
from deltamesh.gateway.fetch.judge import MANIFEST, FetchError, Key, SourceJudge, Turn, name
from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.fetch.sources import Source, order_sources
from deltamesh.gateway_client import PEER_HEADER, version_url
from deltamesh.http import JSON_LIMIT, HttpError, open_connections

log = logging.getLogger(__name__)

PREFETCH_LIMIT = 16 * 1024 * 1024
"""Largest piece taken before its manifest arrives (a bigger one is dropped and fetched normally): with
`prefetch` pieces asked for, a source that never ends them costs at most this much each."""
MIN_RATE_BPS = 64 * 1024.0
"""Default floor of a request's useful rate (bytes/s, after a grace of the stall timeout)."""
MIN_RATE_FRACTION = 0.05
"""Default share of a source's own measured rate below which it is dropped when an alternate exists."""
SOURCE_TRIES = 3
"""Default number of served-something-wrong failures after which a source is not asked for a piece again."""


Inline = tuple[Source, bytes]
"""A manifest envelope that came inline in a source's head answer, and that source."""


class NotAnnounced(FetchError):
    """A version asked for ahead (`manifest_bytes(wait_s=...)`) was not announced within the wait,
    or a newer one was announced instead."""


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefetch failed: %r", task.exception())


@dataclass
class Fetcher:
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

    # -- judging sources -------------------------------------------------------------------------
    def _rule(self, source: Source, alternates: bool, wait_s: float = 0.0) -> Progress:
        """The progress deadline of a request to `source`: the floor, or a share of the source's own
        rate when another source could take over."""
        rate = self.min_rate_bps
        if alternates and source.rate_bps:
            rate = max(rate, self.min_rate_fraction * source.rate_bps)
        return Progress(self.stall_timeout_s + wait_s, self.stall_timeout_s, rate)

    def _rejected(self, source: Source, key: Key, error: CodecError) -> None:
        """A manifest that `accept` refused (malformed or badly signed): that source is not to be believed."""
        self._judge.tries(key, MANIFEST).exclude(source, f"manifest rejected: {error}")
        self._judge.note(source, f"{name(key)} manifest rejected: {error}")
        if self.on_rejected is not None:
            self.on_rejected(source, key, error)

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

    # -- manifests ---------------------------------------------------------------------------------
    async def manifest_bytes(self, model: str, version: int, kind: str, accept: Callable[[bytes], Awaitable[object]],
                             *, prefetch: int = 0, wait_s: float = 0.0, inline: Inline | None = None):
        """Fetch a manifest envelope and pass it to `accept` (which verifies it); try each source in turn.

        With `inline` (the envelope a source's head answer carried), that one is tried first, with
        no request; a source whose inline envelope `accept` refuses is booked as for a served one
        (`on_rejected`) and the manifest is fetched as usual, from the others first.

        With `prefetch`, pieces 0 .. prefetch-1 are requested at the same time from the preferred
        source; the next `pieces()` call of this version takes them (after checking them). With
        `wait_s`, the version may not be announced yet: the requests wait at the preferred source
        until it is (so its first pieces leave the moment it lands there), and NotAnnounced is raised
        when it was not within `wait_s`, or when a newer version came first.
        """
        key = (model, version, kind)
        if inline is not None:
            try:
                return await accept(inline[1])
            except CodecError as e:
                self._rejected(inline[0], key, e)
        self._discard_prefetch(key)
        if prefetch > 0:
            self._early[key] = {i: asyncio.create_task(self._prefetch(key, i, wait_s)) for i in range(prefetch)}
            for task in self._early[key].values():
                task.add_done_callback(_retrieved)  # one discarded after it failed must not log a warning
            # Let the piece requests take their connections first: from a session that reuses the
            # newest idle connection first, the first piece gets the one the last version's warmed.
            await asyncio.sleep(0)
        try:
            if wait_s > 0:
                return await self._next_manifest(key, accept, wait_s)
            return await self._manifest(key, accept)
        except NotAnnounced:
            await self._settle_prefetch(key)
            raise
        except BaseException:
            self._discard_prefetch(key)
            self._judge.clear_suspects(key)
            raise
        finally:
            self._judge.forget_manifest(key)

    def _discard_prefetch(self, key: Key) -> None:
        """Cancel prefetched pieces of one version that no `pieces()` call took."""
        self._arrived.pop(key, None)
        for task in self._early.pop(key, {}).values():
            task.cancel()

    async def _settle_prefetch(self, key: Key) -> None:
        """Let the piece requests of a version that was not announced end on their own: their waits
        end with the manifest's, within moments. Cancelling them would close their connections, and
        the next version would then start on fresh ones, in slow start."""
        tasks = list(self._early.pop(key, {}).values())
        self._arrived.pop(key, None)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.stall_timeout_s)
            for task in late:
                task.cancel()

    async def _next_manifest(self, key: Key, accept: Callable[[bytes], Awaitable[object]], wait_s: float):
        """The manifest of a version asked for ahead, from the preferred source (a long poll); the
        usual path with failover takes over if that source fails."""
        source = self._judge.order(key)[0]
        url = f"{version_url(source.url, *key)}/manifest"
        try:
            raw = await get_small(self.wait_session or self.session, url, params={"wait": wait_s},
                                  headers={PEER_HEADER: self.peer}, rule=self._rule(source, False, wait_s),
                                  limit=JSON_LIMIT)
        except HttpError as e:
            if e.status == 404:
                raise NotAnnounced(f"{name(key)} was not announced within {wait_s:g}s") from None
            self._judge.note(source, f"{name(key)} manifest: {e}", penalty=e.status == 0 or e.status >= 500)
            return await self._manifest(key, accept)
        except Wrong as e:
            self._judge.failed(source, key, MANIFEST, str(e), wrong=True)
            return await self._manifest(key, accept)
        try:
            return await accept(raw)
        except CodecError as e:
            self._rejected(source, key, e)
            return await self._manifest(key, accept)

    async def _manifest(self, key: Key, accept: Callable[[bytes], Awaitable[object]]):
        started = time.monotonic()

        async def ask(source: Source, alternates: bool):
            url = f"{version_url(source.url, *key)}/manifest"
            if source.delay_s:
                await asyncio.sleep(source.delay_s)
            try:
                raw = await get_small(self.session, url, headers={PEER_HEADER: self.peer},
                                      rule=self._rule(source, alternates), limit=JSON_LIMIT)
                return await accept(raw)
            except HttpError as e:
                if e.status in (404, 503) and time.monotonic() - started < self.stall_timeout_s:
                    return Turn.WAIT  # the preferred source has not got it yet (503: on its way)
                self._judge.tries(key, MANIFEST).failed(source, f"HTTP {e.status or 'unreachable'} {e.reason}",
                                                        wrong=False, rng=self._judge.rng)
                self._judge.note(source, f"{name(key)} manifest: {e}",
                                 penalty=e.status == 0 or (e.status >= 500 and e.status != 503))
            except Wrong as e:
                self._judge.failed(source, key, MANIFEST, str(e), wrong=True)
            except CodecError as e:
                self._rejected(source, key, e)
            return Turn.FAILED

        def timed_out() -> str:
            return (f"{name(key)}: no source served a valid manifest within {self.give_up_s:.0f}s "
                    f"({self._judge.tries(key, MANIFEST).describe()})")

        return await self._judge.rounds(key, MANIFEST, started + self.give_up_s, ask,
                                        f"{name(key)}: no source served a valid manifest", timed_out)

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

    async def _received(self, source: Source, key: Key | None, nbytes: int) -> None:
        """Book bytes that just arrived: the source's bandwidth cap, then the progress hooks (those of a
        known version: parts come before it is known, `key` None)."""
        if source.limiter is not None:
            await source.limiter.take(nbytes)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)
        if self.on_received is not None and key is not None:
            self.on_received(source, key, nbytes)

    def _booked(self, source: Source, nbytes: int, seconds: float) -> None:
        if self.monitor is not None and source.link is not None and nbytes:
            self.monitor.record_transfer(source.link, nbytes, seconds)

    async def _prefetch(self, key: Key, index: int, wait_s: float) -> tuple[Source, Whole]:
        """Piece `index` of a version whose manifest is not here yet, from the preferred source; what
        came (`Whole`) is checked by `pieces()`, which fetches the rest the usual way."""
        source = self._judge.order(key)[0]
        url = f"{version_url(source.url, *key)}/pieces/{index}"
        if source.delay_s:
            await asyncio.sleep(source.delay_s)

        arrived = self._arrived.setdefault(key, {})

        async def on_chunk(n: int) -> None:
            arrived[index] = arrived.get(index, 0) + n
            await self._received(source, key, n)

        got = await receive_whole(self.wait_session or self.session, url, {"wait": wait_s} if wait_s > 0 else None,
                                  {PEER_HEADER: self.peer}, self._rule(source, False, wait_s), PREFETCH_LIMIT, on_chunk)
        self._booked(source, len(got.data), got.seconds)  # the link's throughput, not the wait for the version
        if got.outcome == "done":
            source.served(len(got.data), got.seconds)
        return source, got

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

        async def on_chunk(n: int) -> None:
            await self._received(source, key, n)

        rule = self._rule(source, alternates)
        if self._slots is None:
            result = await receive_span(self.session, url, headers, span, rule, on_chunk)
        else:
            async with self._slots:
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
