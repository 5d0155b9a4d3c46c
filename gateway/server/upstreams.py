"""How a relay gateway speaks to its upstreams: one kind of session, and the announcements that name it there.

Every request a relay makes upstream (following heads, listing, fetching manifests and pieces,
announcing itself) goes over a session from `upstream_session`: https:// upstreams are verified
against `tls.ca` (or the system store) and shown the relay's certificate when they ask for one, and
the relay's `gateway` token, if it has one, rides on every request (the config refused it at load
time for plain http:// to a host that is not loopback, unless `tls.insecure`). `announce_forever`
tells each upstream that this gateway follows it, again before the upstream's announcement TTL
lapses.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import aiohttp

from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway_client import GATEWAYS_PATH
from deltamesh.http import HttpError, bearer, client_session, request_json

log = logging.getLogger(__name__)

FIRST_INTERVAL_S = 10.0
"""Re-announce period until an upstream has said how long it keeps an announcement."""
RETRY_S = 1.0
"""An upstream that was not reachable (still starting, restarting) is asked again this soon."""


def upstream_session(config: GatewayConfig, **kw) -> aiohttp.ClientSession:
    """A client session towards the upstreams: TLS as `config.tls` says, the relay's token on every call."""
    headers = bearer(config.upstream_token) if config.upstream_token else {}
    return client_session(tls=config.tls, headers=headers, **kw)


async def announce_forever(config: GatewayConfig) -> None:
    """Tell each upstream this gateway exists (for their link monitors), and keep telling it."""
    if not config.advertise:
        return
    body = {"region": config.region, "url": config.advertise, "instance": uuid.uuid4().hex}
    interval = {url: FIRST_INTERVAL_S for url in config.upstreams}
    refused: dict[str, str] = {}
    async with upstream_session(config, timeout_s=10.0) as session:
        while True:
            missed = False
            for url in config.upstreams:
                try:
                    answer = await request_json(session, "POST", f"{url}{GATEWAYS_PATH}", body=body)
                except HttpError as e:
                    missed = True
                    if e.status in (401, 403) and refused.get(url) != e.reason:
                        log.warning("upstream %s refuses this gateway's announcement: %s", url, e.reason)
                    refused[url] = e.reason
                    continue
                refused.pop(url, None)
                ttl = answer.get("ttl_s") if isinstance(answer, dict) else None
                if isinstance(ttl, (int, float)) and ttl > 0:
                    interval[url] = ttl / 3
            await asyncio.sleep(RETRY_S if missed else min(interval.values()))
