"""A cold fetcher's first round trip: parts of the newest whole version, asked for before it is known.

A new pool does not know which version it will fetch, nor its manifest, until its head poll, plan
and manifest have come back: two or three round trips in which its connections carry nothing. So it
asks its gateway at once, on each of its connections, for one of `of` equal parts of the newest
version of a kind the gateway holds whole (`deltamesh.gateway.version_parts`), and data flows from
the first round trip. Nothing a part says is trusted, and what it sends is bounded: until the signed
manifest is verified, each part is read into a small buffer (`early_limit` bytes, `EARLY_BYTES`
over all parts) and then left unread, so the sender waits; once `EarlyParts.lay` has the manifest,
a part of another version or of another span than the one asked for is dropped unread, and the others
stream straight into the pieces they cover, each read stopping at the part's length as the manifest
gives it, however much more the sender has. Each piece whose bytes are all in goes to the caller,
which checks it against the manifest like any other; the pieces that good parts did not fill are
fetched the usual way (`deltamesh.gateway.fetch.fetcher.Fetcher.pieces`).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Collection

import aiohttp

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.fetch.http_reads import CHUNK, OnChunk, Progress
from deltamesh.gateway.fetch.judge import SourceJudge, name
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.version_parts import SPAN_HEADER, VERSION_HEADER, parse_span, part_span, total_bytes
from deltamesh.gateway_client import PEER_HEADER, model_path

log = logging.getLogger(__name__)

EARLY_BYTES = 64 * 1024 * 1024
"""Most bytes of parts held before the manifest says what they are, over all of a fetch's parts."""
EARLY_PART_MIN = 256 * 1024
"""Least a part may hold before the manifest (with very many parts, EARLY_BYTES over their count is less)."""

OnWhole = Callable[[int, bytearray, list[Source]], Awaitable[None]]
"""Told (piece, its bytes, the sources that sent them) once every byte of a piece came in parts."""


