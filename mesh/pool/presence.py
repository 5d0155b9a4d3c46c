"""A pool's entry in a gateway's pool registry: register, heartbeat, and leave on a clean stop.

The pool registers at the first of its gateways that takes it and heartbeats there (its version,
state and transfer; the answer carries that gateway's head); a failed beat registers it again next
time, there or at an alternate. On a clean stop it deregisters (`DELETE /v1/pools/{name}`), briefly
and on a best-effort basis, so operators see it gone instead of down. Every call goes through
`GatewayClient` over the weight sync's session, which carries the pool's token; 401/403 from every
gateway is a CredentialsError.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import aiohttp

from deltamesh.gateway.fetch.errors import SyncError, credentials_refused, unreachable
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError
from deltamesh.mesh.pool.sync_config import PoolSyncConfig

log = logging.getLogger(__name__)

DEREGISTER_S = 3.0
"""How long a stopping pool waits for the gateway to take its deregistration."""


class Presence:
    def __init__(self, config: PoolSyncConfig, sources: Sequence[Source]) -> None:
        self.config = config
        self.sources = sources
        self.at: str | None = None
        """The gateway the pool is registered at (None: not registered anywhere now)."""

    def _client(self, session: aiohttp.ClientSession, url: str, timeout_s: float | None = None) -> GatewayClient:
        # The session carries the token already; the client adds the peer header.
        return GatewayClient(url, session, peer=f"pool/{self.config.name}",
                             timeout_s=self.config.stall_timeout_s if timeout_s is None else timeout_s)

    async def register(self, session: aiohttp.ClientSession, model: str, version: int | None) -> None:
        c = self.config
        body = {"name": c.name, "model": model, "gpus": c.gpus, "engine": c.engine, "tier": c.tier,
                "endpoint": c.endpoint, "version": version}
        errors: list[HttpError] = []
        for source in self.sources:
            try:
                await self._client(session, source.url).register_pool(body)
                self.at = source.url
                return
            except HttpError as e:
                errors.append(e)
        if errors and all(e.status in (401, 403) for e in errors):
            raise credentials_refused(c.name, [str(e) for e in errors])
        raise SyncError(f"pool {c.name} could not register: {errors[-1] if errors else 'no gateway'}") from unreachable(
            errors)

    async def beat(self, session: aiohttp.ClientSession, model: str, state: Mapping[str, Any]) -> object:
        """One heartbeat (registering first if needed); the head the gateway answered with (unchecked)."""
        if self.at is None:
            await self.register(session, model, state.get("version"))
        try:
            answer = await self._client(session, self.at).heartbeat(self.config.name, dict(state))
        except HttpError as e:
            self.at = None  # register again next time, there or at an alternate
            if e.status in (401, 403):
                raise credentials_refused(self.config.name, [str(e)]) from None
            return None  # the next beat registers again
        return answer.get("head") if isinstance(answer, dict) else None

    async def leave(self, session: aiohttp.ClientSession | None) -> None:
        """Deregister from the gateway the pool is registered at (best effort, briefly)."""
        url, self.at = self.at, None
        if url is None or session is None or session.closed:
            return
        try:
            await self._client(session, url, timeout_s=DEREGISTER_S).deregister_pool(self.config.name)
            log.info("pool %s: deregistered from %s", self.config.name, url)
        except HttpError as e:
            log.info("pool %s: could not deregister from %s: %s", self.config.name, url, e)
