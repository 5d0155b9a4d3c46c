"""One HTTP request of a fetch, held to a progress deadline.

A stall timeout alone lets a source that sends one byte a second hold a piece for hours. So every
request has a `Progress` rule: its answer must begin within `first_byte_s` (the stall timeout, plus
any wait the request asks the server for), and from then on its body must keep up an average of
`min_rate_bps` after a credit of `grace_s`: the deadline is `t_answer + grace_s + received /
min_rate_bps`, pushed out by every chunk that arrives, so a source below the rate is dropped as soon
as it has fallen behind, and a whole span's deadline follows from its size. What arrived stays in the
span's buffer either way, so the next request (to another source, or the same one later) asks only
for the rest. The outcome says what happened: `done`, `pending` (announced there, not arrived: 503),
`missing` (not announced there: 404), `error` (unreachable, or an HTTP error: back off and ask again)
or `wrong` (it served something wrong: a short body, a stall, a trickle, a declared length over the
span, a range answered whole; counted against the source's tries, see `deltamesh.gateway.fetch.scoring`).
A span is never read beyond its end: a source that sends more (or never ends) costs nothing past it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import aiohttp

from deltamesh.http import SMALL_LIMIT, HttpError, read_limited
from deltamesh.peer_json import parse_json

CHUNK = 256 * 1024

OnChunk = Callable[[int], Awaitable[None]]


@dataclass(frozen=True)
class Progress:
    """The deadline rule of one request (see the module's docstring)."""

    first_byte_s: float
    grace_s: float
    min_rate_bps: float

    def timeout(self) -> aiohttp.ClientTimeout:
        # aiohttp's own read timeout stays as a backstop for a silent socket; the rule does the rest.
        return aiohttp.ClientTimeout(total=None, sock_connect=self.first_byte_s, sock_read=self.first_byte_s)


@dataclass
class Span:
    """Bytes [start, end) of a piece being received into the piece's buffer; `filled` is how far
    they have arrived. A whole piece is one span; the tail of a version splits pieces into several."""

    data: bytearray
    start: int
    end: int
    filled: int = field(init=False)
    sources: list = field(default_factory=list)
    """The sources that delivered any of its bytes (all are suspects if the piece fails its hash)."""

    def __post_init__(self) -> None:
        self.filled = self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == len(self.data)


@dataclass
class Result:
    outcome: str
    """'done', 'pending', 'missing', 'error' or 'wrong'."""
    reason: str = ""
    received: int = 0
    seconds: float = 0.0
    """Time from the answer's first byte to its last: the rate the source reached."""


class Wrong(Exception):
    """A request whose source served something wrong (a stall, a trickle, an oversized body)."""


def _too_slow(rule: Progress, received: int, seconds: float) -> str:
    if received == 0:
        return f"no answer within {seconds:.1f}s"
    return (f"too slow: {received} bytes in {seconds:.1f}s, below the minimum of {rule.min_rate_bps:.0f} B/s "
            f"after {rule.grace_s:g}s")


async def receive_span(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], span: Span,
                       rule: Progress, on_chunk: OnChunk) -> Result:
    """One request for the rest of `span` (a Range request unless it is the whole piece from its start)."""
    ranged = "Range" in headers
    start = span.filled
    loop = asyncio.get_running_loop()
    t0 = t_answer = loop.time()
    answered = False
    view = memoryview(span.data)
    try:
        async with asyncio.timeout_at(t0 + rule.first_byte_s) as watchdog:
            try:
                async with session.get(url, headers=headers, timeout=rule.timeout()) as resp:
                    answered, t_answer = True, loop.time()
                    watchdog.reschedule(t_answer + rule.grace_s)
                    if resp.status in (503, 404):
                        await read_limited(resp, SMALL_LIMIT)
                        return Result("pending" if resp.status == 503 else "missing")
                    if resp.status == 200 and ranged:
                        if not span.whole:  # a source that ignores ranges cannot serve part of a piece
                            return Result("wrong", "answered a range request with the whole piece")
                        span.filled = start = 0  # take the whole piece again
                    elif resp.status not in (200, 206):
                        body = await resp.content.read(200)
                        return Result("error", f"HTTP {resp.status} {body!r}")
                    if (resp.content_length or 0) > span.end - span.filled:
                        return Result("wrong", f"declared {resp.content_length} bytes for {span.filled}-{span.end}")
                    # Read no further than the span (the signed manifest's length): whatever a source
                    # sends beyond it is left unread, and the connection closed with it.
                    while span.filled < span.end:
                        chunk = await resp.content.read(min(CHUNK, span.end - span.filled))
                        if not chunk:
                            break
                        n = len(chunk)
                        view[span.filled:span.filled + n] = chunk
                        span.filled += n
                        watchdog.reschedule(t_answer + rule.grace_s + (span.filled - start) / rule.min_rate_bps)
                        await on_chunk(n)
            except TimeoutError:
                if watchdog.expired():
                    raise  # the rule's deadline: reported below
                return Result("wrong", f"stalled: no byte for {rule.first_byte_s:g}s at {span.filled}/{span.end}",
                              span.filled - start, loop.time() - t_answer)
            except (aiohttp.ClientError, OSError) as e:
                got = span.filled - start
                if answered:  # it answered, then broke off: a short body
                    return Result("wrong", f"connection ended at {span.filled}/{span.end} bytes "
                                           f"({type(e).__name__})", got, loop.time() - t_answer)
                return Result("error", f"{type(e).__name__}: {e}")
    except TimeoutError:
        got = span.filled - start
        return Result("wrong", _too_slow(rule, got, loop.time() - (t_answer if answered else t0)), got,
                      loop.time() - t_answer)
    finally:
        view.release()
    got = span.filled - start
    if span.filled < span.end:
        return Result("wrong", f"connection ended at {span.filled}/{span.end} bytes", got, loop.time() - t_answer)
    return Result("done", "", got, loop.time() - t_answer)


