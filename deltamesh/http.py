"""The one HTTP helper of deltamesh: client sessions, JSON calls with clear errors, and server basics.

Every client (publisher, puller, relay, pool agent, broker clients, trainer) talks through
`client_session` and `request_json`/`request_bytes`; every server answers errors through
`error_response` (JSON `{"error": reason}`) and is started with `serve` (or, inside a running
loop, `serving`), its connections held to a header-read timeout and a per-address cap
(`deltamesh.http_guard`). The control plane is JSON; bulk data is raw bytes. Nothing here ever unpickles
anything.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import os
import socket
import ssl
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web

from deltamesh.http_guard import ConnectionGuard, ConnectionLimits, GuardedSite
from deltamesh.peer_json import parse_json
from deltamesh.tls import TlsSettings, client_context

log = logging.getLogger(__name__)

JSON_LIMIT = 8 * 1024 * 1024
"""Largest JSON body a server accepts, and a client reads, unless it says otherwise (manifests of huge
models stay below)."""
SMALL_LIMIT = 64 * 1024
"""Most bytes read of an unwanted answer (a probe's, an error's): over it, the connection is closed."""

LISTEN_BACKLOG = 1024
"""Connections a listening socket queues before they are accepted. A fetcher starting cold opens its
parallel connections at once (hundreds over a long link), as do many pools at a start; at aiohttp's
128 the SYNs past it are dropped and their connections open a second later."""
KEEPALIVE_S = 300.0
"""How long idle connections stay open, on both ends. Versions come every RL step, seconds to
minutes apart: a connection kept between them skips the handshake, and (on hosts with
`net.ipv4.tcp_slow_start_after_idle=0`) keeps the congestion window it had grown, which on a long
link is worth seconds per version. aiohttp's defaults (15 s client, 75 s server) would drop them."""


class HttpError(Exception):
    """A peer answered with a non-2xx status, or could not be reached. `status` is 0 when unreachable;
    `headers` are the answer's (empty when there was none), for callers that act on one (a standby
    broker names its leader)."""

    def __init__(self, status: int, reason: str, url: str, headers: Mapping[str, str] | None = None):
        super().__init__(f"{url}: {status or 'unreachable'} {reason}")
        self.status = status
        self.reason = reason
        self.url = url
        self.headers: Mapping[str, str] = headers if headers is not None else {}


class NewestFirstConnector(aiohttp.TCPConnector):
    """A connector that reuses the idle connection released last, not (aiohttp's way) the one idle
    longest: a request that follows a transfer rides the connection that transfer just warmed up."""

    async def _get(self, key, traces):  # aiohttp's private hook, same signature
        conns = self._conns.get(key)
        if isinstance(conns, collections.deque) and len(conns) > 1:
            conns.rotate(1)  # aiohttp takes from the left: bring the newest there
        return await super()._get(key, traces)


def client_session(
    *,
    connections: int = 64,
    timeout_s: float | None = 300.0,
    connect_timeout_s: float = 10.0,
    headers: Mapping[str, str] | None = None,
    tls: TlsSettings | None = None,
    newest_first: bool = False,
) -> aiohttp.ClientSession:
    """A client session with a bounded pool of connections kept open between requests (`KEEPALIVE_S`)
    and sane timeouts.

    `timeout_s` bounds a whole request (None for long transfers and long polls that set their own).
    `https://` peers are verified against `tls.ca` (the system store without it), and `tls.cert` is
    presented to servers that ask for a client certificate. `newest_first`: reuse the connection
    released last first (`NewestFirstConnector`).
    """
    ssl_context = client_context(tls) if tls is not None else True
    connector = NewestFirstConnector if newest_first else aiohttp.TCPConnector
    return aiohttp.ClientSession(
        connector=connector(limit=connections, limit_per_host=connections, keepalive_timeout=KEEPALIVE_S,
                            ssl=ssl_context),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s),
        headers=dict(headers or {}),
        raise_for_status=False,
    )


