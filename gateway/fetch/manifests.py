"""The manifest half of the `Fetcher` (fetch/fetcher.py), its base class: a version's signed manifest
from the best source, waiting for a version not announced yet, with the first wave of pieces asked
for beside it (`prefetch`), and the progress deadline of every request to a source (`_rule`).

Kept apart from the pieces half so that each reads in one file; the attributes it reads are the
`Fetcher`'s fields.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from deltamesh.delta.errors import CodecError
from deltamesh.gateway.fetch.http_reads import Progress, Whole, Wrong, get_small, receive_whole
from deltamesh.gateway.fetch.judge import MANIFEST, FetchError, Key, SourceJudge, Turn, name
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway_client import PEER_HEADER, version_url
from deltamesh.http import JSON_LIMIT, HttpError

if TYPE_CHECKING:
    import aiohttp

    from deltamesh.gateway.fetch.links import LinkMonitor

log = logging.getLogger("deltamesh.gateway.fetch.fetcher")  # one logger for the whole fetcher

PREFETCH_LIMIT = 16 * 1024 * 1024
"""Largest piece taken before its manifest arrives (a bigger one is dropped and fetched normally): with
`prefetch` pieces asked for, a source that never ends them costs at most this much each."""
Inline = tuple[Source, bytes]
"""A manifest envelope that came inline in a source's head answer, and that source."""


class NotAnnounced(FetchError):
    """A version asked for ahead (`manifest_bytes(wait_s=...)`) was not announced within the wait,
    or a newer one was announced instead."""


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefetch failed: %r", task.exception())


class ManifestFetch:
    """Manifests and the requests made beside them; `Fetcher` is the one subclass."""

    session: aiohttp.ClientSession
    wait_session: aiohttp.ClientSession | None
    peer: str
    monitor: LinkMonitor | None
    stall_timeout_s: float
    give_up_s: float
    min_rate_bps: float
    min_rate_fraction: float
    on_bytes: Callable[[int], None] | None
    on_received: Callable[[Source, Key, int], None] | None
    on_rejected: Callable[[Source, Key, CodecError], None] | None
    _early: dict[Key, dict[int, asyncio.Task]]
    _arrived: dict[Key, dict[int, int]]
    _judge: SourceJudge

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

    # -- bytes as they arrive, and pieces asked for with the manifest -------------------------------
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
