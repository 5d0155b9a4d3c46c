"""A relay's copy of its upstreams' head statements, taken along with every change of their heads.

Pools judge a gateway's freshness by the trainer's signed head statement it serves
(`deltamesh.delta.statement`), so a relay must pass the newest one on as soon as its upstream has it.
`mirror_statements` long-polls each upstream's `GET /v1/heads` (which moves on a new version and on a
new statement alike: the upstream's statement store moves its epoch) and, on every change, asks for
the statement of each model listed, with the entity tag of the one it holds (a 304 costs nothing). What
comes is verified and kept by `StatementStore.put` as a relay's (newest only; the weights hash checked
against versions it knows), which moves this relay's own epoch, so its downstreams follow in turn. An
older statement from a lagging upstream is not an error: the newer one stays.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import aiohttp

from deltamesh.delta.errors import CodecError
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.statements import NotNewer, StatementConflict, StatementStore
from deltamesh.gateway.server.upstreams import upstream_session
from deltamesh.gateway_client import HEADS_PATH, PEER_HEADER, statement_url
from deltamesh.http import HttpError, request_bytes, request_json

log = logging.getLogger(__name__)

FOLLOW_WAIT_S = 30.0
"""How long one long poll of an upstream's heads waits for a change."""
RESYNC_S = 60.0
"""Statements are asked for this often even without a change (a missed wake-up costs at most this)."""


async def mirror_statements(config: GatewayConfig, statements: StatementStore) -> None:
    """Follow every upstream until cancelled."""
    async with upstream_session(config, connections=2 * len(config.upstreams) + 2, timeout_s=None) as session:
        await asyncio.gather(*(_follow(config, statements, session, url) for url in config.upstreams))


async def _follow(config: GatewayConfig, statements: StatementStore, session: aiohttp.ClientSession,
                  upstream: str) -> None:
    headers = {PEER_HEADER: f"gateway/{config.region}"}
    since, instance, backoff, asked_at = -1, "", 0.2, 0.0
    while True:
        try:
            answer = await request_json(session, "GET", f"{upstream}{HEADS_PATH}",
                                        params={"since": since, "instance": instance, "wait": FOLLOW_WAIT_S},
                                        headers=headers, timeout_s=FOLLOW_WAIT_S + config.stall_timeout_s)
            epoch, models = int(answer["epoch"]), [str(m) for m in answer["heads"]]
        except (HttpError, KeyError, TypeError, ValueError, AttributeError) as e:
            log.debug("statements: following %s: %s", upstream, e)
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0)
            since = -1
            continue
        backoff = 0.2
        if epoch != since or time.monotonic() - asked_at > RESYNC_S:
            for model in models:
                await _fetch(config, statements, session, upstream, model, headers)
            asked_at = time.monotonic()
        since, instance = epoch, str(answer.get("instance", ""))


async def _fetch(config: GatewayConfig, statements: StatementStore, session: aiohttp.ClientSession,
                 upstream: str, model: str, headers: dict[str, str]) -> None:
    kept = statements.get(model)
    asked = {**headers, "If-None-Match": kept.etag} if kept is not None else headers
    try:
        raw = await request_bytes(session, "GET", statement_url(upstream, model), headers=asked,
                                  timeout_s=config.stall_timeout_s)
    except HttpError as e:
        if e.status not in (304, 404):  # 304: the one kept; 404: the upstream has none (yet)
            log.debug("statements: %s of %s: %s", upstream, model, e)
        return
    try:
        if await statements.put(raw, published=False, model=model):
            log.info("statements: %s v%d from %s", model, statements.get(model).statement.version, upstream)
    except NotNewer as e:  # an upstream behind another one
        log.debug("statements: kept ours over %s's: %s", upstream, e)
    except StatementConflict as e:
        log.warning("statements: %s served a statement of %s that contradicts this gateway's ledger: %s",
                    upstream, model, e)
    except CodecError as e:
        log.warning("statements: %s served a statement of %s that does not verify: %s", upstream, model, e)
