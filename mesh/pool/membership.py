"""A weight sync's membership in its gateways' pool registry, as `WeightSync` methods: register,
heartbeat (a loop, and at once after a new version), deregister on a clean stop.

Kept apart from the sync rounds (mesh/pool/weight_sync.py), whose state it reads: the model, the version
the directory holds, the state and transfer to report. The requests themselves are `Presence`'s
(mesh/pool/presence.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from deltamesh.gateway.fetch.errors import CredentialsError, SyncError
from deltamesh.http import HttpError
from deltamesh.signals import wait_event

if TYPE_CHECKING:
    import aiohttp

    from deltamesh.mesh.pool.presence import Presence
    from deltamesh.mesh.pool.retry_log import Outage
    from deltamesh.mesh.pool.sync_config import PoolSyncConfig

log = logging.getLogger("deltamesh.mesh.pool.weight_sync")  # the sync's own log: operators grep one name


class Membership:
    """The registry half of `WeightSync` (a base class: the attributes below are the sync's)."""

    config: PoolSyncConfig
    model: str
    version: int | None
    state: str
    transfer: dict
    presence: Presence
    _session: aiohttp.ClientSession | None
    _beat_now: asyncio.Event
    _beats: Outage

    # -- the pool's registration (`deltamesh.mesh.pool.presence`) ------------------------------------
    async def register(self) -> None:
        await self.presence.register(self._session, self.model, self.version)

    async def register_once(self) -> None:
        """Register (and beat) before the loops start: refused credentials end a pool there, with one
        error; any other failure is left to the heartbeat loop, which keeps trying."""
        try:
            await self.heartbeat()
        except CredentialsError:
            raise
        except (SyncError, HttpError) as e:
            log.warning("pool %s: registration: %s", self.config.name, e)

    async def deregister(self) -> None:
        """Leave the gateway the pool registered with (best effort, briefly): part of a clean stop."""
        await self.presence.leave(self._session)

    async def heartbeat(self) -> None:
        state = {"version": self.version, "state": self.state, "transfer": self.transfer}
        # The answer's head is left aside: `head` is what the gateways' head answers say (`book`), the
        # ones whose freshness the pool checks, so what it reports agrees with each gateway's standing.
        await self.presence.beat(self._session, self.model, state)

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        """Heartbeat until `stop`: every `heartbeat_s`, and at once after a new version is persisted."""
        while not stop.is_set():
            self._beat_now.clear()
            try:
                await self.heartbeat()
                self._beats.succeeded()
            except (HttpError, SyncError) as e:
                self._beats.failed(str(e))  # logged once per outage; the beats keep their period
            # The next beat comes after the period, or at once when a new version has been applied.
            await wait_event(self._beat_now, self.config.heartbeat_s)
