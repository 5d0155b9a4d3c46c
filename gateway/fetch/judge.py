"""What one fetch holds against its sources, version by version, and the rounds it asks them in.

Per piece (or manifest) of a version it keeps each source's tries (`deltamesh.gateway.fetch.scoring.Tries`);
per version, the sources that served bad bytes of it, which are asked after every other one. A
failure is booked once, here: the try, a penalty on the source, an error on its link, a log line.
Every request of a fetch, for a manifest or for a piece, walks the usable sources the same way
(`SourceJudge.rounds`), so both give up by the same rules. How one request is made is the caller's:
`deltamesh.gateway.fetch.fetcher.Fetcher`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.fetch.scoring import Tries, penalise
from deltamesh.gateway.fetch.sources import Source, order_sources

log = logging.getLogger(__name__)

MANIFEST = -1
"""The index under which a version's manifest keeps its tries (pieces use their own index)."""

Key = tuple[str, int, str]
"""(model, version, kind)"""


class FetchError(Exception):
    """No source delivered a piece (or manifest): every one served it wrong too often, or none in time."""


def name(key: Key) -> str:
    return f"{key[0]} v{key[1]} {key[2]}"


class Turn(enum.Enum):
    """How one request of a round ended, when it brought nothing to keep."""

    FAILED = "failed"
    """The source failed (already booked): ask the next one."""
    NOT_YET = "not yet"
    """Not arrived at the source, which has kept us waiting long enough: ask the next one too, and
    poll again shortly."""
    WAIT = "wait"
    """Not arrived yet at the preferred source, which is about to get it: end the round and poll it
    again shortly, before troubling the others."""


@dataclass
class SourceJudge:
    sources: Sequence[Source]
    penalty_s: float
    """First penalty of a failing source; it doubles with each failure in a row."""
    source_tries: int
    monitor: LinkMonitor | None = None
    rng: random.Random = field(default_factory=random.Random)
    _tries: dict[tuple[Key, int], Tries] = field(default_factory=dict, init=False, repr=False)
    _avoid: dict[Key, set[Source]] = field(default_factory=dict, init=False, repr=False)
    """Per version, the sources that served bad bytes of it: asked after every other one."""

    def order(self, key: Key) -> list[Source]:
        return order_sources(self.sources, self._avoid.get(key, ()))

    def tries(self, key: Key, index: int) -> Tries:
        return self._tries.setdefault((key, index), Tries(self.source_tries))

    def failed(self, source: Source, key: Key, index: int, reason: str, *, wrong: bool) -> None:
        """Book a failure of `source` on a piece (or the manifest): backoff, penalty, link error, log."""
        what = "manifest" if index == MANIFEST else f"piece {index}"
        self.tries(key, index).failed(source, reason, wrong=wrong, rng=self.rng)
        self.note(source, f"{name(key)} {what}: {reason}")

    def note(self, source: Source, reason: str, penalty: bool = True) -> None:
        if penalty:
            penalise(source, self.penalty_s, self.rng)
        if self.monitor is not None and source.link is not None:
            self.monitor.record_error(source.link, reason)
        log.info("fetch from %s: %s", source.url, reason)

    def served_bad(self, source: Source, key: Key, index: int, reason: str) -> None:
        self._avoid.setdefault(key, set()).add(source)
        self.failed(source, key, index, reason, wrong=True)

    def forget_manifest(self, key: Key) -> None:
        self._tries.pop((key, MANIFEST), None)

    def clear_suspects(self, key: Key) -> None:
        """Stop asking the sources that served bad bytes of a version last."""
        self._avoid.pop(key, None)

    def forget(self, key: Key) -> None:
        """Drop all that is held about one version (its pieces are fetched, or given up)."""
        self.clear_suspects(key)
        for k in [k for k in self._tries if k[0] == key]:
            del self._tries[k]

    async def rounds(self, key: Key, index: int, deadline: float, ask: Callable[[Source, bool], Awaitable[object]],
                     exhausted: str, timed_out: Callable[[], str]) -> object:
        """Ask the sources of a piece (or manifest) that have tries left, best first, round after round,
        until `ask(source, alternates)` returns anything but a `Turn`: that is the result. A source is
        skipped while it is backed off; between rounds the wait is a short poll while one said it is on
        its way, else until the first backoff ends. FetchError (`exhausted`, or `timed_out()` past
        `deadline`) when no source is left or time is up."""
        tries = self.tries(key, index)
        attempt = 0
        while True:
            order = tries.usable(self.order(key))
            if not order:
                raise FetchError(f"{exhausted} ({tries.describe()})")
            waiting = False
            for source in order:
                if tries.ready_at(source) > time.monotonic():
                    continue
                turn = await ask(source, len(order) > 1)
                if not isinstance(turn, Turn):
                    return turn
                waiting = waiting or turn is not Turn.FAILED
                if turn is Turn.WAIT:
                    break
            if time.monotonic() > deadline:
                raise FetchError(timed_out())
            attempt += 1
            await asyncio.sleep(tries.pause(order, waiting, attempt, deadline))