async def open_connections(session: aiohttp.ClientSession, url: str, count: int, *,
                           headers: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> int:
    """Have `count` connections to `url`'s server in `session`'s pool, opened ahead of the requests that
    will need them: `count` concurrent GETs of `url` (a small answer), each taking an idle connection
    or opening one, which then stays open (`KEEPALIVE_S`) for the next requests. Started alongside a
    first request (a head poll, a plan), it overlaps the TCP (and TLS) handshakes of a transfer's
    parallel connections with that request's round trip, instead of paying them after it. Returns how
    many got an answer (any status); it never raises for an unreachable server."""

    async def one() -> bool:
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await read_limited(resp, SMALL_LIMIT)
                return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    return sum(await asyncio.gather(*(one() for _ in range(max(0, count)))))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    body: Any = None,
    params: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    limit: int = JSON_LIMIT,
) -> Any:
    """Send `body` as JSON (if given) and return the decoded JSON answer; raise HttpError on failure
    (an answer over `limit` bytes included)."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = dict(headers or {})
    if data is not None:
        hdrs["Content-Type"] = "application/json"
    raw = await request_bytes(session, method, url, data=data, params=params, headers=hdrs, timeout_s=timeout_s,
                              limit=limit)
    if not raw:
        return None
    try:
        return parse_json(raw)  # a peer's answer: depth-limited like any peer-sent JSON
    except ValueError as e:
        raise HttpError(200, f"answer is not JSON: {e}", url) from e


async def request_bytes(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    data: bytes | None = None,
    params: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    limit: int = JSON_LIMIT,
) -> bytes:
    """One request whose whole answer fits in memory; raise HttpError on a non-2xx status, and on an
    answer over `limit` bytes (502: a peer's answer is read no further than that)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
    query = {k: str(v) for k, v in (params or {}).items() if v is not None}
    try:
        async with session.request(method, url, data=data, params=query, headers=headers, timeout=timeout) as resp:
            raw = await read_limited(resp, limit if resp.status < 300 else SMALL_LIMIT)
            if raw is None:
                raise HttpError(502, f"answer over {limit if resp.status < 300 else SMALL_LIMIT} bytes "
                                     f"(HTTP {resp.status}): not read further", url)
            if resp.status >= 300:
                raise HttpError(resp.status, _reason(raw, resp.reason), url, resp.headers)
            return raw
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise HttpError(0, f"{type(e).__name__}: {e}{_hint(url, e)}", url) from e


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """An answer's whole body, or None (and the connection closed, the rest unread) when it is over
    `limit` bytes, declared or as it arrives: a peer's answer costs no more memory than that. An
    unwanted body (an error's, a probe's) is read with SMALL_LIMIT, so the connection is reused."""
    if (resp.content_length or 0) > limit:
        resp.close()
        return None
    body = bytearray()
    while chunk := await resp.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            resp.close()
            return None
    return bytes(body)


def _hint(url: str, e: BaseException) -> str:
    """What a dropped connection most likely means, where TLS leaves the client only that to go by."""
    reset = isinstance(e, aiohttp.ClientOSError) and e.errno == errno.ECONNRESET
    if not (reset or isinstance(e, aiohttp.ServerDisconnectedError)):
        return ""
    if url.startswith("https"):
        # Under TLS 1.3 a server that refuses the client's certificate (or its lack of one) can only
        # close the connection after the handshake.
        return "; the server may require a client certificate from its CA (tls cert/key)"
    # A TLS server drops a plain-HTTP request without an answer; never retry it as anything else.
    return "; the server may speak only TLS: use https://"


def _reason(raw: bytes, fallback: str | None) -> str:
    try:
        return str(parse_json(raw)["error"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or (fallback or "")


def error_response(status: int, reason: str) -> web.Response:
    """The one shape of every error a deltamesh server returns."""
    return web.json_response({"error": reason}, status=status)


async def read_body(request: web.Request, *, limit: int) -> bytes:
    """A request's whole body, or an HTTP 413 carrying the reason once it exceeds `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=request.content_length,
            text=json.dumps({"error": f"body of {request.content_length} bytes exceeds {limit}"}),
            content_type="application/json",
        )
    chunks, size = [], 0
    while True:  # StreamReader.read(n) returns whatever has arrived, not n bytes: read until EOF
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(
                max_size=limit, actual_size=size,
                text=json.dumps({"error": f"body exceeds {limit} bytes"}), content_type="application/json",
            )
    return b"".join(chunks)


async def read_json(request: web.Request, *, limit: int = JSON_LIMIT) -> Any:
    """Decode a request's JSON body or raise an HTTP 400/413 carrying the reason."""
    raw = await read_body(request, limit=limit)
    try:
        return parse_json(raw)
    except ValueError as e:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"malformed JSON: {e}"}),
                                 content_type="application/json") from e


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Turn aiohttp's HTTP exceptions and unexpected crashes into JSON error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        return error_response(e.status, e.reason if not e.text or e.text.startswith(f"{e.status}:") else e.text)
    except asyncio.CancelledError:
        raise
    except ConnectionError as e:
        if not _client_gone(request):
            raise  # a connection of the handler's own (to an upstream) failed: a 500 below, as any error
        # The client hung up mid-answer (a pool stopped, a relay turned to another source): routine.
        log.info("%s %s: the client went away (%s)", request.method, request.path, e)
        return web.Response(status=499)  # never sent: aiohttp finds the connection closed and lets it go
    except Exception as e:  # a bug must answer 500 with a reason, not drop the connection
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")


