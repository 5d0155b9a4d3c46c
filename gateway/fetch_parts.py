"""A cold fetcher's first round trip: parts of the newest whole version, asked for before it is known.

A new pool does not know which version it will fetch, nor its manifest, until its head poll, plan
and manifest have come back: two or three round trips in which its connections carry nothing. So it
asks its gateway at once, on each of its connections, for one of `of` equal parts of the newest
version of a kind the gateway holds whole (`deltamesh.gateway.version_parts`), and data flows from
the first round trip. Once the signed manifest is verified, `EarlyParts.lay` lays the parts that
belong to it into its pieces; each piece whose bytes are all in goes to the caller, which checks it
against the manifest like any other. Nothing a part says is trusted: a part of another version, of
another span than the one asked for, or over the size limit is dropped, and the pieces that good
parts did not fill are fetched the usual way (`deltamesh.gateway.fetch.Fetcher.pieces`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection

import aiohttp

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.fetch_http import OnChunk, Progress, receive_whole
from deltamesh.gateway.fetch_judge import SourceJudge, name
from deltamesh.gateway.sources import Source
from deltamesh.gateway.version_parts import SPAN_HEADER, VERSION_HEADER, parse_span, part_span, piece_spans, total_bytes
from deltamesh.gateway_client import PEER_HEADER

log = logging.getLogger(__name__)

OnWhole = Callable[[int, bytearray, list[Source]], Awaitable[None]]
"""Told (piece, its bytes, the sources that sent them) once every byte of a piece came in parts."""


@dataclass(frozen=True)
class Part:
    """One part as it came: which version the gateway said it is of, where it lies, and its bytes."""

    source: Source
    version: int
    start: int
    end: int
    total: int
    data: bytes


class EarlyParts:
    """The requests for parts 0 .. of-1 of the newest whole `kind` of `model` at one source."""

    def __init__(self, model: str, kind: str):
        self.model, self.kind = model, kind
        self._tasks: list[asyncio.Task] = []
        self.failed: list[tuple[Source, str]] = []
        """(source, what it did) of each part that came wrong: cut short, stalled, trickled or mislaid."""

    @classmethod
    def ask(cls, session: aiohttp.ClientSession, source: Source, peer: str, model: str, kind: str, of: int,
            rule: Progress, limit: int, on_chunk: OnChunk) -> "EarlyParts":
        url = f"{source.url.rstrip('/')}/v1/models/{model}/newest/{kind}/parts"
        parts = cls(model, kind)

        async def one(k: int) -> Part | None:
            got = await receive_whole(session, f"{url}/{k}", {"of": of}, {PEER_HEADER: peer}, rule, limit, on_chunk)
            if got.outcome == "wrong":
                parts.failed.append((source, f"part {k}/{of}: {got.reason}"))
            span = parse_span(got.headers.get(SPAN_HEADER))
            version = got.headers.get(VERSION_HEADER, "")
            if got.outcome != "done" or span is None or not version.isdigit():
                log.debug("part %d/%d of the newest %s %s from %s: %s %s", k, of, model, kind, source.url,
                          got.outcome, got.reason)
                return None
            start, end, total = span
            if (start, end) != part_span(total, k, of) or end - start != len(got.data):
                parts.failed.append((source, f"part {k}/{of} sent as bytes {start}-{end} of {total}"))
                return None
            return Part(source, int(version), start, end, total, got.data)

        parts._tasks = [asyncio.create_task(one(k)) for k in range(of)]
        return parts

    async def lay(self, manifest: Manifest, wanted: Collection[int], on_whole: OnWhole) -> None:
        """Lay the parts of `manifest`'s version into its pieces as they arrive; `on_whole` gets each
        piece in `wanted` whose bytes are all in. Parts of any other version or size are dropped."""
        total = total_bytes(manifest)
        buffers: dict[int, tuple[bytearray, list[int], list[Source]]] = {}
        try:
            for arriving in asyncio.as_completed(self._tasks):
                part = await arriving
                if part is None:
                    continue
                if part.version != manifest.version or part.total != total:
                    log.info("gateway %s sent parts of %s v%d (%d bytes) for v%d: fetching pieces instead",
                             part.source.url, self.model, part.version, part.total, manifest.version)
                    continue
                view = memoryview(part.data)
                at = 0
                for i, a, b in piece_spans(manifest, part.start, part.end):
                    chunk, at = view[at:at + b - a], at + b - a
                    if i not in wanted:
                        continue
                    data, left, senders = buffers.setdefault(i, (bytearray(manifest.pieces[i].length),
                                                                 [manifest.pieces[i].length], []))
                    data[a:b] = chunk
                    left[0] -= b - a
                    if part.source not in senders:
                        senders.append(part.source)
                    if left[0] == 0:
                        del buffers[i]
                        await on_whole(i, data, senders)
        finally:
            self.cancel()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Cancel the requests still on their way and wait for them to end."""
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


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
