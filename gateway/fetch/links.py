"""The link monitor: round-trip times and real-transfer throughput of a gateway's links.

A link is a peer this gateway talks to: an upstream gateway, a downstream gateway (which announced
itself) or a pool. RTT comes from periodic probes: an HTTP `GET /healthz` to gateways and a TCP
connect (one SYN/SYN-ACK round trip) to a pool's endpoint. Throughput comes from real transfers:
pieces fetched from upstreams and pieces served to peers that name themselves in the
`X-Deltamesh-Peer` header. Samples live in short bounded windows, so percentiles and "recent
throughput" describe the last minutes, not the whole life of the process.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

ROLES = ("upstream", "downstream", "pool")
RTT_WINDOW = 120
TRANSFER_WINDOW_S = 60.0
TRANSFERS_KEPT = 4096
"""Most transfers a link remembers (the newest), however many end within TRANSFER_WINDOW_S."""


@dataclass
class Link:
    peer: str
    role: str
    url: str = ""
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    transfers: deque = field(default_factory=lambda: deque(maxlen=TRANSFERS_KEPT))  # (monotonic end, bytes, seconds)
    bytes_total: int = 0
    errors: int = 0
    last_error: str = ""
    last_transfer: float | None = None  # wall clock
    last_probe: float | None = None
    probe_ok: bool | None = None
    """Whether the newest probe answered (None: never probed); the `link_up` gauge and the link-down alert."""

    def forget_old_transfers(self, now: float) -> None:
        """Drop transfers that ended more than TRANSFER_WINDOW_S before `now` (monotonic)."""
        while self.transfers and now - self.transfers[0][0] > TRANSFER_WINDOW_S:
            self.transfers.popleft()

    def recent_throughput(self, now: float) -> float | None:
        self.forget_old_transfers(now)
        if not self.transfers:
            return None
        start = min(end - secs for end, _, secs in self.transfers)
        busy = max(end for end, _, _ in self.transfers) - start
        total = sum(b for _, b, _ in self.transfers)
        return total / busy if busy > 0 else None


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class LinkMonitor:
    def __init__(self) -> None:
        self._links: dict[tuple[str, str], Link] = {}

    def link(self, peer: str, role: str, url: str = "") -> Link:
        key = (role, peer)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = Link(peer, role, url)
        elif url:
            link.url = url
        return link

    def find(self, peer: str, role: str) -> Link | None:
        return self._links.get((role, peer))

    def links(self) -> list[Link]:
        return [self._links[k] for k in sorted(self._links)]

    def forget(self, peer: str, role: str) -> None:
        self._links.pop((role, peer), None)

    def record_rtt(self, link: Link, seconds: float) -> None:
        link.rtts.append(seconds)
        link.last_probe = time.time()
        link.probe_ok = True

    def record_error(self, link: Link, reason: str) -> None:
        link.errors += 1
        link.last_error = reason[:300]

    def record_transfer(self, link: Link, nbytes: int, seconds: float) -> None:
        now = time.monotonic()
        # Pruned here as well as when read: a gateway whose links no one reads (no /metrics scrape, no
        # `deltamesh links`) would otherwise keep one record per piece it ever served.
        link.forget_old_transfers(now)
        link.transfers.append((now, nbytes, max(seconds, 1e-6)))
        link.bytes_total += nbytes
        link.last_transfer = time.time()

    def describe(self) -> list[dict]:
        now, wall = time.monotonic(), time.time()
        out = []
        for link in self.links():
            rtts = list(link.rtts)
            out.append({
                "peer": link.peer, "role": link.role, "url": link.url,
                "rtt_ms": {
                    "last": round(rtts[-1] * 1000, 3) if rtts else None,
                    "p50": round(_percentile(rtts, 50) * 1000, 3) if rtts else None,
                    "p95": round(_percentile(rtts, 95) * 1000, 3) if rtts else None,
                    "samples": len(rtts),
                },
                "throughput_bps": link.recent_throughput(now),
                "bytes_total": link.bytes_total,
                "errors": link.errors, "last_error": link.last_error, "probe_ok": link.probe_ok,
                "last_transfer_s": None if link.last_transfer is None else round(wall - link.last_transfer, 3),
            })
        return out


async def tcp_rtt(url: str, timeout: float) -> float:
    """Seconds to open (and close) a TCP connection to the host and port of `url`."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    t0 = time.perf_counter()
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    elapsed = time.perf_counter() - t0
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return elapsed


async def probe_forever(
    monitor: LinkMonitor,
    targets: Callable[[], Iterable[tuple[Link, Callable[[], Awaitable[float]]]]],
    interval_s: float,
) -> None:
    """Every `interval_s`, run each target's probe (concurrently) and record its RTT or error."""

    async def one(link: Link, probe: Callable[[], Awaitable[float]]) -> None:
        try:
            monitor.record_rtt(link, await probe())
        except Exception as e:  # any failure of a probe is a fact about the link, not a crash
            link.probe_ok = False
            monitor.record_error(link, f"probe: {type(e).__name__}: {e}")

    while True:
        await asyncio.gather(*(one(link, probe) for link, probe in targets()))
        await asyncio.sleep(interval_s)
