"""Taking over a stalled request at the end of a version, so that one slow connection does not hold it.

A long lossy link stalls single connections: a lost retransmission costs a retransmission timeout
(seconds, doubling each time), during which that connection moves nothing while the others are fine.
Mid-version that costs little (the other connections carry on), but the version is done only when its
last piece is, so at its end every other connection would sit idle waiting for the stalled one. So a
connection with nothing left to ask for (an idle lane, `deltamesh.gateway.fetch.lanes`) looks for a
request of the same version that has moved no byte for a while (one that never answered at all, for
four times `after_s`: it may be a piece still on its way to its source, which another request would
only wait for too) and asks for what that request has left on its own connection. How long "a while"
is follows the link: twice the median time to first byte of this version's requests (a moving request
receives bytes about every round trip, so two round trips of silence is a connection in loss
recovery), within [`MIN_AFTER_S`, `after_s`]; `after_s` until a few requests have answered.
Whichever request finishes first wins and the other is cancelled; what the loser had received is not
needed. At most one take-over runs per request at a time, and a failed one leaves the request as it was.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

from deltamesh.gateway.fetch.http_reads import Span

log = logging.getLogger(__name__)

HEDGE_AFTER_S = 1.0
"""Longest silence of a request (no byte) after which an idle connection takes over what it has left
(over three round trips of a 300 ms link, where a request that moves receives bytes every round trip);
the one used until the version's requests have shown how long the link's round trip is."""
MIN_AFTER_S = 0.25
"""Shortest silence taken for a stall, however short the round trip (a busy server pauses that long)."""
RTT_FACTOR = 2.0
"""A stall is this many median times to first byte without a byte."""
FIRST_BYTE_SAMPLES = 3
"""Times to first byte needed before they set the stall threshold."""
UNANSWERED_FACTOR = 4.0
"""A request that has not answered at all is taken over after this many times `after_s`."""

T = TypeVar("T")


@dataclass(eq=False)
class Flight:
    """One request in flight that an idle lane may take over."""

    left: Callable[[], int]
    """Bytes it still has to receive."""
    take_over: Callable[[], Awaitable[Any]]
    """Fetch what it has left another way (on another connection); returns what the owner needs."""
    what: str
    moved: float = field(default_factory=time.monotonic)
    last_left: int = -1
    started: bool = False
    """It has received bytes (it answered): a silence now is a stalled connection."""
    taking: bool = False
    outcome: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Resolved by a take-over that ended: with what it fetched, or its error."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def look(self, now: float) -> None:
        """Note any progress since the last look."""
        left = self.left()
        if self.last_left >= 0 and left < self.last_left:
            self.moved, self.started = now, True
        self.last_left = left

    def stalled_for(self, now: float) -> float:
        return now - self.moved


class TakenOver:
    """What `Flights.race` returns when a take-over won: `value` is what `take_over` returned."""

    def __init__(self, value: Any):
        self.value = value


class Flights:
    """The requests of one version in flight, and the take-overs of the idle lanes."""

    def __init__(self, after_s: float = HEDGE_AFTER_S):
        self.after_s = after_s
        self.first_bytes: deque[float] = deque(maxlen=64)
        """Seconds from asking to the first byte of this version's latest requests (`note_first_byte`)."""
        self.live: list[Flight] = []
        self.taken_over = 0
        """Take-overs that won (each one a request that had stalled)."""
        self._changed = asyncio.Event()
        """Set (and replaced) when a request ends: idle lanes waiting for a stall look again at once, and
        the last one to end lets them all go, so the version's end is not held up by their polling."""

    def note_first_byte(self, seconds: float) -> None:
        """A request of this version received its first byte `seconds` after it was sent."""
        self.first_bytes.append(seconds)

    def stall_after(self) -> float:
        """Silence of a request that has answered after which it counts as stalled."""
        if len(self.first_bytes) < FIRST_BYTE_SAMPLES:
            return self.after_s
        return min(self.after_s, max(MIN_AFTER_S, RTT_FACTOR * statistics.median(self.first_bytes)))

    async def race(self, work: Awaitable[T], left: Callable[[], int], take_over: Callable[[], Awaitable[Any]],
                   what: str) -> T | TakenOver:
        """Run `work` (a request, with its retries); while it runs an idle lane may take it over
        (`hedge`). Returns `work`'s result, or TakenOver once a take-over finished first (`work` is
        then cancelled and has ended). If `work` fails while a take-over runs, that one decides."""
        flight = Flight(left, take_over, what)
        flight.last_left = left()
        self.live.append(flight)
        task = asyncio.ensure_future(work)
        try:
            while True:
                outcome = flight.outcome
                await asyncio.wait({task, outcome}, return_when=asyncio.FIRST_COMPLETED)
                if outcome.done():
                    if not outcome.cancelled() and outcome.exception() is None:
                        await _cancelled(task)
                        return TakenOver(outcome.result())
                    # That take-over failed: the request goes on as it was, and may be taken over again.
                    flight.outcome = asyncio.get_running_loop().create_future()
                    continue
                if task.exception() is None or not flight.taking:
                    return task.result()
                try:  # the request failed while a take-over runs: the take-over decides
                    return TakenOver(await outcome)
                except Exception:
                    return task.result()
        finally:
            self.live.remove(flight)
            flight.ended.set()
            self._changed.set()
            self._changed = asyncio.Event()
            await _cancelled(task)

    async def hedge(self) -> bool:
        """For a lane with nothing left to ask for: wait until a request in flight has stalled and take
        it over; True once that ended (won, lost or failed), False when no request is left to wait for."""
        while self.live:
            now = time.monotonic()
            after = self.stall_after()
            poll = min(0.25, after / 4)
            for flight in self.live:
                flight.look(now)
            ready = [f for f in self.live if not f.taking and not f.outcome.done() and f.left() > 0 and f.stalled_for(now) >= (
                after if f.started else UNANSWERED_FACTOR * self.after_s)]
            if not ready:
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), poll)
                except TimeoutError:
                    pass
                continue
            flight = max(ready, key=lambda f: f.left())
            await self._take(flight)
            return True
        return False

    async def _take(self, flight: Flight) -> None:
        log.info("%s moved nothing for %.1fs: asking for its last %d bytes on another connection",
                 flight.what, flight.stalled_for(time.monotonic()), flight.left())
        flight.taking = True
        taken = flight.outcome
        task = asyncio.ensure_future(flight.take_over())
        ended = asyncio.ensure_future(flight.ended.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled() and not flight.ended.is_set():
                error = task.exception()
                if error is None:
                    self.taken_over += 1
                    taken.set_result(task.result())
                else:
                    log.info("taking over %s failed: %s", flight.what, error)
                    taken.set_exception(error)
        finally:
            flight.taking = taken.done() and not taken.cancelled() and taken.exception() is None  # won: stays taken
            if not taken.done():
                taken.cancel()
            ended.cancel()
            await _cancelled(task)
            await _cancelled(ended)


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel `task` if it is still running and wait until it has ended (its outcome is not needed)."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def race_span(flights: Flights, work: Awaitable[object], span: Span, refill: Callable[[Span], Awaitable[None]],
                    what: str) -> None:
    """Fill `span` with `work`, or with a take-over that asks for its bytes from `span.filled` on (into
    the same buffer, `refill`) if `work` stalls at the end of a version; either way `span` is full after."""

    async def take_over() -> Span:
        twin = Span(span.data, span.filled, span.end)
        await refill(twin)
        return twin

    got = await flights.race(work, lambda: span.end - span.filled, take_over, what)
    if isinstance(got, TakenOver):  # `work` has ended: nothing writes into the span any more
        span.sources.extend(s for s in got.value.sources if s not in span.sources)
        span.filled = span.end
