"""The downstream gateways that announced themselves to this one: bounded, expiring, and probed only when vouched for.

A relay announces itself to its upstreams (`POST /v1/gateways`) so that they name its link and
measure it. An announcement holds for `ttl_s` and is renewed by the next one; one that lapses is
forgotten (with its link), so a relay that went away, or a flood of made-up regions, cannot grow this
table past `limit`. Only an announcement from an authenticated gateway (a `gateway` token or client
certificate) makes this gateway probe the announced URL: a URL from an unauthenticated party (an
anonymous gateway takes announcements without credentials) is never fetched, or one could point it
at any host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator


class TooManyDownstreams(Exception):
    """The table is full of live announcements from other regions."""


@dataclass
class Downstream:
    region: str
    url: str
    expires: float
    probe: bool
    """Announced by an authenticated gateway: its URL may be probed."""


class Downstreams:
    def __init__(self, limit: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self._clock = clock
        self._table: dict[str, Downstream] = {}

    def announce(self, region: str, url: str, *, probe: bool) -> tuple[Downstream, list[str]]:
        """Record (or renew) `region`'s announcement; returns it and the regions that lapsed meanwhile.
        Raises TooManyDownstreams when `limit` live others are held."""
        lapsed = self.expire()
        if region not in self._table and len(self._table) >= self.limit:
            raise TooManyDownstreams(f"this gateway already follows {self.limit} downstream gateways")
        entry = self._table[region] = Downstream(region, url, self._clock() + self.ttl_s, probe)
        return entry, lapsed

    def expire(self) -> list[str]:
        """Forget the announcements that lapsed; returns their regions."""
        now = self._clock()
        lapsed = [r for r, d in self._table.items() if d.expires <= now]
        for region in lapsed:
            del self._table[region]
        return lapsed

    def __iter__(self) -> Iterator[Downstream]:
        return iter(list(self._table.values()))

    def __contains__(self, region: str) -> bool:
        return region in self._table

    def __len__(self) -> int:
        return len(self._table)
