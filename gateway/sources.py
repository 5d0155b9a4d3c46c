"""Where pieces come from: the gateways a fetch may use, each with its health (a penalty after
failures, see `deltamesh.gateway.scoring`), the rate its transfers reach, an optional bandwidth cap
(`RateLimiter`, shared by every transfer over the link) and an optional emulated latency, and the
order they are tried in.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Collection, Sequence

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


RATE_SAMPLE_MIN_BYTES = 64 * 1024
"""Requests smaller than this say little about a link's rate (slow start, latency) and are not sampled."""


@dataclass(eq=False)
class Source:
    """A gateway to fetch from, with its health, optional bandwidth cap and optional added latency."""

    url: str
    link: Link | None = None
    limiter: RateLimiter | None = None
    bad_until: float = 0.0
    """Until when (monotonic clock) the source is asked only after every healthy one."""
    delay_s: float = 0.0
    """Emulated latency: every request to this source waits this long before it is sent."""
    strikes: int = 0
    """Failures in a row: each one doubles the next penalty; a success resets it."""
    rate_bps: float = 0.0
    """Moving average of the bytes per second of this source's recent piece requests (0: unknown)."""

    def healthy(self, now: float) -> bool:
        return self.bad_until <= now

    def served(self, nbytes: int, seconds: float) -> None:
        """Book a request that delivered what it was asked for: the source is well again, and the rate
        it reached (from requests big enough to measure) feeds its moving average."""
        self.strikes = 0
        if nbytes >= RATE_SAMPLE_MIN_BYTES and seconds > 0:
            rate = nbytes / seconds
            self.rate_bps = rate if not self.rate_bps else 0.7 * self.rate_bps + 0.3 * rate


def order_sources(sources: Sequence[Source], avoid: Collection[Source] = ()) -> list[Source]:
    """Every source, best first: healthy ones in preference order, then penalised ones (the one whose
    penalty ends first, first); those in `avoid` (which served bad bytes of the version at hand) last."""
    now = time.monotonic()
    rank = {id(s): i for i, s in enumerate(sources)}
    return sorted(sources, key=lambda s: (s in avoid, not s.healthy(now), s.bad_until if not s.healthy(now) else 0.0,
                                          rank[id(s)]))
