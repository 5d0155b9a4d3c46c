"""Which version the evaluator scores next: version 0, every k-th version in order, and any asked for.

Pure bookkeeping, no I/O. A version is due when it is 0, a multiple of `every` (when `every` > 0), or
requested; it stays due until it is scored or skipped (no longer at any gateway). The evaluator's
engine only moves forward, so `next_after(held)` is the smallest due version above the one the engine
holds; a requested version at or below it is a `past_request`, scored from a full snapshot instead.
`waiting(head)` counts the due versions published up to `head` that are not scored yet: how far
evaluation lags the trainer.
"""

from __future__ import annotations

from typing import Iterable


class Schedule:
    def __init__(self, every: int, done: Iterable[int] = ()) -> None:
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.every = every
        self.done: set[int] = set(done)
        """Versions scored or skipped."""
        self.requested: set[int] = set()

    def due(self, version: int) -> bool:
        if version in self.done:
            return False
        return version == 0 or version in self.requested or (self.every > 0 and version % self.every == 0)

    def request(self, version: int) -> bool:
        """Ask for `version`; False if it is already scored (or skipped)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if version in self.done:
            return False
        self.requested.add(version)
        return True

    def finished(self, version: int) -> None:
        """`version` was scored or skipped: no longer due."""
        self.done.add(version)
        self.requested.discard(version)

    def next_after(self, held: int | None) -> int | None:
        """The smallest due version above `held` (from 0 when None); None when nothing more is due
        (`every` is 0 and no later version was asked for)."""
        start = 0 if held is None else held + 1
        candidates = [v for v in self.requested if v >= start]
        if self.every > 0 or start == 0:
            v = start if start == 0 else -(-start // self.every) * self.every
            while v in self.done:
                if self.every == 0:
                    v = -1
                    break
                v += self.every
            if v >= 0:
                candidates.append(v)
        return min(candidates) if candidates else None

    def past_request(self, held: int | None) -> int | None:
        """The oldest requested version at or below `held` (the engine would have to move back)."""
        older = [v for v in self.requested if held is not None and v <= held]
        return min(older) if older else None

    def waiting(self, head: int | None) -> int:
        """Due versions up to `head` not yet scored."""
        if head is None:
            return 0
        everyth = set(range(0, head + 1, self.every)) if self.every > 0 else {0}
        return len({v for v in everyth | self.requested if v <= head} - self.done)
