"""Bounds on a server's connections against slow and greedy peers: a header-read timeout and a cap per address.

aiohttp keeps a connection whose request headers never end until its keep-alive timeout (300 s here,
so that pools keep their connections between versions) and takes as many connections from one
address as it opens: a few hundred clients that send their headers a byte at a time, or connect and
send nothing, would hold as many sockets as they like. `ConnectionGuard` closes a connection whose
request line and headers are not all in within `header_timeout_s` (counted from the connection's
opening for its first request, from a request's first byte for the next ones; an idle keep-alive
connection between requests is the keep-alive timeout's), gives a TLS handshake the same time, and
closes at once a connection from an address that already holds `max_per_address`. A request line or
header over aiohttp's limits (8 KiB) is answered 400 and logged as one WARNING line, not an ERROR
with a traceback. `GuardedSite` listens with these (what `deltamesh.http.serve` and `serving` use when
given a guard); the handler leans on aiohttp's `RequestHandler` (its count of parsed requests and its
wait for the next one), which tests/base/test_http_guard.py exercises with real sockets.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
"""Default time a request's headers may take: far above any honest client's (one packet, or a few
round trips of a TLS handshake over the longest link), far below the keep-alive timeout."""
MAX_PER_ADDRESS = 1024
"""Default bound on the open connections of one address: above the ~520 of a pool fetching with 256
connections (the most the transfer benchmarks use), far below the open-file limit."""
WARN_EVERY_S = 60.0
"""An address at its cap is logged at most this often."""


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_per_address: int = MAX_PER_ADDRESS

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0 or self.max_per_address < 1:
            raise ValueError("header_timeout_s must be > 0 and max_connections_per_address >= 1")


class ConnectionGuard:
    """The connections one server holds, per address, and those it dropped (by reason: `header_timeout`,
    `address_cap`); `on_drop(reason)` is told of each (a server's metrics count them)."""

    def __init__(self, limits: ConnectionLimits, on_drop: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.on_drop = on_drop
        self.open: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._warned: dict[str, float] = {}

    def admit(self, address: str) -> bool:
        """Count a new connection from `address`; False (not counted) when the address is at its cap."""
        if self.open[address] >= self.limits.max_per_address:
            self._drop("address_cap")
            now = time.monotonic()
            if now - self._warned.get(address, -WARN_EVERY_S) >= WARN_EVERY_S:
                self._warned[address] = now
                log.warning("%s holds %d connections, the most one address may (max_connections_per_address): "
                            "closing its new ones", address, self.open[address])
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]

    def overdue(self, address: str) -> None:
        self._drop("header_timeout")
        log.debug("closed a connection from %s: no whole request header within %gs", address,
                  self.limits.header_timeout_s)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(reason)


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler, held to a `ConnectionGuard`'s limits."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._address = ""
        self._admitted = False
        self._deadline: asyncio.TimerHandle | None = None
        self._heard = 0
        """Requests whose headers had arrived when the deadline was set."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else str(peer or "")
        self._admitted = self._guard.admit(self._address)
        if not self._admitted:
            transport.close()
            return
        self._arm()  # the first request's headers are due from the connection's opening

    def data_received(self, data: bytes) -> None:
        heard = self._request_count
        # Waiting for the next request with none queued: these bytes begin its request line and headers.
        between = self._waiter is not None and not self._messages
        super().data_received(data)
        if self._request_count != heard:
            self._disarm()
        elif between and self._deadline is None:
            self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._admitted:
            self._admitted = False
            self._guard.release(self._address)
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        error = kw.get("exc_info")
        if isinstance(error, HttpProcessingError):  # a peer's malformed or oversized request: not our bug
            log.warning("bad request from %s: %s", self._address or "?", " ".join(str(error).split())[:300])
            return
        super().log_exception(*args, **kw)

    def _arm(self) -> None:
        self._heard = self._request_count
        self._deadline = self._loop.call_later(self._guard.limits.header_timeout_s, self._overdue)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _overdue(self) -> None:
        self._deadline = None
        if self._request_count == self._heard and self.transport is not None and not self.transport.is_closing():
            self._guard.overdue(self._address)
            self.transport.close()


class GuardedSite(web.BaseSite):
    """A listening socket (given, or bound to host:port) whose connections `guard` holds to its limits."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, *, keepalive_timeout: float,
                 sock: socket.socket | None = None, host: str = "", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.guard, self.keepalive_timeout = guard, keepalive_timeout
        self.sock, self.host, self.port = sock, host, port

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def handler() -> GuardedHandler:
            return GuardedHandler(server, loop=loop, guard=self.guard, keepalive_timeout=self.keepalive_timeout,
                                  access_log=None)

        where: dict[str, Any] = {"sock": self.sock} if self.sock is not None else {"host": self.host,
                                                                                  "port": self.port}
        # A TLS handshake gets the headers' time too: a peer that stalls it holds a socket no longer.
        handshake = {"ssl_handshake_timeout": self.guard.limits.header_timeout_s} if self._ssl_context else {}
        self._server = await loop.create_server(handler, ssl=self._ssl_context, backlog=self._backlog,
                                                **where, **handshake)
