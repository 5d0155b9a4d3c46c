"""A trainer's link to the origin gateway: one kept HTTP session, the gateway's head, head statements.

Uploads ride one client session kept open across versions (warm connections, no new TLS handshakes),
opened on first use, dropped after a connection failure (the next use opens a fresh one), closed by
`aclose` or when the event loop that opened it ends. Every request carries the trainer's `token`
(role trainer) and goes over TLS as `tls` says (its certificate, common name trainer/NAME, serves as
the credential on an mTLS gateway). A signed head statement (`deltamesh.delta.statement`) names the
newest version and when the trainer said so; its failure is logged, never fatal. Both the publisher
of whole weights (publisher.py) and each rank's publisher of a version built in parts
(shard_publisher.py) speak to the origin through one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp

from deltamesh.delta import sign_statement
from deltamesh.delta.keys import Ed25519PrivateKey
from deltamesh.gateway_client import GatewayClient, statement_url
from deltamesh.http import HttpError, bearer, client_session, request_bytes
from deltamesh.tls import TlsSettings, check_token_transport

log = logging.getLogger(__name__)


@dataclass(eq=False)
class OriginLink:
    gateway: str
    model_id: str
    token: str | None = None
    tls: TlsSettings | None = None
    connections: int = 4
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)
    _holder: asyncio.Task | None = field(default=None, init=False, repr=False)
    """The task that closes `_session` when cancelled (by `aclose`, or by the end of its event loop)."""

    def __post_init__(self) -> None:
        self.gateway = self.gateway.rstrip("/")
        if self.token:
            check_token_transport(self.gateway, self.tls.insecure if self.tls is not None else False)
        self.token = self.token or None

    def session(self, **kw) -> aiohttp.ClientSession:
        """A new session to the gateway: TLS as configured, the trainer's token on every request."""
        return client_session(tls=self.tls, headers=bearer(self.token) if self.token else None, **kw)

    async def connection(self) -> aiohttp.ClientSession:
        """The session kept open to the origin, opened on first use (again after `aclose`, a connection
        failure, or in another event loop than the one that opened it)."""
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed and self._holder is not None \
                and not self._holder.done() and self._holder.get_loop() is loop:
            return self._session
        await self.aclose()
        self._session = self.session(connections=max(4, self.connections), timeout_s=None)
        self._holder = loop.create_task(_hold(self._session), name=f"publisher-{self.model_id}-session")
        return self._session

    async def aclose(self) -> None:
        """Close the kept session (the next use opens a fresh one)."""
        holder, self._holder, self._session = self._holder, None, None
        if holder is None or holder.done():
            return
        if holder.get_loop() is not asyncio.get_running_loop():
            return  # its loop ended (and closed it) or is not ours to run it on
        holder.cancel()
        await asyncio.wait([holder])

    async def dropped(self, error: HttpError) -> None:
        """After a failed request: a dropped connection makes the next use connect afresh."""
        if error.status == 0:
            await self.aclose()

    async def head(self) -> int | None:
        async with self.session(timeout_s=30.0) as s:
            return await GatewayClient(self.gateway, s, peer=f"trainer/{self.model_id}").head(self.model_id)

    async def put_statement(self, key: Ed25519PrivateKey, version: int, weights_hash: str) -> bool:
        """Sign and upload a head statement naming `version`; True once the origin has it."""
        body = sign_statement(key, self.model_id, version, weights_hash)
        try:
            await request_bytes(await self.connection(), "PUT", statement_url(self.gateway, self.model_id), data=body,
                                headers={"Content-Type": "application/json"}, timeout_s=30.0)
        except HttpError as e:
            # The version is published whatever happens here; pools that require statements will report
            # the gateway stale until one gets through.
            log.warning("head statement of %s v%d not accepted by %s: %s", self.model_id, version, self.gateway, e)
            await self.dropped(e)
            return False
        return True


async def _hold(session: aiohttp.ClientSession) -> None:
    """Keep `session` until cancelled, then close it. asyncio.run cancels the tasks left when its main
    coroutine ends, so a one-shot caller that never calls `aclose` still has the session closed."""
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
