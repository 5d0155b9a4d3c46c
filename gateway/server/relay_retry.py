"""When a relay tries again to mirror a version whose last attempt failed.

A mirror fails when no upstream serves a piece intact within its tries, when the disk is full, or
when something unexpected breaks; the relay then tries that version again after an exponential
backoff with jitter (1 s, 2 s, 4 s ... up to a minute), while every other version and model goes on
as usual: one stuck version never blocks the next, and a hostile upstream gets a few requests a
minute for it instead of a stream. A success forgets the failures; `describe` lists what is waiting
(`retry_in_s` null while a try is under way).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from deltamesh.gateway.fetch.scoring import backoff_s

RETRY_BASE_S = 1.0
RETRY_CAP_S = 60.0

Key = tuple[str, int, str]
"""(model, version, kind)"""


@dataclass
class Failure:
    count: int
    next_at: float
    reason: str


class RetrySchedule:
    """Failed mirrors by version, and when each may be tried again."""

    def __init__(self, base_s: float = RETRY_BASE_S, cap_s: float = RETRY_CAP_S):
        self.base_s, self.cap_s = base_s, cap_s
        self._failed: dict[Key, Failure] = {}
        self._rng = random.Random()

    def ready(self, key: Key) -> bool:
        failure = self._failed.get(key)
        return failure is None or failure.next_at <= time.monotonic()

    def started(self, key: Key) -> None:
        """A failed version is being tried again: no retry is due for it until this try ends."""
        if key in self._failed:
            self._failed[key].next_at = math.inf

    def failed(self, key: Key, reason: str) -> float:
        """Book a failed attempt; returns the seconds until the next one."""
        count = self._failed[key].count + 1 if key in self._failed else 1
        delay = backoff_s(count, self.base_s, self.cap_s, self._rng)
        self._failed[key] = Failure(count, time.monotonic() + delay, reason[:300])
        return delay

    def succeeded(self, key: Key) -> None:
        self._failed.pop(key, None)

    def forget_unless(self, keep) -> None:
        """Drop the versions for which `keep(key)` is false (collected, or no longer wanted)."""
        for key in [k for k in self._failed if not keep(k)]:
            del self._failed[key]

    def next_due(self) -> float | None:
        """Seconds until the earliest retry (0 if one is due), None when nothing waits (tries under way
        are not waiting)."""
        waiting = [f.next_at for f in self._failed.values() if f.next_at != math.inf]
        return max(0.0, min(waiting) - time.monotonic()) if waiting else None

    def __len__(self) -> int:
        return len(self._failed)

    def describe(self) -> list[dict]:
        now = time.monotonic()
        return [{"model": k[0], "version": k[1], "kind": k[2], "failures": f.count,
                 "retry_in_s": None if f.next_at == math.inf else round(max(0.0, f.next_at - now), 1),
                 "error": f.reason}
                for k, f in sorted(self._failed.items())]
