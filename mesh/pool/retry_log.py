"""Trying again after a failure, and saying so once per change rather than once per try.

A pool whose gateways go away retries for as long as they are gone: each try waits longer than the
last (exponential backoff with jitter, `deltamesh.gateway.fetch.scoring.backoff_s`, capped), so that many
pools that lost their gateway together do not come back as one burst, and the log shows the outage,
not the tries: one line when it starts, one "still" line every `remind_s` while it lasts, and one
when it ends (with how long it took).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from deltamesh.gateway.fetch.scoring import backoff_s

BASE_S = 1.0
CAP_S = 30.0
REMIND_S = 300.0

log = logging.getLogger(__name__)


class Outage:
    """Whether `what` (a pool's sync, its heartbeats) keeps failing; `failed` books a failure and returns
    how long to wait before the next try, `succeeded` ends the outage."""

    def __init__(self, what: str, *, base_s: float = BASE_S, cap_s: float = CAP_S, remind_s: float = REMIND_S,
                 retrying: str = "", clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        """`retrying`: how the caller tries again, for the first line (default: the backoff's bounds)."""
        self.what, self.base_s, self.cap_s, self.remind_s = what, base_s, cap_s, remind_s
        self.retrying = retrying or f"with backoff (up to {cap_s:.0f} s apart)"
        self._clock = clock
        self._rng = rng or random.Random()
        self.failures = 0
        self._since = self._told = 0.0

    def failed(self, reason: str, *, quiet: bool = False) -> float:
        """Book a failed try; the seconds to wait before the next one. `quiet`: the failure was logged
        already, by whoever found it."""
        now = self._clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._told = now
            if not quiet:
                log.warning("%s: %s; trying again %s", self.what, reason, self.retrying)
        elif now - self._told >= self.remind_s:
            self._told = now
            log.warning("%s: still failing after %s (%d tries): %s", self.what, _span(now - self._since),
                        self.failures, reason)
        return backoff_s(self.failures, self.base_s, self.cap_s, self._rng)

    def succeeded(self) -> None:
        """A try worked: the outage, if any, is over."""
        if self.failures:
            log.info("%s: working again after %s (%d failed tries)", self.what, _span(self._clock() - self._since),
                     self.failures)
        self.failures = 0


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
