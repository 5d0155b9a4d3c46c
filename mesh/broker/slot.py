"""The broker a process serves with right now: `BrokerSlot`.

On an embedded SQLite store there is one broker and it is always active. On a shared PostgreSQL
database a process is active only while it holds the leadership lease (leadership.py): when it is
elected, a fresh `Broker` opens the store fenced by the lease's epoch and rebuilds its whole working
state from the database; when it is deposed, that broker is dropped at once (so no request is served
from its memory any more) and closed. Meanwhile, and while standing by, `current()` raises `Standby`
naming the active broker's URL, which the HTTP layer answers as 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.service import Broker
from deltamesh.mesh.broker.store_interface import LeaderTerm

if TYPE_CHECKING:  # leadership.py needs psycopg, which a broker on SQLite never imports
    from deltamesh.mesh.broker.leadership import Leadership

log = logging.getLogger(__name__)


class Standby(Exception):
    """This broker is not the active one; `leader` is the active broker's URL ("" when none is known)."""

    def __init__(self, leader: str) -> None:
        super().__init__(f"this broker is standing by; the active broker is {leader or 'not known yet'}")
        self.leader = leader


class BrokerSlot:
    def __init__(self, make_broker: Callable[[LeaderTerm | None], Broker], metrics: BrokerMetrics,
                 leadership: Leadership | None = None) -> None:
        self._make_broker = make_broker
        self.metrics = metrics
        self.leadership = leadership
        self.broker: Broker | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.leadership is None:
            self.broker = self._make_broker(None)
            await self.broker.start()
            self.metrics.leader.set(1)
            return
        self.metrics.leader.set(0)
        self._task = asyncio.create_task(self.leadership.run(self._elected, self._deposed), name="broker-leadership")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        elif self.broker is not None:
            await self.broker.close()
            self.broker = None

    def current(self) -> Broker:
        """The active broker, or Standby."""
        lead = self.leadership
        if self.broker is None or (lead is not None and not lead.is_active()):
            # between its lease running out and its next look at the database, a broker knows only
            # that it does not lead: it must not name itself
            raise Standby(lead.leader_url if lead is not None and lead.leader_url != lead.url else "")
        return self.broker

    def role(self) -> dict[str, str]:
        """For /healthz: whether this broker is active, and which one is."""
        if self.leadership is None:
            return {"role": "active"}
        try:
            self.current()
        except Standby as e:
            return {"role": "standby", "leader": e.leader}
        return {"role": "active", "leader": self.leadership.url}

    async def _elected(self, term: LeaderTerm) -> None:
        broker = self._make_broker(term)
        try:
            await broker.start()
        except BaseException:
            await broker.close()
            raise
        self.broker = broker
        self.metrics.leader.set(1)
        self.metrics.elections.inc()

    async def _deposed(self) -> None:
        broker, self.broker = self.broker, None
        self.metrics.leader.set(0)
        if broker is not None:
            log.warning("this broker is no longer the active one: dropping its working state")
            await broker.close()