STOP_GRACE_S = 1.0
"""How long a stopping server lets requests in flight finish (long polls are released at once): a
server stops within 2 s, and a client whose download is cut short resumes it from another source."""


def serve(app: web.Application, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
          sock: socket.socket | None = None, what: str = "server", guard: ConnectionGuard | None = None) -> int:
    """Run `app` on uvloop (when available) until SIGINT/SIGTERM, with graceful shutdown; HTTPS with
    `ssl_context` (`deltamesh.tls.server_context`). On `sock` when given (`listen_socket(host, port)`,
    bound by a caller that checks the port before it builds the app), its connections held to `guard`'s
    limits (`deltamesh.http_guard`; default ones when not given). Returns the exit status for the signal
    that stopped it (130, 143: `deltamesh.signals`); `what` names the server in its "stopping" line."""
    from deltamesh.signals import on_stop_signals, signal_exit

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency everywhere but Windows
        loop_factory = asyncio.new_event_loop
    sock = sock or listen_socket(host, port)  # before the app starts: a taken port fails before any "up" line
    loop = loop_factory()
    stopped_by: list[int] = []
    stopping = asyncio.Event()

    def stop(sig: int) -> None:
        stopped_by.append(sig)
        stopping.set()

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S, shutdown_timeout=STOP_GRACE_S)
        await runner.setup()  # the app's start-up: an error there ends the command before it listens
        try:
            await GuardedSite(runner, guard or ConnectionGuard(ConnectionLimits()), keepalive_timeout=KEEPALIVE_S,
                              sock=sock, ssl_context=ssl_context, backlog=LISTEN_BACKLOG).start()
            await stopping.wait()
        finally:
            await runner.cleanup()  # requests in flight get STOP_GRACE_S; the app's clean-up runs

    on_stop_signals(loop, stop, what)
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main())
    finally:  # what asyncio.run does on the way out: the tasks left are cancelled and awaited
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftover, loop.shutdown_asyncgens(), return_exceptions=True))
        loop.close()
    return signal_exit(stopped_by[0] if stopped_by else None)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError "cannot listen on HOST:PORT: REASON" (its errno
    kept, EADDRINUSE for a port in use) when it cannot be bound."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)  # create_server's text names the address again
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {reason[:1].lower()}{reason[1:]}") from None


@contextlib.asynccontextmanager
async def serving(app: web.Application, listen: str, *, ssl_context: ssl.SSLContext | None = None,
                  guard: ConnectionGuard | None = None) -> AsyncIterator[str]:
    """Serve `app` on `listen` (HOST:PORT, port 0 for any) inside the running loop; yields its base URL
    (`https://` with `ssl_context`). With `guard`, its connections are held to the guard's limits
    (`deltamesh.http_guard`)."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    try:
        site: web.BaseSite
        if guard is None:
            site = web.TCPSite(runner, host, port, ssl_context=ssl_context, backlog=LISTEN_BACKLOG)
        else:
            site = GuardedSite(runner, guard, keepalive_timeout=KEEPALIVE_S, host=host, port=port,
                               ssl_context=ssl_context, backlog=LISTEN_BACKLOG)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        shown = "127.0.0.1" if bound_host in ("0.0.0.0", "::") else bound_host
        yield f"{'https' if ssl_context is not None else 'http'}://{shown}:{bound_port}"
    finally:
        await runner.cleanup()


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' (or ':PORT', '[::1]:PORT') to (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen wants HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def parse_range(header: str | None, length: int) -> tuple[int, int] | None:
    """A single `Range: bytes=A-B` / `bytes=A-` / `bytes=-N` against `length` bytes, as [start, end).

    None when there is no header; ValueError when it is malformed or cannot be satisfied (answer 416).
    Multi-range requests are not supported and are refused the same way.
    """
    if header is None:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise ValueError(f"unsupported Range {header!r}")
    first, sep, last = spec.strip().partition("-")
    if not sep or not (first.isdigit() or last.isdigit()) or (first and not first.isdigit()) or (last and not last.isdigit()):
        raise ValueError(f"malformed Range {header!r}")
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0:
            raise ValueError("empty suffix range")
        return max(0, length - n), length
    start = int(first)
    end = min(int(last) + 1, length) if last else length
    if start >= length or end <= start:
        raise ValueError(f"Range {header!r} outside 0..{length}")
    return start, end
