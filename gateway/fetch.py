"""Fetching a version's pieces from gateways: parallel, ranged, verified, failing over between sources.

Both a relay (mirroring its upstreams) and a pool agent (pulling a plan) fetch pieces the same way.
Each piece is fetched over its own request from the first healthy source; bytes already received
are kept when a source dies or stalls, and the next source is asked only for the rest (HTTP Range),
so a switch of source never refetches what arrived. The last pieces of a version are split into
ranges over all connections, so they finish together (see `Fetcher.pieces`). A piece is accepted
only when its length and xxh3-128 match the (signed) manifest; a source that serves a bad piece is
penalised and the piece is fetched again. A piece a source has announced but not yet received (503)
is simply asked for again.

The manifest request can carry the first wave of piece requests with it (`prefetch`), so data
flows one round trip after the version is known instead of two; those pieces are held unverified
until the manifest is, then checked like any other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

import aiohttp

from deltamesh.delta.errors import CodecError, CorruptError
from deltamesh.delta.manifest import Manifest
from deltamesh.http import HttpError, request_bytes
from deltamesh.gateway.links import PEER_HEADER, LinkMonitor
from deltamesh.gateway.sources import Source, order_sources, version_url

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
MIN_SPAN = 1024 * 1024
"""Smallest range of a piece a request asks for when the last pieces are split over the connections:
about one connection's share of a long link's bytes in flight, so splitting never starves them."""
PREFETCH_LIMIT = 64 * 1024 * 1024
"""Largest piece taken before its manifest arrives (a bigger one is dropped and fetched normally)."""


class FetchError(Exception):
    """No source delivered a piece (or manifest) before the deadline."""


class NotAnnounced(FetchError):
    """A version asked for ahead (`manifest_bytes(wait_s=...)`) was not announced within the wait,
    or a newer one was announced instead."""


@dataclass
class _Span:
    """Bytes [start, end) of a piece being received into the piece's buffer; `filled` is how far
    they have arrived. A whole piece is one span; the tail of a version splits pieces into several."""

    data: bytearray
    start: int
    end: int
    filled: int = field(init=False)

    def __post_init__(self) -> None:
        self.filled = self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == len(self.data)


@dataclass
class Fetcher:
    """Fetches pieces of signed manifests from a list of sources."""

    session: aiohttp.ClientSession
    sources: Sequence[Source]
    peer: str
    monitor: LinkMonitor | None = None
    stall_timeout_s: float = 20.0
    give_up_s: float = 120.0
    penalty_s: float = 5.0
    on_bytes: Callable[[int], None] | None = None
    _early: dict[tuple[str, int, str], dict[int, asyncio.Task]] = field(default_factory=dict, init=False, repr=False)

    def _fail(self, source: Source, reason: str, penalty: bool = True) -> None:
        if penalty:
            source.bad_until = time.monotonic() + self.penalty_s
        if self.monitor is not None and source.link is not None:
            self.monitor.record_error(source.link, reason)
        log.info("fetch from %s: %s", source.url, reason)

    async def manifest_bytes(self, model: str, version: int, kind: str, accept: Callable[[bytes], Awaitable[object]],
                             *, prefetch: int = 0, wait_s: float = 0.0):
        """Fetch a manifest envelope and pass it to `accept` (which verifies it); try each source in turn.

        With `prefetch`, pieces 0 .. prefetch-1 are requested at the same time from the preferred
        source; the next `pieces()` call of this version takes them (after checking them). With
        `wait_s`, the version may not be announced yet: the requests wait at the preferred source
        until it is (so its first pieces leave the moment it lands there), and NotAnnounced is raised
        when it was not within `wait_s`, or when a newer version came first.
        """
        key = (model, version, kind)
        self._discard_prefetch(key)
        if prefetch > 0:
            self._early[key] = {i: asyncio.create_task(self._prefetch(model, version, kind, i, wait_s))
                                for i in range(prefetch)}
        try:
            if wait_s > 0:
                return await self._next_manifest(model, version, kind, accept, wait_s)
            return await self._manifest(model, version, kind, accept)
        except NotAnnounced:
            await self._settle_prefetch(key)
            raise
        except BaseException:
            self._discard_prefetch(key)
            raise

    def _discard_prefetch(self, key: tuple[str, int, str]) -> None:
        """Cancel prefetched pieces of one version that no `pieces()` call took."""
        for task in self._early.pop(key, {}).values():
            task.cancel()

    async def _settle_prefetch(self, key: tuple[str, int, str]) -> None:
        """Let the piece requests of a version that was not announced end on their own: their waits
        end with the manifest's, within moments. Cancelling them would close their connections, and
        the next version would then start on fresh ones, in slow start."""
        tasks = list(self._early.pop(key, {}).values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.stall_timeout_s)
            for task in late:
                task.cancel()

    async def _next_manifest(self, model: str, version: int, kind: str, accept: Callable[[bytes], Awaitable[object]],
                             wait_s: float):
        """The manifest of a version asked for ahead, from the preferred source (a long poll); the
        usual path with failover takes over if that source fails."""
        source = order_sources(self.sources)[0]
        url = f"{version_url(source.url, model, version, kind)}/manifest"
        try:
            raw = await request_bytes(self.session, "GET", url, params={"wait": wait_s},
                                      headers={PEER_HEADER: self.peer}, timeout_s=wait_s + self.stall_timeout_s)
        except HttpError as e:
            if e.status == 404:
                raise NotAnnounced(f"{model} v{version} {kind} was not announced within {wait_s:g}s") from None
            self._fail(source, f"manifest: {e}", penalty=e.status == 0 or e.status >= 500)
            return await self._manifest(model, version, kind, accept)
        return await accept(raw)

    async def _manifest(self, model: str, version: int, kind: str, accept: Callable[[bytes], Awaitable[object]]):
        deadline = time.monotonic() + self.give_up_s
        started = time.monotonic()
        rejected: dict[str, str] = {}
        attempt = 0
        while True:
            for source in order_sources(self.sources):
                url = f"{version_url(source.url, model, version, kind)}/manifest"
                if source.delay_s:
                    await asyncio.sleep(source.delay_s)
                try:
                    raw = await request_bytes(self.session, "GET", url, headers={PEER_HEADER: self.peer},
                                              timeout_s=self.stall_timeout_s)
                    return await accept(raw)
                except HttpError as e:
                    if e.status == 404 and time.monotonic() - started < self.stall_timeout_s:
                        break  # the preferred source has not got it yet; give it a moment (see `piece`)
                    self._fail(source, f"manifest: {e}", penalty=e.status == 0 or e.status >= 500)
                except CodecError as e:  # malformed or badly signed: that source is not to be believed
                    self._fail(source, f"manifest rejected: {e}")
                    rejected[source.url] = str(e)
                    if len(rejected) == len(self.sources):
                        raise FetchError(f"{model} v{version} {kind}: no source served a valid manifest "
                                         f"({'; '.join(sorted(set(rejected.values())))})") from e
            attempt += 1
            if time.monotonic() > deadline:
                raise FetchError(f"{model} v{version} {kind}: no source served a valid manifest")
            await asyncio.sleep(min(0.02 * 2 ** min(attempt, 6), 0.25))

    async def piece(self, manifest: Manifest, index: int) -> bytearray:
        """One verified piece, resuming across sources with Range requests."""
        data = bytearray(manifest.pieces[index].length)
        deadline = time.monotonic() + self.give_up_s
        while True:
            source = await self._fill(manifest, index, _Span(data, 0, len(data)), deadline)
            try:
                manifest.check_piece(index, data)
                return data
            except CorruptError as e:
                self._fail(source, f"served a bad piece {index}: {e}")
                if time.monotonic() > deadline:
                    raise FetchError(f"piece {index} of {manifest.model_id} v{manifest.version} {manifest.kind}: "
                                     f"no source served it intact within {self.give_up_s:.0f}s") from e

    async def _fill(self, manifest: Manifest, index: int, span: _Span, deadline: float) -> Source:
        """Receive `span` of a piece into its buffer from the first source that has it, continuing
        from another source (with what arrived) when one fails; returns the source that finished it."""
        pending_since: float | None = None
        attempt = 0
        while True:
            for source in order_sources(self.sources):
                outcome = await self._try(source, manifest, index, span)
                if outcome == "done":
                    return source
                if outcome in ("pending", "missing"):
                    # Not there yet (not arrived, or the version not even announced there): wait for
                    # the preferred source, which is about to get it, unless it has kept us waiting
                    # for longer than a stall; then ask the others too.
                    pending_since = pending_since or time.monotonic()
                    if time.monotonic() - pending_since < self.stall_timeout_s:
                        break
            attempt += 1
            if time.monotonic() > deadline:
                raise FetchError(f"piece {index} of {manifest.model_id} v{manifest.version} {manifest.kind}: "
                                 f"no source delivered bytes {span.start}-{span.end} within {self.give_up_s:.0f}s "
                                 f"({span.filled - span.start} arrived)")
            await asyncio.sleep(min(0.02 * 2 ** min(attempt, 6), 0.25))

    async def _received(self, source: Source, nbytes: int) -> None:
        """Book bytes that just arrived: the source's bandwidth cap, then the progress hook."""
        if source.limiter is not None:
            await source.limiter.take(nbytes)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)

    async def _prefetch(self, model: str, version: int, kind: str, index: int, wait_s: float) -> bytes | None:
        """Piece `index` of a version whose manifest is not here yet, from the preferred source; None
        when it does not come in one go (the normal path then fetches it, with failover)."""
        source = order_sources(self.sources)[0]
        url = f"{version_url(source.url, model, version, kind)}/pieces/{index}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall_timeout_s,
                                        sock_read=self.stall_timeout_s + wait_s)
        if source.delay_s:
            await asyncio.sleep(source.delay_s)
        chunks, size = [], 0
        params = {"wait": wait_s} if wait_s > 0 else None
        try:
            async with self.session.get(url, params=params, headers={PEER_HEADER: self.peer}, timeout=timeout) as resp:
                t0 = time.perf_counter()  # the link's throughput, not how long the version was waited for
                if resp.status != 200:
                    await resp.read()
                    return None
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > PREFETCH_LIMIT:
                        return None
                    chunks.append(chunk)
                    await self._received(source, len(chunk))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        if self.monitor is not None and source.link is not None and size:
            self.monitor.record_transfer(source.link, size, time.perf_counter() - t0)
        return b"".join(chunks)

    async def _try(self, source: Source, manifest: Manifest, index: int, span: _Span) -> str:
        """One request for the rest of a span; returns 'done', 'pending', 'missing' or 'failed'."""
        headers = {PEER_HEADER: self.peer}
        if not (span.whole and span.filled == 0):
            headers["Range"] = f"bytes={span.filled}-{span.end - 1}"
        url = f"{version_url(source.url, manifest.model_id, manifest.version, manifest.kind)}/pieces/{index}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall_timeout_s, sock_read=self.stall_timeout_s)
        if source.delay_s:
            await asyncio.sleep(source.delay_s)
        t0 = time.perf_counter()
        start = span.filled
        view = memoryview(span.data)
        try:
            async with self.session.get(url, headers=headers, timeout=timeout) as resp:
                if resp.status == 503:
                    await resp.read()
                    return "pending"
                if resp.status == 404:
                    await resp.read()
                    return "missing"
                if resp.status == 200 and "Range" in headers:
                    if not span.whole:  # a source that ignores ranges cannot serve part of a piece
                        await resp.read()
                        self._fail(source, f"piece {index}: answered a range request with the whole piece")
                        return "failed"
                    span.filled = start = 0  # take the whole piece again
                elif resp.status not in (200, 206):
                    body = await resp.read()
                    self._fail(source, f"piece {index}: HTTP {resp.status} {body[:200]!r}")
                    return "failed"
                async for chunk in resp.content.iter_chunked(CHUNK):
                    n = len(chunk)
                    if span.filled + n > span.end:
                        span.filled = span.start
                        self._fail(source, f"piece {index}: more bytes than asked for ({span.start}-{span.end})")
                        return "failed"
                    view[span.filled:span.filled + n] = chunk
                    span.filled += n
                    await self._received(source, n)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._fail(source, f"piece {index}: {type(e).__name__}: {e}")
            return "failed"
        finally:
            view.release()
        received = span.filled - start
        if self.monitor is not None and source.link is not None and received:
            self.monitor.record_transfer(source.link, received, time.perf_counter() - t0)
        if span.filled < span.end:
            self._fail(source, f"piece {index}: connection ended at {span.filled}/{span.end} bytes")
            return "failed"
        return "done"

    async def pieces(
        self,
        manifest: Manifest,
        indices: Iterable[int],
        connections: int,
        on_piece: Callable[[int, bytearray], Awaitable[None]],
    ) -> None:
        """Fetch `indices` with `connections` parallel requests, handing each verified piece to
        `on_piece`. Pieces prefetched with the manifest (`manifest_bytes(prefetch=...)`) are taken
        first, checked like any other; a bad or missing one is fetched again the usual way.

        Each request asks for at most 1/`connections` of the bytes not yet asked for (and at least
        `MIN_SPAN`): whole pieces while much is left, and at the end the last pieces split into
        ranges over every connection, so that they all finish together instead of a few connections
        carrying the last whole pieces while the others sit idle. No byte is requested twice.
        """
        early = self._early.pop((manifest.model_id, manifest.version, manifest.kind), {})
        order = list(indices)
        for i in set(early) - set(order):
            early.pop(i).cancel()
        unasked = sum(manifest.pieces[i].length for i in order)
        todo = deque((i, 0, manifest.pieces[i].length) for i in sorted(order, key=lambda i: i not in early))
        lanes = max(1, min(connections, -(-unasked // MIN_SPAN)))
        split: dict[int, tuple[bytearray, list[int]]] = {}  # piece -> (buffer, [bytes still to arrive])

        async def whole(i: int) -> bytearray:
            task = early.pop(i, None)
            data = await task if task is not None else None
            if data is not None:
                try:
                    manifest.check_piece(i, data)
                    return bytearray(data)
                except CorruptError as e:
                    log.info("prefetched piece %d rejected: %s", i, e)
            return await self.piece(manifest, i)

        async def part(i: int, start: int, end: int) -> bytearray | None:
            """Receive one range of a split piece; the piece once its last range is in, else None."""
            data, left = split.setdefault(i, (bytearray(manifest.pieces[i].length), [manifest.pieces[i].length]))
            await self._fill(manifest, i, _Span(data, start, end), time.monotonic() + self.give_up_s)
            left[0] -= end - start
            if left[0]:
                return None
            del split[i]
            try:
                manifest.check_piece(i, data)
                return data
            except CorruptError as e:  # which range was bad is unknown: fetch it whole again
                log.info("piece %d assembled from ranges rejected: %s", i, e)
                return await self.piece(manifest, i)

        async def worker() -> None:
            nonlocal unasked
            while todo:
                i, start, end = todo.popleft()
                share = max(MIN_SPAN, -(-unasked // lanes))
                if start == 0 and (i in early or end <= share + MIN_SPAN // 2):
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

        workers = [asyncio.create_task(worker()) for _ in range(lanes)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            for task in early.values():
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
