"""A burst of connections to a server that is not accepting them yet: each one's handshake completes
in the kernel, queued until the server accepts it. A cold fetcher opens its parallel connections at
once (hundreds over a long link: docs/api/gateway.md, Long links), many pools start together, and a
busy gateway accepts late; past aiohttp's own backlog of 128, a SYN was dropped and its connection
opened a second later, a second on every request it would carry. Real processes, real sockets on
loopback: the gateway is stopped (SIGSTOP) while the burst comes, as a busy one would be."""

from __future__ import annotations

import asyncio
import select
import signal
import socket
import time

from aiohttp import web

from deltamesh.http import LISTEN_BACKLOG, serving

BURST = min(300, LISTEN_BACKLOG)
"""Connections in one burst: more than aiohttp's backlog (128), what ours holds."""


def connected_within(port: int, count: int, within_s: float) -> int:
    """How many of `count` connections to 127.0.0.1:`port`, opened at once, finish their handshake
    within `within_s` (a dropped SYN is sent again only after a second)."""
    socks = [socket.socket() for _ in range(count)]
    poller = select.poll()
    try:
        for s in socks:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            poller.register(s, select.POLLOUT)
        pending = {s.fileno(): s for s in socks}
        done = 0
        deadline = time.monotonic() + within_s
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                s = pending.pop(fd)
                poller.unregister(fd)
                done += s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return done
    finally:
        for s in socks:
            s.close()


def test_a_stopped_gateway_process_queues_a_burst_of_connections(spawn_gateway):
    gw = spawn_gateway("eu")
    port = int(gw.url.rsplit(":", 1)[1])
    gw.kill(signal.SIGSTOP)
    try:
        assert connected_within(port, BURST, 0.8) == BURST
    finally:
        gw.kill(signal.SIGCONT)
    assert gw.alive()


def test_an_app_served_in_process_queues_a_burst_while_its_loop_is_busy():
    """`deltamesh.http.serving` (a pool's status server): the burst comes while the loop that would
    accept is blocked."""

    async def main() -> int:
        async with serving(web.Application(), "127.0.0.1:0") as url:
            return connected_within(int(url.rsplit(":", 1)[1]), BURST, 0.8)  # blocks the loop, as busy work would

    assert asyncio.run(main()) == BURST
