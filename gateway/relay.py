"""The relay: how a gateway with upstreams mirrors their versions, cut-through.

Each upstream is followed with a long poll of `GET /v1/heads`, so a new version upstream starts a
sync pass at once. A pass lists the newest upstream versions that this gateway's retention would
keep and, for each one missing or incomplete here, fetches the signed manifest (verified against the
trusted keys, then stored, which announces the version to this gateway's own pools and downstream
gateways) and then the missing pieces with several parallel connections. Every piece is verified
before it is stored, and is served onwards from the moment it is stored, while the rest is still
arriving. Pieces are fetched from the first healthy upstream and continue from another (with the
bytes already received) when one dies or stalls. A piece found corrupted on this gateway's disk is
dropped by the store and fetched again by the next pass. Requests for the version after the
upstream's head wait there for it (`?wait=`), so a new version flows the moment it is announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import aiohttp

from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch import Fetcher, FetchError, NotAnnounced
from deltamesh.gateway.sources import RateLimiter, Source
from deltamesh.http import HttpError, client_session, request_json
from deltamesh.gateway.links import PEER_HEADER, LinkMonitor
from deltamesh.gateway.metrics import GatewayMetrics
from deltamesh.gateway.store import ConflictError, StoredVersion, VersionStore

log = logging.getLogger(__name__)

RESYNC_S = 10.0
"""A pass also runs this often without a trigger, to pick up anything a missed wake-up left behind."""
FOLLOW_WAIT_S = 30.0
ANTICIPATE_WAIT_S = 30.0
"""How long one request for the next version waits upstream before it is asked again."""


class Relay:
    def __init__(self, config: GatewayConfig, store: VersionStore, monitor: LinkMonitor, metrics: GatewayMetrics):
        self.config = config
        self.store = store
        self.monitor = monitor
        self.metrics = metrics
        limiter_rate = config.bandwidth_cap_mbps * 1e6 / 8
        self.sources = [
            Source(url, monitor.link(url, "upstream", url), RateLimiter(limiter_rate) if limiter_rate else None,
                   delay_s=config.link_delay_ms / 1000)
            for url in config.upstreams
        ]
        self.peer = f"gateway/{config.region}"
        self._wake = asyncio.Event()
        self._known_models: set[str] = set()
        self._active: dict[tuple[str, int, str], asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._fetcher: Fetcher | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._session = client_session(connections=max(16, 4 * self.config.relay_connections), timeout_s=None)
        self._fetcher = Fetcher(
            self._session, self.sources, self.peer, self.monitor,
            stall_timeout_s=self.config.stall_timeout_s, give_up_s=max(60.0, 6 * self.config.stall_timeout_s),
            penalty_s=min(self.config.stall_timeout_s, 5.0),
        )
        self.store.on_piece_corrupt.append(self._on_corrupt)
        self._tasks = [asyncio.create_task(self._follow(s)) for s in self.sources]
        self._tasks.append(asyncio.create_task(self._sync_loop()))
        self.wake()

    async def stop(self) -> None:
        tasks = self._tasks + list(self._active.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def wake(self) -> None:
        self._wake.set()

    def _on_corrupt(self, entry: StoredVersion, index: int) -> None:
        self.wake()

    # -- following upstreams -------------------------------------------------------------------------
    async def _follow(self, source: Source) -> None:
        """Long-poll one upstream's heads and wake the sync loop on every change."""
        since, instance = -1, ""
        backoff = 0.2
        while True:
            params = {"since": since, "instance": instance, "wait": FOLLOW_WAIT_S}
            if source.delay_s:
                await asyncio.sleep(source.delay_s)
            try:
                answer = await request_json(self._session, "GET", f"{source.url}/v1/heads", params=params,
                                            headers={PEER_HEADER: self.peer},
                                            timeout_s=FOLLOW_WAIT_S + self.config.stall_timeout_s)
            except HttpError as e:
                if source.link is not None:
                    self.monitor.record_error(source.link, f"follow: {e}")
                source.bad_until = time.monotonic() + min(self.config.stall_timeout_s, 5.0)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                since = -1  # after an outage, take the whole picture again
                continue
            backoff = 0.2
            source.bad_until = 0.0
            since, instance = int(answer["epoch"]), str(answer["instance"])
            new_models = set(answer["heads"]) - self._known_models
            self._known_models |= new_models
            if new_models or any(self._behind(m, v) for m, v in answer["heads"].items()):
                self.wake()

    def _behind(self, model: str, head: int) -> bool:
        mine = self.store.head(model)
        return mine is None or mine < head or any(not e.complete for e in self.store.entries(model))

    # -- syncing ---------------------------------------------------------------------------------------
    async def _sync_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RESYNC_S)
            self._wake.clear()
            try:
                await self._sync_pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # a pass that fails is retried by the next one; never stop relaying
                log.exception("relay: sync pass failed")
                await asyncio.sleep(0.5)

    async def _sync_pass(self) -> None:
        wanted: list[dict] = []
        for model in sorted(self._known_models | set(self.store.models())):
            listing = await self._upstream_versions(model)
            if listing is None:
                continue
            deltas = [v for v in listing if v["kind"] == "delta"][-self.config.keep_deltas:]
            fulls = [v for v in listing if v["kind"] == "full"][-self.config.keep_fulls:]
            for v in sorted(deltas + fulls, key=lambda v: (v["version"], v["kind"])):
                entry = self.store.get(model, v["version"], v["kind"])
                if entry is None or not entry.complete:
                    wanted.append({"model": model, **v})
            if listing:
                self._anticipate(model, max(v["version"] for v in listing) + 1, "delta" if deltas else "full")
        for model in self.store.models():  # local leftovers: after a restart, or a dropped corrupt piece
            for e in self.store.entries(model):
                if not e.complete:
                    wanted.append({"model": model, "version": e.version, "kind": e.kind})
        for w in wanted:
            key = (w["model"], int(w["version"]), str(w["kind"]))
            if key not in self._active:
                task = asyncio.create_task(self._mirror(*key))
                self._active[key] = task
                task.add_done_callback(lambda _t, key=key: self._active.pop(key, None))

    def _anticipate(self, model: str, version: int, kind: str) -> None:
        """Keep requests for the version after the upstream's head waiting there, so that it starts
        flowing here the moment it is announced upstream: half a round trip after, instead of the
        two and a half that hearing of it, listing and asking for its manifest would take. Only the
        kind the model's versions mostly come in is waited for (deltas, once there are any); any
        other kind is mirrored the usual way."""
        key = (model, version, kind)
        if key in self._active or self.store.get(*key) is not None:
            return

        async def wait_for_it() -> None:
            while True:
                asked = time.monotonic()
                try:
                    await self._mirror(model, version, kind, wait_s=ANTICIPATE_WAIT_S)
                    return
                except NotAnnounced:
                    if time.monotonic() - asked < ANTICIPATE_WAIT_S / 2:
                        return  # answered at once: a newer version came first, this one is not coming

        task = asyncio.create_task(wait_for_it())
        self._active[key] = task
        task.add_done_callback(lambda _t: self._active.pop(key, None))

    async def _upstream_versions(self, model: str) -> list[dict] | None:
        for source in self.sources:
            if not source.healthy(time.monotonic()):
                continue
            if source.delay_s:
                await asyncio.sleep(source.delay_s)
            try:
                answer = await request_json(self._session, "GET", f"{source.url}/v1/models/{model}/versions",
                                            headers={PEER_HEADER: self.peer}, timeout_s=self.config.stall_timeout_s)
                return answer["versions"]
            except HttpError as e:
                if e.status == 404:
                    continue
                source.bad_until = time.monotonic() + min(self.config.stall_timeout_s, 5.0)
        return None

    async def _mirror(self, model: str, version: int, kind: str, wait_s: float = 0.0) -> None:
        """Bring one version here: manifest first (which announces it), then the missing pieces.
        With `wait_s` the version may not be announced upstream yet (NotAnnounced if it was not)."""
        fetcher = self._fetcher
        t0 = time.monotonic()
        try:
            entry = self.store.get(model, version, kind)
            if entry is None:
                entry = await fetcher.manifest_bytes(model, version, kind, self._accept_manifest,
                                                     prefetch=self.config.relay_connections, wait_s=wait_s)
                t0 = time.monotonic()
            with self.store.using(entry):
                missing = entry.missing
                if not missing:
                    return

                async def store_piece(index: int, data: bytes) -> None:
                    await self.store.put_piece(entry, index, data)
                    self.metrics.bytes_in.labels(kind, "relay").inc(len(data))

                await fetcher.pieces(entry.manifest, missing, self.config.relay_connections, store_piece)
                log.info("relay: %s v%d %s complete (%d pieces in %.2fs)",
                         model, version, kind, len(missing), time.monotonic() - t0)
        except NotAnnounced:
            raise
        except FetchError as e:
            log.warning("relay: %s v%d %s: %s; will retry", model, version, kind, e)
        except ConflictError as e:
            log.error("relay: %s", e)

    async def _accept_manifest(self, raw: bytes) -> StoredVersion:
        entry, _ = await self.store.put_manifest(raw)
        return entry


async def announce_forever(config: GatewayConfig, interval_s: float) -> None:
    """Tell each upstream this gateway exists (for their link monitors), and keep telling it."""
    if not config.advertise:
        return
    body = {"region": config.region, "url": config.advertise, "instance": uuid.uuid4().hex}
    async with client_session(timeout_s=10.0) as session:
        while True:
            missed = False
            for url in config.upstreams:
                try:
                    await request_json(session, "POST", f"{url}/v1/gateways", body=body)
                except HttpError:
                    missed = True
            # An upstream that was not reachable (still starting, restarting) is asked again soon.
            await asyncio.sleep(1.0 if missed else interval_s)