def early_limit(of: int) -> int:
    """What each of `of` parts may hold before the manifest is known."""
    return max(EARLY_PART_MIN, EARLY_BYTES // max(of, 1))


@dataclass
class _Layout:
    """The verified manifest the parts are laid into, and the pieces being filled."""

    manifest: Manifest
    wanted: Collection[int]
    on_whole: OnWhole
    total: int
    starts: list[int]
    """Each piece's offset in the laid-out version."""
    filling: dict[int, tuple[bytearray, list[int], list[Source]]] = field(default_factory=dict)
    """Piece -> (its buffer, [bytes still missing], the sources that sent some)."""


class EarlyParts:
    """The requests for parts 0 .. of-1 of the newest whole `kind` of `model` at one source."""

    def __init__(self, model: str, kind: str):
        self.model, self.kind = model, kind
        self._tasks: list[asyncio.Task] = []
        self._layout: _Layout | None = None
        self._laid = asyncio.Event()
        self._dropped: set[int] = set()
        self.failed: list[tuple[Source, str]] = []
        """(source, what it did) of each part that came wrong: cut short, stalled, trickled or mislaid."""

    @classmethod
    def ask(cls, session: aiohttp.ClientSession, source: Source, peer: str, model: str, kind: str, of: int,
            rule: Progress, limit: int, on_chunk: OnChunk) -> "EarlyParts":
        """Ask for the `of` parts; each holds at most `limit` bytes until `lay` is called (`early_limit`)."""
        parts = cls(model, kind)
        url = f"{source.url.rstrip('/')}{model_path(model, f'newest/{kind}/parts')}"
        parts._tasks = [asyncio.create_task(parts._receive(session, source, f"{url}/{k}", {PEER_HEADER: peer},
                                                           k, of, rule, limit, on_chunk)) for k in range(of)]
        return parts

    async def lay(self, manifest: Manifest, wanted: Collection[int], on_whole: OnWhole) -> None:
        """Lay the parts of `manifest`'s version into its pieces as they arrive, until every part has ended;
        `on_whole` gets each piece in `wanted` whose bytes are all in. Parts of any other version or
        size are dropped unread."""
        starts = [0, *itertools.accumulate(p.length for p in manifest.pieces)][:-1]
        self._layout = _Layout(manifest, wanted, on_whole, total_bytes(manifest), starts)
        self._laid.set()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            self.cancel()
            self._layout.filling.clear()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Cancel the requests still on their way and wait for them to end."""
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _receive(self, session: aiohttp.ClientSession, source: Source, url: str, headers: dict, k: int, of: int,
                       rule: Progress, limit: int, on_chunk: OnChunk) -> None:
        """One part: its answer's headers, at most `limit` bytes until the manifest is known, then the
        rest of its span as the manifest gives it, laid into pieces as it comes."""
        loop = asyncio.get_running_loop()
        got = 0
        answered = False
        early = bytearray()
        try:
            async with asyncio.timeout_at(loop.time() + rule.first_byte_s) as watchdog:
                async with session.get(url, params={"of": of}, headers=headers, timeout=rule.timeout()) as resp:
                    answered, since, base = True, loop.time(), 0
                    watchdog.reschedule(since + rule.grace_s)
                    if resp.status != 200:  # not held whole there (404): no part, and nothing of it read
                        return
                    claim = self._claim(source, resp, k, of)
                    if claim is None:
                        return
                    version, start, end = claim
                    while True:
                        layout = self._layout
                        if layout is not None and not self._fits(layout, source, version, k, of, start, end):
                            return  # another version or size than the manifest's: the rest is not read
                        want = end - start - got if layout is not None else min(end - start - got, limit - len(early))
                        if want == 0 and layout is None:  # full until the manifest says what it is
                            watchdog.reschedule(None)  # the sender waits on us, not the other way round
                            await self._laid.wait()
                            since, base = loop.time(), got
                            watchdog.reschedule(since + rule.grace_s)
                            continue
                        if layout is not None and early:
                            await self._place(layout, source, start, early)
                            early = bytearray()
                        if want == 0:
                            break
                        chunk = await resp.content.read(min(CHUNK, want))
                        if not chunk:
                            raise aiohttp.ClientPayloadError(f"part {k}/{of} ended at {got}/{end - start} bytes")
                        got += len(chunk)
                        watchdog.reschedule(since + rule.grace_s + (got - base) / rule.min_rate_bps)
                        await on_chunk(len(chunk))
                        if self._layout is None:
                            early += chunk
                        else:
                            await self._place(self._layout, source, start + got - len(chunk), chunk)
        except TimeoutError:
            self.failed.append((source, f"part {k}/{of}: {'stalled or too slow' if answered else 'no answer'} "
                                        f"after {got} bytes"))
            return
        except (aiohttp.ClientError, OSError) as e:
            if answered:
                self.failed.append((source, f"part {k}/{of}: connection ended after {got} bytes ({type(e).__name__})"))
            else:
                log.debug("part %d/%d of the newest %s %s at %s: %s", k, of, self.model, self.kind, source.url, e)
            return
        if early:  # the whole part came before the manifest did
            await self._laid.wait()
            layout = self._layout
            if layout is not None and self._fits(layout, source, version, k, of, start, end):
                await self._place(layout, source, start, early)

    def _claim(self, source: Source, resp: aiohttp.ClientResponse, k: int, of: int) -> tuple[int, int, int] | None:
        """(version, start, end) that a part's answer says it carries; None (noted when it is mislaid)
        when it is malformed, not the span asked for, or declares another length than its span."""
        span = parse_span(resp.headers.get(SPAN_HEADER))
        version = resp.headers.get(VERSION_HEADER, "")
        if span is None or not version.isdigit():
            log.debug("part %d/%d from %s: no version or span", k, of, source.url)
            return None
        start, end, total = span
        if (start, end) != part_span(total, k, of) or resp.content_length not in (None, end - start):
            self.failed.append((source, f"part {k}/{of} sent as bytes {start}-{end} of {total} "
                                        f"({resp.content_length} declared)"))
            return None
        return int(version), start, end

    def _fits(self, layout: _Layout, source: Source, version: int, k: int, of: int, start: int, end: int) -> bool:
        """Whether part `k` of `of`, of `version` and spanning [start, end), is that part of the manifest's
        version (whose size the manifest gives); logged once when it is not."""
        m = layout.manifest
        if version == m.version and (start, end) == part_span(layout.total, k, of):
            return True
        if k not in self._dropped:
            self._dropped.add(k)
            log.info("gateway %s sent part %d/%d as %s v%d (bytes %d-%d) for v%d (%d bytes): fetching pieces "
                     "instead", source.url, k, of, self.model, version, start, end, m.version, layout.total)
        return False

    async def _place(self, layout: _Layout, source: Source, offset: int, data: bytes | bytearray) -> None:
        """Copy bytes [offset, offset + len(data)) of the laid-out version into the wanted pieces they
        cover; hand over each piece they complete."""
        m = layout.manifest
        view = memoryview(data)
        end = offset + len(data)
        i = max(bisect.bisect_right(layout.starts, offset) - 1, 0)
        while i < len(m.pieces) and layout.starts[i] < end:
            lo, hi = max(offset, layout.starts[i]), min(end, layout.starts[i] + m.pieces[i].length)
            if lo < hi and i in layout.wanted:
                buf, left, senders = layout.filling.setdefault(i, (bytearray(m.pieces[i].length),
                                                                   [m.pieces[i].length], []))
                a = lo - layout.starts[i]
                buf[a:a + hi - lo] = view[lo - offset:hi - offset]
                left[0] -= hi - lo
                if source not in senders:
                    senders.append(source)
                if left[0] == 0:
                    del layout.filling[i]
                    await layout.on_whole(i, buf, senders)
            i += 1


async def take_parts(parts: EarlyParts, manifest: Manifest, order: list[int],
                     on_piece: Callable[[int, bytearray], Awaitable[None]], judge: SourceJudge) -> list[int]:
    """Hand `on_piece` the pieces of `order` that `parts` filled and that pass their check; return the
    others, left to fetch. A piece that fails counts against every source that sent part of it, and a
    source whose parts came wrong is penalised, so the pieces they left go to other sources first."""
    key = (manifest.model_id, manifest.version, manifest.kind)
    taken: set[int] = set()

    async def whole(i: int, data: bytearray, senders: list[Source]) -> None:
        try:
            manifest.check_piece(i, data)
        except CorruptError as e:
            for source in senders:
                judge.served_bad(source, key, i, f"bad bytes in a part ({e})")
            return
        taken.add(i)
        await on_piece(i, data)

    if (parts.model, parts.kind) == (manifest.model_id, manifest.kind):
        await parts.lay(manifest, set(order), whole)
    for source, reason in dict(parts.failed).items():
        judge.note(source, f"{name(key)} {reason}", penalty=True)
    return [i for i in order if i not in taken]
