"""How a fetch judges its sources: bounded tries per piece, exponential backoff with jitter, and penalties.

Failures come in two kinds. A source that *served something wrong* (bytes that fail the piece's
hash, a body that ended short, more bytes than asked for, a range answered whole, or a transfer that
fell below the minimum useful rate or stalled) has a `Tries.limit` of such failures on one piece (or
manifest); after that it is not asked for that piece again, and a piece every source has used up
its tries on fails its version with one error naming the piece and what each source did. A source
that could not be reached or answered an HTTP error is not counted against that limit (a gateway
restarting is not a liar), only backed off; the fetch's time limit bounds those. Either way a
source is asked again only after an exponential backoff with jitter (`backoff_s`), so nothing spins
on a bad source, and it is penalised on its `Source` for a while (a penalty that doubles with each
failure in a row and resets on a success), so other fetches prefer its alternates meanwhile.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from deltamesh.gateway.fetch.sources import Source

RETRY_BASE_S = 0.1
"""First wait before a source that failed a piece is asked for it again; it doubles per failure."""
RETRY_CAP_S = 5.0
PENALTY_CAP_S = 120.0
"""Longest a source stays at the back of the queue after failures in a row."""


def backoff_s(failures: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: `base_s` * 2^(failures-1), at most `cap_s`, times a random factor
    in [0.5, 1.5) so that many fetchers that failed together do not come back together."""
    return min(cap_s, base_s * 2 ** min(max(failures - 1, 0), 30)) * (0.5 + rng.random())


def penalise(source: Source, base_s: float, rng: random.Random) -> float:
    """Put `source` at the back of every fetch's queue for a while: `base_s`, doubling with each failure
    in a row (to `PENALTY_CAP_S`); returns the penalty in seconds."""
    source.strikes += 1
    penalty = backoff_s(source.strikes, base_s, PENALTY_CAP_S, rng)
    source.bad_until = max(source.bad_until, time.monotonic() + penalty)
    return penalty


@dataclass
class Tries:
    """What each source did with one piece (or manifest) of one version: failures, when it may be asked
    again, and why it failed last."""

    limit: int
    """Failures of the served-something-wrong kind after which a source is not asked for it again."""
    wrong: dict[Source, int] = field(default_factory=dict)
    failures: dict[Source, int] = field(default_factory=dict)
    next_at: dict[Source, float] = field(default_factory=dict)
    reasons: dict[Source, str] = field(default_factory=dict)

    def usable(self, sources: list[Source]) -> list[Source]:
        """`sources` (in order) that have tries left."""
        return [s for s in sources if self.wrong.get(s, 0) < self.limit]

    def ready_at(self, source: Source) -> float:
        return self.next_at.get(source, 0.0)

    def failed(self, source: Source, reason: str, *, wrong: bool, rng: random.Random,
               base_s: float = RETRY_BASE_S, cap_s: float = RETRY_CAP_S) -> None:
        """Book a failure: counted against the limit when `wrong`; the source's next try is backed off."""
        if wrong:
            self.wrong[source] = self.wrong.get(source, 0) + 1
        n = self.failures[source] = self.failures.get(source, 0) + 1
        self.next_at[source] = time.monotonic() + backoff_s(n, base_s, cap_s, rng)
        self.reasons[source] = reason

    def pause(self, sources: list[Source], waiting: bool, attempt: int, deadline: float) -> float:
        """How long to wait before the next round over `sources`: a short poll while one says the piece
        is on its way, else until the first one's backoff ends (never much past `deadline`)."""
        if waiting:
            return min(0.02 * 2 ** min(attempt, 6), 0.25)
        return max(0.005, min(min(self.ready_at(s) for s in sources), deadline + 0.01) - time.monotonic())

    def exclude(self, source: Source, reason: str) -> None:
        """Never ask `source` for this again (what it sent cannot get better: a bad signature)."""
        self.wrong[source] = self.limit
        self.failures[source] = self.failures.get(source, 0) + 1
        self.reasons[source] = reason

    def describe(self) -> str:
        """Each source's failures and last reason, for the one error that ends a fetch."""
        return "; ".join(f"{s.url}: {self.reasons.get(s, '?')} ({n} failed "
                         f"{'request' if n == 1 else 'requests'})" for s, n in self.failures.items()) or "no source tried"
