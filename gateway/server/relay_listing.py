"""What a relay learns of its upstreams: their heads, followed with a long poll of `GET /v1/heads`
(`follow_heads`, one loop per upstream, which tells the relay of every answer), and what an upstream
can serve of one model, its listing (`GET /v1/models/{m}/versions`: the versions it holds and those
it could fetch from its own upstreams, `reachable`), asked of the first upstream that answers. The
relay (gateway/server/relay.py) mirrors and plans from the last listing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.fetch.sources import Source, order_sources
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway_client import HEADS_PATH, PEER_HEADER, model_path
from deltamesh.http import HttpError, request_json

log = logging.getLogger(__name__)

FOLLOW_WAIT_S = 30.0


@dataclass(frozen=True)
class UpstreamListing:
    """What the upstream can serve of one model, from the last pass's listing."""

    held: tuple[PlanStep, ...]
    """What the upstream holds."""
    reachable: tuple[PlanStep, ...]
    """What it does not hold but can fetch from its own upstreams."""

    @property
    def all(self) -> tuple[PlanStep, ...]:
        return self.held + self.reachable


async def list_upstream(session: aiohttp.ClientSession, sources: list[Source], model: str, peer: str,
                        stall_timeout_s: float) -> UpstreamListing | None:
    """The first answering upstream's listing of `model`; None if none lists it."""
    # Penalised upstreams are asked too (last): one that served bad bytes of one version must not
    # keep this relay from learning of the next.
    for source in order_sources(sources):
        if source.delay_s:
            await asyncio.sleep(source.delay_s)
        try:
            answer = await request_json(session, "GET", f"{source.url}{model_path(model, 'versions')}",
                                        headers={PEER_HEADER: peer}, timeout_s=stall_timeout_s)
            # An upstream of an earlier release lists no `reachable`: it can serve what it holds.
            return UpstreamListing(tuple(PlanStep.from_json(v) for v in answer["versions"]),
                                   tuple(PlanStep.from_json(v) for v in answer.get("reachable", [])))
        except HttpError as e:
            if e.status == 404:
                continue
            source.bad_until = max(source.bad_until, time.monotonic() + min(stall_timeout_s, 5.0))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("relay: %s lists %s in a malformed answer: %s", source.url, model, e)
    return None


async def follow_heads(session: aiohttp.ClientSession, source: Source, peer: str, stall_timeout_s: float,
                       monitor: LinkMonitor, on_heads: Callable[[Source, bool, dict[str, int], object], None]) -> None:
    """Long-poll one upstream's heads for ever: `on_heads(source, changed, heads, inline manifests)`
    after every answer (`changed`: its epoch moved). An upstream that fails is asked last for a while
    and polled again after a growing backoff, then for its whole picture."""
    since, instance = -1, ""
    backoff = 0.2
    while True:
        params = {"since": since, "instance": instance, "wait": FOLLOW_WAIT_S, "manifests": 1}
        if source.delay_s:
            await asyncio.sleep(source.delay_s)
        try:
            answer = await request_json(session, "GET", f"{source.url}{HEADS_PATH}", params=params,
                                        headers={PEER_HEADER: peer}, timeout_s=FOLLOW_WAIT_S + stall_timeout_s)
            epoch, heads = int(answer["epoch"]), {str(m): int(v) for m, v in answer["heads"].items()}
        except (HttpError, KeyError, TypeError, ValueError, AttributeError) as e:
            if source.link is not None:
                monitor.record_error(source.link, f"follow: {e}")
            source.bad_until = max(source.bad_until, time.monotonic() + min(stall_timeout_s, 5.0))
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0)
            since = -1  # after an outage, take the whole picture again
            continue
        backoff = 0.2
        if source.strikes == 0:  # reachable again; a penalty for bad or slow data stays (scoring.py)
            source.bad_until = 0.0
        changed = epoch != since
        since, instance = epoch, str(answer.get("instance", ""))
        on_heads(source, changed, heads, answer.get("manifests"))
