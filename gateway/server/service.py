"""The state and background work of one running gateway: store, pool registry, links, metrics, relay.

`Gateway` owns everything the HTTP routes share (store, head statements, pools, links, metrics, the
per-version byte counts of each link) and the tasks that run beside them: the relay and the mirror of
the upstreams' head statements (when there are upstreams),
garbage collection after each completed version (and, at most every `GC_INTERVAL_S`, freed heap
memory handed back to the OS: `deltamesh.heap`), link probes (of upstreams, and of the downstream
gateways and pools that authenticated themselves), and the announcement of this gateway to its
upstreams. Every session it opens speaks TLS as `config.tls` says. `start()` and `stop()` are hooked to the aiohttp application's start-up and
clean-up by `deltamesh.gateway.server.app`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Awaitable, Callable, Iterable

import aiohttp

from deltamesh.delta.keys import load_public_key
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch.links import Link, LinkMonitor, probe_forever, tcp_rtt
from deltamesh.gateway.server.downstreams import Downstream, Downstreams
from deltamesh.gateway.server.metrics import GatewayMetrics
from deltamesh.gateway.server.registry import PoolRegistry
from deltamesh.gateway.server.relay import Relay
from deltamesh.gateway.server.statement_mirror import mirror_statements
from deltamesh.gateway.server.statements import StatementStore
from deltamesh.gateway.server.store import VersionStore
from deltamesh.gateway.server.stored_version import StoredVersion
from deltamesh.gateway.server.traffic import Traffic
from deltamesh.gateway.server.upstreams import announce_forever
from deltamesh.heap import HeapTrimmer
from deltamesh.http import SMALL_LIMIT, client_session, read_limited
from deltamesh.signals import wait_event

log = logging.getLogger(__name__)

GC_INTERVAL_S = 5.0


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.instance = uuid.uuid4().hex
        self.trusted_keys = [load_public_key(p) for p in config.trusted_keys]
        self.store = VersionStore(config.store, self.trusted_keys,
                                  disk_margin_bytes=int(config.disk_margin_mib * 2**20),
                                  staging_max_bytes=int(config.staging_max_gib * 2**30),
                                  staging_ttl_s=config.staging_ttl_s)
        # A new statement moves the store's epoch: followers long-polling the heads pick it up at once.
        self.statements = StatementStore(config.store, self.trusted_keys, self.store.ledger, on_change=self.store.touch)
        self.pools = PoolRegistry(config.heartbeat_timeout_s, expire_s=config.pool_expire_s)
        self.links = LinkMonitor()
        self.metrics = GatewayMetrics()
        self.traffic = Traffic(self.metrics)
        self.relay = Relay(config, self.store, self.links, self.metrics, self.traffic) if config.upstreams else None
        self.downstreams = Downstreams(config.max_downstreams, config.downstream_ttl_s)
        self._tasks: list[asyncio.Task] = []
        self._gc_wake = asyncio.Event()
        self._heap = HeapTrimmer(GC_INTERVAL_S)
        self._probe_session: aiohttp.ClientSession | None = None
        self._probed: set[str] = set()  # URLs whose probe connection is open (see _http_probe)

    async def start(self) -> None:
        await asyncio.to_thread(self.store.load)
        await asyncio.to_thread(self.statements.load)
        self.store.on_version_complete.append(self._on_complete)
        self.store.on_piece_corrupt.append(lambda entry, index: self.metrics.corrupt_pieces.labels("disk").inc())
        self._probe_session = client_session(timeout_s=max(2.0, self.config.probe_interval_s), tls=self.config.tls)
        self._tasks = [
            asyncio.create_task(self._gc_loop()),
            asyncio.create_task(probe_forever(self.links, self._probe_targets, self.config.probe_interval_s)),
        ]
        if self.relay is not None:
            await self.relay.start()
            self._tasks.append(asyncio.create_task(announce_forever(self.config)))
            self._tasks.append(asyncio.create_task(mirror_statements(self.config, self.statements)))
        log.info("gateway %s up: %s, store %s", self.config.region,
                 "origin" if self.config.is_origin else f"relaying from {', '.join(self.config.upstreams)}",
                 self.config.store)

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._probe_session is not None:
            await self._probe_session.close()

    # -- garbage collection ------------------------------------------------------------------------
    def _on_complete(self, entry: StoredVersion) -> None:
        source = "publish" if self.config.is_origin else "relay"
        self.metrics.transfer_seconds.labels(entry.kind, source).observe(time.monotonic() - entry.created)
        self.metrics.version_complete(entry, time.time())
        self._gc_wake.set()

    async def _gc_loop(self) -> None:
        while True:
            await wait_event(self._gc_wake, GC_INTERVAL_S)
            self._gc_wake.clear()
            self.store.collect(self.config.keep_deltas, self.config.keep_fulls)
            # Freed memory (that of closed connections above all: TLS ones cost hundreds of KB each)
            # goes back to the OS, so the resident size follows what is live, not its high water.
            await asyncio.to_thread(self._heap.maybe_trim)  # tens of ms after a big burst: not on the loop

    # -- link probes -------------------------------------------------------------------------------
    def announce_downstream(self, region: str, url: str, *, probe: bool) -> Downstream:
        """Record a downstream's announcement (TooManyDownstreams when the table is full); its link is
        named, and its URL probed only when `probe` (an authenticated announcement)."""
        entry, lapsed = self.downstreams.announce(region, url, probe=probe)
        self._forget_downstreams(lapsed)
        self.links.link(region, "downstream", url if probe else "")
        return entry

    def _forget_downstreams(self, regions: list[str]) -> None:
        for region in regions:
            self.links.forget(region, "downstream")

    def _probe_targets(self) -> Iterable[tuple[Link, Callable[[], Awaitable[float]]]]:
        timeout = max(2.0, self.config.probe_interval_s)
        for url in self.config.upstreams:
            yield self.links.link(url, "upstream", url), self._http_probe(url, self.config.link_delay_ms / 1000)
        self._forget_downstreams(self.downstreams.expire())
        for d in self.downstreams:
            if d.probe:
                yield self.links.link(d.region, "downstream", d.url), self._http_probe(d.url)
        for pool in self.pools.pools():
            if pool.endpoint and pool.probe and self.pools.is_up(pool):
                yield self.links.link(pool.name, "pool", pool.endpoint), lambda e=pool.endpoint: tcp_rtt(e, timeout)

    def _http_probe(self, url: str, delay_s: float = 0.0) -> Callable[[], Awaitable[float]]:
        async def get() -> None:
            async with self._probe_session.get(f"{url}/healthz") as resp:
                await read_limited(resp, SMALL_LIMIT)  # a probe's answer is unwanted: it costs no memory
                resp.raise_for_status()

        async def probe() -> float:
            if url not in self._probed:
                # The first request opens the kept-alive connection: TCP's and TLS's handshakes are
                # round trips of their own, not the link's RTT, so it is not a sample.
                await get()
                self._probed.add(url)
            t0 = time.perf_counter()
            if delay_s:  # an emulated distant upstream: its probes see the added latency too
                await asyncio.sleep(delay_s)
            await get()
            return time.perf_counter() - t0

        return probe
