"""The relay: how a gateway with upstreams mirrors their versions, cut-through, and fetches what it is asked for.

Each upstream is followed with a long poll of `GET /v1/heads` (`relay_listing.follow_heads`), so a
new version upstream starts a sync pass at once; a new head delta whose signed manifest the answer carries inline is mirrored
from it at once. A pass lists what the upstream can serve (what it holds, and what it could fetch
from its own upstreams: `reachable`) and mirrors the kinds `deltamesh.gateway.server.relay_kinds` chooses:
the newest deltas, and a full snapshot only to keep an anchor for first pulls. Anything else this
gateway is asked for that its upstream can serve (a full a plan named, a manifest or piece a pool or
downstream gateway requests) is fetched on demand (`demand`) the same way. A fetch takes the signed
manifest (verified against the trusted keys, then stored, which announces the version to this
gateway's own pools and downstream gateways) and then the missing pieces with several parallel
connections. Every piece is verified before it is stored and served onwards from then on. Pieces
come from the first healthy upstream and continue from another (with the bytes already received)
when one dies or stalls; one found corrupted on disk is dropped by the store and fetched again.
Once a version is in, requests for the next wait upstream for it (`?wait=`) on the connections the
last one warmed, so it flows the moment it is announced. Every model is followed at once: the listings of a pass run
concurrently (`relay_parallel` at a time), each version is mirrored by a task of its own, and the
long polls wait on connections apart from the transfers'. A version whose mirror fails (no upstream
serves a piece intact, a full disk) is tried again after a backoff (`deltamesh.gateway.server.relay_retry`)
while the others go on. The bytes each upstream link carries are booked per version in
`deltamesh.gateway.server.traffic`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable

import aiohttp

from deltamesh.delta.errors import CorruptError
from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch.fetcher import Fetcher, FetchError, Inline, NotAnnounced
from deltamesh.gateway.fetch.judge import name
from deltamesh.gateway.fetch.links import LinkMonitor
from deltamesh.gateway.fetch.sources import RateLimiter, Source
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway.server.disk import DiskFullError
from deltamesh.gateway.server.ledger import ConflictError
from deltamesh.gateway.server.metrics import GatewayMetrics
from deltamesh.gateway.server.relay_kinds import anchor_to_fetch, deltas_to_follow
from deltamesh.gateway.server.relay_listing import UpstreamListing, follow_heads, list_upstream
from deltamesh.gateway.server.relay_retry import RetrySchedule
from deltamesh.gateway.server.store import VersionStore
from deltamesh.gateway.server.stored_version import StoredVersion
from deltamesh.gateway.server.traffic import Traffic
from deltamesh.gateway.server.upstreams import upstream_session
from deltamesh.signals import wait_event

log = logging.getLogger(__name__)

RESYNC_S = 10.0
"""A pass also runs this often without a trigger, to pick up anything a missed wake-up left behind."""
ANTICIPATE_WAIT_S = 30.0
"""How long one request for the next version waits upstream before it is asked again."""
ANTICIPATE_BUDGET = 64
"""Most requests kept waiting upstream for next versions, over all models: each model's manifest,
and as many of its first pieces (up to relay_connections) as the rest of the budget allows."""


Key = tuple[str, int, str]
"""(model, version, kind)"""


class Relay:
    def __init__(self, config: GatewayConfig, store: VersionStore, monitor: LinkMonitor, metrics: GatewayMetrics,
                 traffic: Traffic):
        self.config = config
        self.store = store
        self.monitor = monitor
        self.metrics = metrics
        self.traffic = traffic
        limiter_rate = config.bandwidth_cap_mbps * 1e6 / 8
        self.sources = [
            Source(url, monitor.link(url, "upstream", url), RateLimiter(limiter_rate) if limiter_rate else None,
                   delay_s=config.link_delay_ms / 1000)
            for url in config.upstreams
        ]
        self.peer = f"gateway/{config.region}"
        self._wake = asyncio.Event()
        self._known_models: set[str] = set()
        self._upstream: dict[str, UpstreamListing] = {}
        self._active: dict[Key, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._wait_session: aiohttp.ClientSession | None = None
        self._follow_session: aiohttp.ClientSession | None = None
        self._fetcher: Fetcher | None = None
        self._retry = RetrySchedule()
        """Versions whose mirror failed, and when each is tried again (see relay_retry)."""

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        connections = max(16, 4 * self.config.relay_connections)
        self._session = upstream_session(self.config, connections=connections + 8, timeout_s=None)
        # Long polls (heads, and each model's next version) wait on connections of their own: in one
        # pool they took every connection once a few models were followed, and a new version's pieces
        # then queued behind 30-second polls. That pool has no limit; ANTICIPATE_BUDGET bounds them.
        # Newest first: the next version's first pieces, asked for once this one is in (`_anticipate`),
        # ride the connection that just carried this one's, with the congestion window it grew. The
        # heads long polls have a session of their own, so that they never take that connection.
        self._wait_session = upstream_session(self.config, connections=0, timeout_s=None, newest_first=True)
        self._follow_session = upstream_session(self.config, connections=0, timeout_s=None)
        self._fetcher = Fetcher(
            self._session, self.sources, self.peer, self.monitor,
            stall_timeout_s=self.config.stall_timeout_s, give_up_s=max(60.0, 6 * self.config.stall_timeout_s),
            penalty_s=min(self.config.stall_timeout_s, 5.0), min_rate_bps=self.config.min_rate_kib_s * 1024,
            min_rate_fraction=self.config.min_rate_fraction, source_tries=self.config.source_tries,
            wait_session=self._wait_session, max_requests=connections, on_received=self._received,
        )
        self.store.on_piece_corrupt.append(self._on_corrupt)
        self._tasks = [asyncio.create_task(self._follow(s)) for s in self.sources]
        self._tasks.append(asyncio.create_task(self._sync_loop()))
        # Cold: the first version's parallel requests find their connections up (handshakes done
        # during the first listing's round trip), not opening them one round trip later.
        self._tasks.append(asyncio.create_task(self._fetcher.open_connections(self.config.relay_connections)))
        self.wake()

    async def stop(self) -> None:
        tasks = self._tasks + list(self._active.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session in (self._session, self._wait_session, self._follow_session):
            if session is not None:
                await session.close()

    def wake(self) -> None:
        self._wake.set()

    def _on_corrupt(self, entry: StoredVersion, index: int) -> None:
        self.wake()

    def _received(self, source: Source, key: Key, nbytes: int) -> None:
        self.traffic.received(source.url, *key, nbytes)

    # -- what the upstream can serve, and fetching it on demand ----------------------------------------
    def reachable(self, model: str) -> list[PlanStep]:
        """Versions this relay does not hold but can fetch from its upstream (as of the last pass)."""
        listing = self._upstream.get(model)
        if listing is None:
            return []
        seen = {(e.version, e.kind) for e in self.store.entries(model)}
        out = []
        for step in listing.all:
            if step.key not in seen:
                seen.add(step.key)
                out.append(step)
        return sorted(out, key=lambda s: s.key)

    def can_fetch(self, model: str, version: int, kind: str) -> bool:
        listing = self._upstream.get(model)
        return listing is not None and any(s.key == (version, kind) for s in listing.all)

    def fetch_soon(self, model: str, version: int, kind: str) -> None:
        """Start fetching a version a downstream is about to ask for (a plan named it), unless it is
        here or on its way. What arrives is leased, so it stays until that downstream has read it."""
        if self.store.get(model, version, kind) is None:
            self._start((model, version, kind), "demand", lease=True)

    async def demand(self, model: str, version: int, kind: str, timeout: float) -> StoredVersion | None:
        """A version a downstream asks for that is not here: fetch it from upstream (cut-through: its
        pieces are served as they arrive) and return it once its manifest is in, or None when that
        took longer than `timeout` (it keeps coming)."""
        self.fetch_soon(model, version, kind)
        return await self.store.wait_entry(model, version, kind, timeout)

    # -- following upstreams -------------------------------------------------------------------------
    async def _follow(self, source: Source) -> None:
        await follow_heads(self._follow_session, source, self.peer, self.config.stall_timeout_s, self.monitor,
                           self._heads_changed)

    def _heads_changed(self, source: Source, changed: bool, heads: dict[str, int], carried: object) -> None:
        # Any change upstream (a new version, a new kind of one, or what it can fetch) is listed
        # again: the listing is what this relay's plans and anchor choice work from.
        new_models = set(heads) - self._known_models
        self._known_models |= new_models
        self._inline(source, heads, carried)
        if changed or new_models or any(self._behind(m, v) for m, v in heads.items()):
            self.wake()

    def _inline(self, source: Source, heads: dict[str, int], carried: object) -> None:
        """Start mirroring each new head delta whose signed manifest the heads answer carried (an
        upstream of an earlier release carries none): its pieces are asked for at once, without the
        listing and manifest round trips. A version already on its way (asked for ahead) is left be."""
        if not isinstance(carried, dict):
            return
        for model, kinds in carried.items():
            raw = kinds.get("delta") if isinstance(kinds, dict) and model in heads else None
            key = (model, heads.get(model), "delta")
            if isinstance(raw, str) and self.store.get(*key) is None:
                self._start(key, "follow", inline=(source, raw.encode()))

    def _behind(self, model: str, head: int) -> bool:
        mine = self.store.head(model)
        return mine is None or mine < head or any(not e.complete for e in self.store.entries(model))

    # -- syncing ---------------------------------------------------------------------------------------
    async def _sync_loop(self) -> None:
        while True:
            due = self._retry.next_due()  # a failed version's next try also starts a pass
            await wait_event(self._wake, RESYNC_S if due is None else min(RESYNC_S, due + 0.01))
            self._wake.clear()
            try:
                await self._sync_pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # a pass that fails is retried by the next one; never stop relaying
                log.exception("relay: sync pass failed")
                await asyncio.sleep(0.5)

    async def _sync_pass(self) -> None:
        wanted: list[tuple[Key, str]] = []
        models = sorted(self._known_models | set(self.store.models()))
        parallel = asyncio.Semaphore(self.config.relay_parallel)

        async def listed(model: str) -> UpstreamListing | None:
            async with parallel:  # every model at once (a slow answer for one delays no other), bounded
                return await self._upstream_versions(model)

        for model, listing in zip(models, await asyncio.gather(*(listed(m) for m in models))):
            if listing is None:
                continue
            before = self._upstream.get(model)
            self._upstream[model] = listing
            if before is None or {x.key for x in before.all} != {x.key for x in listing.all}:
                self.store.touch()  # downstream relays list this gateway's `reachable` again
            local = [PlanStep.of(e.manifest) for e in self.store.entries(model)]
            following = deltas_to_follow(listing.held, self.config.keep_deltas)
            wanted += [((model, s.version, s.kind), "follow") for s in following]
            anchor = anchor_to_fetch(model, local, following, listing.all, self.config.keep_deltas)
            if anchor is not None:
                wanted.append(((model, anchor.version, anchor.kind), "anchor"))
            if listing.held:
                self._anticipate(model, max(s.version for s in listing.held) + 1, "delta" if following else "full")
        for model in self.store.models():  # local leftovers: after a restart, a dropped corrupt piece, a demand
            for e in self.store.entries(model):
                if not e.complete:
                    wanted.append(((model, e.version, e.kind), "resume"))
        for key, why in wanted:
            entry = self.store.get(*key)
            if entry is None or not entry.complete:
                self._start(key, why if entry is None else "resume")
        keys = {key for key, _ in wanted}
        self._retry.forget_unless(lambda k: k in keys or k in self._active)
        self.metrics.relay_retrying.set(len(self._retry))

    def _start(self, key: Key, why: str, lease: bool = False, inline: Inline | None = None) -> None:
        if key in self._active or not self._retry.ready(key):
            return  # on its way, or failed a moment ago: its retry comes after a backoff
        if why != "resume":
            self.metrics.relay_fetches.labels(key[2], why).inc()
        self._retry.started(key)
        task = asyncio.create_task(self._mirror(*key, lease=lease, inline=inline))
        self._active[key] = task
        task.add_done_callback(lambda t: self._finished(key, t))

    def _finished(self, key: Key, task: asyncio.Task) -> None:
        """A mirror (or a wait for the next version) ended: forget it, and leave no exception unretrieved:
        `_mirror` handles the expected ones, anything else is logged and the version tried again later."""
        if self._active.get(key) is task:
            del self._active[key]
        if task.cancelled():
            return
        if task.exception() is None:
            if task.result() is True:
                self.wake()  # a version is in: ask for the next one ahead (`_anticipate`)
            return
        e = task.exception()
        log.error("relay: %s v%d %s failed unexpectedly", *key, exc_info=e)
        self._mirror_failed(key, f"{type(e).__name__}: {e}")

    def _mirror_failed(self, key: Key, reason: str) -> bool:
        delay = self._retry.failed(key, reason)
        log.warning("relay: %s v%d %s: %s; trying again in %.1fs", *key, reason, delay)
        self.metrics.relay_retrying.set(len(self._retry))
        self.wake()  # the sync loop then sleeps until this retry is due
        return False

    def status(self) -> dict:
        """What the relay is doing, for the health answer: versions on their way, and failed ones waiting
        for their next try (with why they failed)."""
        return {"active": len(self._active), "retrying": self._retry.describe()}

    def _anticipate(self, model: str, version: int, kind: str) -> None:
        """Keep requests for the version after the upstream's head waiting there, so that it starts
        flowing here the moment it is announced upstream: half a round trip after, instead of the
        two and a half that hearing of it, listing and asking for its manifest would take. Only the
        kind the model's versions mostly come in is waited for (deltas, once there are any); any
        other kind is mirrored the usual way."""
        key = (model, version, kind)
        if key in self._active or self.store.get(*key) is not None or not self._retry.ready(key):
            return
        if (model, version - 1, kind) in self._active:
            return  # asked for once the version before is in, on the connections it warmed (`_finished`)
        models = len(self._known_models | set(self.store.models()))
        prefetch = max(0, min(self.config.relay_connections, ANTICIPATE_BUDGET // max(1, models) - 1))

        async def wait_for_it() -> bool | None:
            while True:
                asked = time.monotonic()
                try:
                    # A wait of its own length each time: one ending as the version lands upstream
                    # re-asks a round trip late, and a fixed length would do so version after version
                    # for a trainer whose step takes about as long.
                    wait_s = ANTICIPATE_WAIT_S * random.uniform(0.75, 1.25)
                    done = await self._mirror(model, version, kind, wait_s=wait_s, prefetch=prefetch)
                    self.metrics.relay_fetches.labels(kind, "follow").inc()
                    return done
                except NotAnnounced:
                    if time.monotonic() - asked < ANTICIPATE_WAIT_S / 2:
                        return None  # answered at once: a newer version came first, this one is not coming

        self._retry.started(key)
        task = asyncio.create_task(wait_for_it())
        self._active[key] = task
        task.add_done_callback(lambda t: self._finished(key, t))

    async def _upstream_versions(self, model: str) -> UpstreamListing | None:
        return await list_upstream(self._session, self.sources, model, self.peer, self.config.stall_timeout_s)

    async def _mirror(self, model: str, version: int, kind: str, wait_s: float = 0.0, lease: bool = False,
                      prefetch: int | None = None, inline: Inline | None = None) -> bool:
        """Bring one version here: manifest first (which announces it), then the missing pieces; True
        once it is complete, False when it failed (it is tried again after a backoff: relay_retry).
        With `wait_s` the version may not be announced upstream yet (NotAnnounced if it was not)."""
        key = (model, version, kind)
        fetcher = self._fetcher
        t0 = time.monotonic()
        try:
            entry = self.store.get(model, version, kind)
            if entry is None:
                accept = self._accept_manifest if inline is None else self._accepting(key)
                entry = await fetcher.manifest_bytes(
                    model, version, kind, accept, wait_s=wait_s, inline=inline,
                    prefetch=self.config.relay_connections if prefetch is None else prefetch)
                t0 = time.monotonic()
            if lease:
                self.store.lease([entry], self.config.lease_s)
            with self.store.using(entry):
                missing = entry.missing
                if not missing:
                    self._retry.succeeded(key)
                    return True

                async def store_piece(index: int, data: bytes) -> None:
                    await self.store.put_piece(entry, index, data, verified=True)  # the fetcher checked it
                    self.metrics.bytes_in.labels(kind, "relay").inc(len(data))

                await fetcher.pieces(entry.manifest, missing, self.config.relay_connections, store_piece)
                log.info("relay: %s v%d %s complete (%d pieces in %.2fs)",
                         model, version, kind, len(missing), time.monotonic() - t0)
            self._retry.succeeded(key)
            return True
        except NotAnnounced:
            raise
        except (FetchError, ConflictError) as e:
            return self._mirror_failed(key, str(e))
        except DiskFullError as e:  # nothing of it was kept: tried again once there may be room
            return self._mirror_failed(key, f"disk full: {e}")
        except OSError as e:
            return self._mirror_failed(key, f"{type(e).__name__}: {e}")

    def _accepting(self, key: Key) -> Callable[[bytes], Awaitable[StoredVersion]]:
        """`_accept_manifest`, for an envelope that must be of `key` (one a heads answer carried)."""
        async def accept(raw: bytes) -> StoredVersion:
            m = load_manifest(raw, self.store.trusted_keys)
            if (m.model_id, m.version, m.kind) != key:
                raise CorruptError(f"an inline manifest of {m.model_id} v{m.version} {m.kind} for {name(key)}")
            return await self._accept_manifest(raw)
        return accept

    async def _accept_manifest(self, raw: bytes) -> StoredVersion:
        entry, _ = await self.store.put_manifest(raw)
        self.traffic.version(entry.model, entry.version)  # listed even if its pieces carry no byte
        return entry

