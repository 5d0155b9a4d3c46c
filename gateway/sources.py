"""Where pieces come from: the gateways a fetch may use, each with its health, an optional bandwidth
cap (`RateLimiter`, shared by every transfer over the link) and an optional emulated latency, and
the order they are tried in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

from deltamesh.gateway.links import Link


class RateLimiter:
    """Caps the bytes per second of one link, shared by all concurrent transfers over it."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.05):
        self.bytes_per_s = bytes_per_s
        self.burst_s = burst_s
        self._free_at = 0.0

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        # A virtual clock of when the link is next free: each transfer books its bytes' airtime.
        self._free_at = max(self._free_at, now - self.burst_s) + nbytes / self.bytes_per_s
        delay = self._free_at - now
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass(eq=False)
class Source:
    """A gateway to fetch from, with its health, optional bandwidth cap and optional added latency."""

    url: str
    link: Link | None = None
    limiter: RateLimiter | None = None
    bad_until: float = 0.0
    delay_s: float = 0.0
    """Emulated latency: every request to this source waits this long before it is sent."""

    def healthy(self, now: float) -> bool:
        return self.bad_until <= now


def version_url(base: str, model: str, version: int, kind: str) -> str:
    """Where a gateway at `base` serves one version: `/manifest` and `/pieces/{index}` below it."""
    return f"{base}/v1/models/{model}/versions/{version}/{kind}"


def order_sources(sources: Sequence[Source]) -> list[Source]:
    """Healthy sources in preference order; if none is healthy, the one penalised longest ago first."""
    now = time.monotonic()
    healthy = [s for s in sources if s.healthy(now)]
    return healthy or sorted(sources, key=lambda s: s.bad_until)