@dataclass
class Whole:
    """A body whose length was not known when it was asked for (a piece asked for before its manifest)."""

    data: bytes
    outcome: str
    """'done' (the whole answer), 'refused' (not a 200: not announced there, or over the size limit) or
    'wrong' (it broke off, stalled or trickled: `data` is what arrived, to continue from)."""
    reason: str = ""
    seconds: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    """The answer's headers (of a 200)."""


async def receive_whole(session: aiohttp.ClientSession, url: str, params: Mapping[str, Any] | None,
                        headers: Mapping[str, str], rule: Progress, limit: int, on_chunk: OnChunk) -> Whole:
    """One request for a whole body of unknown length, of at most `limit` bytes."""
    loop = asyncio.get_running_loop()
    t0 = t_answer = loop.time()
    answered = False
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout_at(t0 + rule.first_byte_s) as watchdog:
            try:
                async with session.get(url, params=params, headers=headers, timeout=rule.timeout()) as resp:
                    answered, t_answer = True, loop.time()
                    watchdog.reschedule(t_answer + rule.grace_s)
                    if resp.status != 200:
                        await read_limited(resp, SMALL_LIMIT)
                        return Whole(b"", "refused", f"HTTP {resp.status}")
                    if (resp.content_length or 0) > limit:  # refused before a byte of it is read
                        return Whole(b"", "refused", f"declared {resp.content_length} bytes, over {limit}")
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        size += len(chunk)
                        if size > limit:
                            return Whole(b"", "refused", f"over {limit} bytes")
                        chunks.append(chunk)
                        watchdog.reschedule(t_answer + rule.grace_s + size / rule.min_rate_bps)
                        await on_chunk(len(chunk))
            except TimeoutError:
                if watchdog.expired():
                    raise
                return Whole(b"".join(chunks), "wrong", f"stalled: no byte for {rule.first_byte_s:g}s after {size}",
                             loop.time() - t_answer)
            except (aiohttp.ClientError, OSError) as e:
                if not answered:
                    return Whole(b"", "refused", f"{type(e).__name__}: {e}")
                return Whole(b"".join(chunks), "wrong", f"connection ended after {size} bytes ({type(e).__name__})",
                             loop.time() - t_answer)
    except TimeoutError:
        return Whole(b"".join(chunks), "wrong", _too_slow(rule, size, loop.time() - (t_answer if answered else t0)),
                     loop.time() - t_answer)
    return Whole(b"".join(chunks), "done", "", loop.time() - t_answer, resp.headers)


async def get_small(session: aiohttp.ClientSession, url: str, *, params: Mapping[str, Any] | None = None,
                    headers: Mapping[str, str], rule: Progress, limit: int) -> bytes:
    """A small whole answer (a manifest). HttpError for an error status or an unreachable source (status 0);
    Wrong when the source stalled, trickled or sent more than `limit` bytes."""
    loop = asyncio.get_running_loop()
    query = {k: str(v) for k, v in (params or {}).items() if v is not None}
    try:
        async with asyncio.timeout_at(loop.time() + rule.first_byte_s) as watchdog:
            try:
                async with session.get(url, params=query, headers=headers, timeout=rule.timeout()) as resp:
                    t_answer = loop.time()
                    watchdog.reschedule(t_answer + rule.grace_s)
                    body = bytearray()
                    while chunk := await resp.content.read(limit + 1 - len(body)):
                        body += chunk
                        if len(body) > limit:
                            raise Wrong(f"answer over {limit} bytes")
                        watchdog.reschedule(t_answer + rule.grace_s + len(body) / rule.min_rate_bps)
                    if resp.status >= 300:
                        raise HttpError(resp.status, _reason(bytes(body), resp.reason), url)
                    return bytes(body)
            except TimeoutError:
                if watchdog.expired():
                    raise
                raise Wrong(f"stalled: no byte for {rule.first_byte_s:g}s") from None
            except (aiohttp.ClientError, OSError) as e:
                raise HttpError(0, f"{type(e).__name__}: {e}", url) from e
    except TimeoutError:
        raise Wrong(f"no whole answer in time (the minimum is {rule.min_rate_bps:.0f} B/s after "
                    f"{rule.grace_s:g}s)") from None


def _reason(raw: bytes, fallback: str | None) -> str:
    """The `error` of a deltamesh error answer, else the start of the body."""
    try:
        return str(parse_json(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or (fallback or "")
