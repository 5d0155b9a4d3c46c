"""Which of several brokers on one PostgreSQL database is active: a lease with an expiry and an epoch.

The lease is the one row of `broker_leader` (holder, url, epoch, expires_at). The active broker renews
it every `ttl_s / 3`; a standby polls it and takes it once it has expired, raising the epoch. The epoch
is the fencing token: PostgresStore checks (holder, epoch, not expired) under a row lock at the start
of every write transaction, so a broker that lost the lease (killed, paused, cut off from the
database) cannot commit anything even if it wakes up later. Expiry is judged by the database's clock
alone, so the brokers' hosts need no synchronised clocks. A session advisory lock would not do: it
stays held for as long as a SIGSTOPped process keeps its connection open.

Locally, the active broker counts itself active only until `ttl_s - margin` after it *sent* its last
successful renewal (monotonic clock): that moment comes before the database lets anyone else take the
lease, so two brokers never both believe they are active, and a paused process finds its lease stale
the moment it resumes, before it answers anyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import psycopg

from deltamesh.mesh.broker.config import LeaderConfig
from deltamesh.mesh.broker.store_interface import LeaderTerm

log = logging.getLogger(__name__)

_ACQUIRE = """
INSERT INTO broker_leader AS l (id, holder, url, epoch, expires_at)
VALUES (1, %(holder)s, %(url)s, 1, clock_timestamp() + make_interval(secs => %(ttl)s))
ON CONFLICT (id) DO UPDATE
    SET holder = EXCLUDED.holder, url = EXCLUDED.url, epoch = l.epoch + 1, expires_at = EXCLUDED.expires_at
    WHERE l.expires_at < clock_timestamp()
RETURNING epoch
"""
_RENEW = """
UPDATE broker_leader SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE id = 1 AND holder = %(holder)s AND epoch = %(epoch)s AND expires_at > clock_timestamp()
RETURNING epoch
"""
_RESIGN = "UPDATE broker_leader SET expires_at = clock_timestamp() WHERE id = 1 AND holder = %s AND epoch = %s"
_CURRENT = "SELECT url FROM broker_leader WHERE id = 1 AND expires_at > clock_timestamp()"


class Leadership:
    """One broker's side of the lease. `run` stands by, takes the lease when it is free, calls
    `on_elected(term)` (the broker rebuilds its state from the database), renews, and calls
    `on_deposed()` as soon as the lease is lost; then it stands by again, until cancelled."""

    def __init__(self, dsn: str, holder: str, url: str, settings: LeaderConfig, *,
                 prepare: Callable[[], object] = lambda: None) -> None:
        self.dsn = dsn
        self._prepare = prepare  # creates or migrates the schema; run (on a thread) before the first lease
        self._prepared = False
        self.holder = holder
        self.url = url
        self.settings = settings
        self.term: LeaderTerm | None = None
        self.leader_url = ""  # the active broker as last seen: where a standby sends its callers
        self._valid_until = 0.0
        self._conn: psycopg.Connection | None = None

    def is_active(self) -> bool:
        """Whether this broker may serve now (see the module docstring for why it is a local check)."""
        return self.term is not None and time.monotonic() < self._valid_until

    async def run(self, on_elected: Callable[[LeaderTerm], Awaitable[None]],
                  on_deposed: Callable[[], Awaitable[None]]) -> None:
        try:
            while True:
                term = await self._stand_by()
                try:
                    await on_elected(term)
                except Exception as e:  # e.g. the database went away while loading: give the lease back
                    log.warning("taking over as broker epoch %d failed: %s", term.epoch, e)
                    await self._step_down(on_deposed, resign=True)
                    continue
                log.info("active broker (epoch %d) at %s", term.epoch, self.url)
                await self._hold()
                await self._step_down(on_deposed, resign=False)
        finally:
            if self.term is not None:
                await self._step_down(on_deposed, resign=True)
            await asyncio.to_thread(self._disconnect)

    async def _stand_by(self) -> LeaderTerm:
        while True:
            sent = time.monotonic()
            try:
                epoch, leader = await asyncio.to_thread(self._try_acquire)
            except Exception as e:  # unreachable, or a schema this broker cannot use: keep trying, loudly
                log.warning("broker lease: cannot take part (%s)", (str(e).strip() or repr(e)).splitlines()[0])
                await asyncio.to_thread(self._disconnect)
            else:
                if epoch is not None:
                    self.term = LeaderTerm(self.holder, epoch)
                    self._valid_until = sent + self.settings.ttl_s - self.settings.margin_s
                    self.leader_url = self.url
                    return self.term
                if leader != self.leader_url:
                    log.info("standing by; the active broker is %s", leader or "(none)")
                self.leader_url = leader
            await asyncio.sleep(min(0.5, self.settings.ttl_s / 4))

    async def _hold(self) -> None:
        """Renew until the lease is lost: taken by another broker, or not renewed in time."""
        assert self.term is not None
        while True:
            await asyncio.sleep(max(0.0, min(self.settings.ttl_s / 3, self._valid_until - time.monotonic())))
            if not self.is_active():
                log.warning("broker lease (epoch %d) ran out before it could be renewed", self.term.epoch)
                return
            sent = time.monotonic()
            try:
                renewed = await asyncio.to_thread(self._renew, self.term)
            except psycopg.Error as e:
                log.warning("renewing the broker lease failed: %s", str(e).strip().splitlines()[0])
                await asyncio.to_thread(self._disconnect)
                continue
            if not renewed:
                log.warning("broker lease (epoch %d) was taken over", self.term.epoch)
                return
            self._valid_until = sent + self.settings.ttl_s - self.settings.margin_s

    async def _step_down(self, on_deposed: Callable[[], Awaitable[None]], *, resign: bool) -> None:
        term, self.term, self._valid_until = self.term, None, 0.0
        try:
            await on_deposed()
        finally:
            if resign and term is not None:  # a clean stop hands over at once instead of after the ttl
                try:
                    await asyncio.to_thread(self._resign, term)
                except psycopg.Error:
                    pass

    # -- on a worker thread: one autocommit connection, with timeouts so a hung database cannot hang us --
    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            timeout_ms = int(self.settings.ttl_s * 1000 / 2)
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self.settings.ttl_s)),
                                         options=f"-c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms}")
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _try_acquire(self) -> tuple[int | None, str]:
        if not self._prepared:
            self._prepare()
            self._prepared = True
        conn = self._connection()
        row = conn.execute(_ACQUIRE, {"holder": self.holder, "url": self.url, "ttl": self.settings.ttl_s}).fetchone()
        if row is not None:
            return int(row[0]), self.url
        current = conn.execute(_CURRENT).fetchone()
        return None, current[0] if current else ""

    def _renew(self, term: LeaderTerm) -> bool:
        params = {"holder": term.holder, "epoch": term.epoch, "ttl": self.settings.ttl_s}
        return self._connection().execute(_RENEW, params).fetchone() is not None

    def _resign(self, term: LeaderTerm) -> None:
        self._connection().execute(_RESIGN, (term.holder, term.epoch))
