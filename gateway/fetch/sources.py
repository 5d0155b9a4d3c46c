"""Where pieces come from: the gateways a fetch may use, each with its health (a penalty after
failures, see `deltamesh.gateway.fetch.scoring`), the rate its transfers reach, an optional bandwidth cap
(`RateLimiter`, shared by every transfer over the link) and an optional emulated latency, and the
order they are tried in (`ask_first`: a JSON call to the first gateway that answers it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import aiohttp

from deltamesh.gateway.fetch.errors import SyncError, credentials_refused, unreachable
from deltamesh.gateway.fetch.links import Link
from deltamesh.http import HttpError, request_json


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


async def ask_first(session: aiohttp.ClientSession, sources: Sequence[Source], method: str, path: str, *,
                    params: dict | None = None, body: Any = None, headers: dict[str, str] | None = None,
                    timeout_s: float = 0.0, stall_timeout_s: float, prefer: Source | None = None,
                    pool: str) -> tuple[Source, Any]:
    """A pool's JSON call to the first gateway that answers it (`prefer` first, then `order_sources`);
    the gateway and its answer. A gateway that cannot be reached or fails (5xx) is asked last
    for a while; CredentialsError when every gateway refused the pool's credentials."""
    errors, denied, failures = [], [], []
    ordered = order_sources(sources)
    if prefer is not None:
        ordered = [prefer] + [s for s in ordered if s is not prefer]
    for source in ordered:
        try:
            return source, await request_json(session, method, f"{source.url}{path}", params=params, body=body,
                                              headers=headers, timeout_s=timeout_s + stall_timeout_s)
        except HttpError as e:
            errors.append(str(e))
            failures.append(e)
            if e.status in (401, 403):  # perhaps only this gateway has not learned of the pool's token
                denied.append(str(e))
            elif e.status == 0 or e.status >= 500:
                source.bad_until = time.monotonic() + min(stall_timeout_s, 5.0)
            elif e.status != 404:
                raise
    if denied and len(denied) == len(errors):
        raise credentials_refused(pool, denied)
    raise SyncError("no gateway answered: " + "; ".join(errors)) from unreachable(failures)
