"""Leaving a plan step that no gateway can serve for a newer head's plan that does without it.

A version can be announced and never completed: its trainer was killed while uploading it, restarted
from its last checkpoint and published the next version as a delta on an older one, so nothing will
ever bring the pieces of the announced one. A pool that planned its way through that version while it
was the head would wait for its pieces until the fetch gives up (`give_up_s`, minutes), behind every
newer version. `fetch_superseding` runs a plan's fetch and watches it: once the fetch has made no
progress for two stall timeouts, it asks for a plan from the same base to the gateway's head and, if
that head is newer and its plan does not need the stuck step, fetches that plan instead; a plan that
still needs the step, or a request that fails, changes nothing and the fetch goes on. Only a fetch
that makes no progress is ever left, so a slow version that is still arriving is waited for as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

from deltamesh.gateway.fetch.errors import SyncError
from deltamesh.gateway.plan import Plan
from deltamesh.http import HttpError

log = logging.getLogger(__name__)

T = TypeVar("T")
Step = tuple[int, str]
"""(version, kind) of a plan step."""


async def fetch_superseding(plan: Plan, fetch: Callable[[Plan], Awaitable[T]], *, stall_s: float, who: str,
                            progress: Callable[[], int], stuck_step: Callable[[], Step | None],
                            replan: Callable[[Plan], Awaitable[Plan]]) -> T:
    """`fetch(plan)`, or `fetch` of a newer plan (`replan(plan)`: from its base to the gateway's head) that
    leaves out the step the fetch is stuck on (`stuck_step()`: the step being fetched; `progress()`: bytes
    received so far)."""
    while True:
        fetching = asyncio.ensure_future(fetch(plan))
        try:
            newer = await _superseding_plan(plan, fetching, stall_s, progress, stuck_step, replan)
        finally:
            if not fetching.done():
                fetching.cancel()
                await asyncio.gather(fetching, return_exceptions=True)
        if newer is None:
            return fetching.result()
        version, kind = stuck_step() or ("?", "")
        log.warning("%s: v%s %s never arrived at any gateway, and the newer head v%d does without it: "
                    "fetching that plan instead", who, version, kind, newer.to_version)
        plan = newer


async def _superseding_plan(plan: Plan, fetching: asyncio.Future, stall_s: float, progress: Callable[[], int],
                            stuck_step: Callable[[], Step | None],
                            replan: Callable[[Plan], Awaitable[Plan]]) -> Plan | None:
    """A newer plan without the step `fetching` is stuck on, or None once the fetch is done."""
    seen, idle = progress(), 0
    while not fetching.done():
        done, _ = await asyncio.wait({fetching}, timeout=stall_s)
        if done:
            return None
        now = progress()
        idle, seen = (idle + 1 if now == seen else 0), now
        step = stuck_step()
        if idle < 2 or step is None:
            continue
        try:
            newer = await replan(plan)
        except (SyncError, HttpError) as e:
            log.info("a plan beside the stuck v%d %s: %s", step[0], step[1], e)
            continue
        if newer.to_version > plan.to_version and step not in {(s.version, s.kind) for s in newer.steps}:
            return newer
        idle = 0  # no newer head, or it needs the step too: keep waiting for it
    return None
