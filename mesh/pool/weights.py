"""The pool's weight-sync loop for one policy: keep its engine and its synced directory at the head.

`PolicyWeights` drives the gateway puller (`deltamesh.gateway.weight_sync.WeightSync`: register,
long-poll the head, fetch a plan's verified manifests and pieces, apply them to the directory
atomically, heartbeat) and brings every new version into the engine:

- an engine that swaps in place (the transformers engine) gets each plan's steps as soon as they
  are fetched and verified, before the directory is written: a delta chain is applied step by step
  with `apply_update`, a full snapshot is swapped in whole. Generation moves to the new version
  without waiting for the disk, which is then written for restarts.
- otherwise, or when an in-place update cannot be applied (the engine does not hold the delta's
  base, e.g. it started from other weights), the engine reloads the version from the directory with
  `load_version` once the directory holds it. SGLang always takes this way.

Start-up order: a directory that already holds a version (a restarted pool) is loaded into the
engine first, so only what is newer is fetched; then the pool registers and syncs to the gateway's
head. `ready` turns true only after that first round, once the engine serves a published version,
and the rollout worker leases nothing before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from deltamesh.delta import CodecError, Manifest, dir_manifest
from deltamesh.gateway.config import PoolSyncConfig
from deltamesh.http import HttpError
from deltamesh.gateway.weight_sync import Step, SyncError, WeightSync
from deltamesh.mesh.engines.base import Engine, EngineError
from deltamesh.mesh.pool.metrics import PoolMetrics

log = logging.getLogger(__name__)

RETRY_S = 1.0


@dataclass
class WeightsStatus:
    """What one policy's weight stream has done (for the pool's status and tests)."""

    resumed_from_dir: int | None = None
    """Version found in the synced directory at start (loaded without any download)."""
    fetched: dict[str, int] = field(default_factory=lambda: {"full": 0, "delta": 0})
    """Plan steps fetched, by kind."""
    swaps: dict[str, int] = field(default_factory=lambda: {"in_place": 0, "reload": 0})
    """Versions brought into the engine, by way."""
    last_swap_at: float | None = None
    last_error: str = ""


class PolicyWeights:
    """One policy's weight stream (see the module docstring). `await run(stop)` until stopped."""

    def __init__(self, engine: Engine, sync_config: PoolSyncConfig, *, hot_swap: bool = True,
                 metrics: PoolMetrics | None = None) -> None:
        self.engine = engine
        self.model_id = engine.model_id
        self.hot_swap = hot_swap and engine.supports_in_place
        self.metrics = metrics
        self.sync = WeightSync(sync_config, on_fetched=self._swap_in_place, on_applied=self._reload_if_behind)
        self.status = WeightsStatus()
        self._engine_synced = False  # the engine serves a version of the gateway's lineage
        self._started = False  # the first sync round after start-up is done
        self._update_lock = asyncio.Lock()

    @property
    def dir(self) -> str:
        return self.sync.config.dir

    @property
    def ready(self) -> bool:
        """The engine serves a published version, and the start-up sync to the head is done."""
        return self._started and self._engine_synced

    @property
    def version(self) -> int | None:
        """The version the engine serves (None until it serves a published one)."""
        return self.engine.version if self._engine_synced else None

    @property
    def newest(self) -> int | None:
        """The newest version a gateway has announced (or that is held, if newer)."""
        known = [v for v in (self.sync.head, self.sync.version, self.version) if v is not None]
        return max(known) if known else None

    async def __aenter__(self) -> "PolicyWeights":
        """Open the puller and resume from the directory (load what it holds into the engine)."""
        await self.sync.__aenter__()
        try:
            await self._resume_from_dir()
        except BaseException:
            await self.sync.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sync.__aexit__(*exc)

    async def sync_round(self, wait_s: float = 0.0) -> bool:
        """One round: wait up to `wait_s` for a head newer than the directory, fetch it and bring it into
        the engine and the directory; True if a new version was applied. Raises SyncError/HttpError."""
        return await self.sync.sync_once(wait_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Resume from the directory, register, sync to the head, then follow the head until `stop`
        (the long poll in progress may keep it a while: cancel the task to end it at once)."""
        async with self:
            with contextlib.suppress(HttpError, SyncError):
                await self.sync.heartbeat()  # registers; the heartbeat loop keeps retrying if this fails
            while not stop.is_set():
                try:
                    await self.sync_round()
                    break
                except (SyncError, HttpError, CodecError, OSError) as e:
                    self._note_error(f"start-up sync: {e}")
                    await _wait_event(stop, RETRY_S)
            self._started = True
            await asyncio.gather(self._follow(stop), self._keep_engine_current(stop))

    async def _follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sync.run(stop)
            except Exception as e:  # noqa: BLE001 - the pool must keep following the head whatever broke
                self._note_error(f"weight sync stopped: {type(e).__name__}: {e}; restarting it")
                await _wait_event(stop, RETRY_S)

    # -- bringing versions into the engine ---------------------------------------------------------
    async def _resume_from_dir(self) -> None:
        held = await asyncio.to_thread(dir_manifest, self.dir)
        if held is None or held.model_id != self.model_id:
            return
        try:
            await self._reload(held.version)
        except (EngineError, CodecError, OSError) as e:
            self._note_error(f"cannot load v{held.version} from {self.dir}: {e}")
            return
        self.status.resumed_from_dir = held.version
        log.info("%s: resumed v%d from %s", self.model_id, held.version, self.dir)

    async def _swap_in_place(self, steps: Sequence[Step]) -> None:
        """`on_fetched`: count the steps; hot-swap them into the engine when it can take them."""
        for manifest, pieces in steps:
            self.status.fetched[manifest.kind] += 1
            if self.metrics is not None:
                self.metrics.transfers.labels(self.model_id, manifest.kind).inc()
                self.metrics.transfer_bytes.labels(self.model_id).inc(sum(len(p) for p in pieces))
        if not self.hot_swap:
            return
        async with self._update_lock:
            for manifest, pieces in steps:
                if self._engine_synced and manifest.version <= self.engine.version:
                    continue  # already served (an earlier round swapped it but could not write the directory)
                if manifest.kind == "delta" and not self._engine_synced:
                    log.info("%s: engine does not hold a published version; it will load v%d from disk",
                             self.model_id, steps[-1][0].version)
                    return
                try:
                    await self.engine.apply_update(manifest, pieces)
                except (CodecError, EngineError) as e:
                    # The engine stays on what it served; `_reload_if_behind` loads the version from disk.
                    self._note_error(f"in-place update to v{manifest.version} failed: {e}")
                    return
                self._swapped("in_place")

    async def _reload_if_behind(self, final: Manifest) -> None:
        """`on_applied`: the directory now holds `final`; load it unless the engine already serves it."""
        if self._engine_synced and self.engine.version >= final.version:
            return
        try:
            await self._reload(final.version)
        except (EngineError, CodecError, OSError) as e:
            # Must not abort the puller's round (the directory did move); `_keep_engine_current` retries.
            self._note_error(f"loading v{final.version} from {self.dir} failed: {e}")

    async def _reload(self, version: int) -> None:
        async with self._update_lock:
            if self._engine_synced and self.engine.version >= version:
                return
            await self.engine.load_version(self.dir, version)
            self._swapped("reload")

    async def _keep_engine_current(self, stop: asyncio.Event) -> None:
        """Retry a failed reload: the engine must end up serving at least what the directory holds."""
        while not stop.is_set():
            await _wait_event(stop, RETRY_S)
            held = self.sync.version
            if held is not None and not (self._engine_synced and self.engine.version >= held):
                try:
                    await self._reload(held)
                except (EngineError, CodecError, OSError) as e:
                    self._note_error(f"loading v{held} from {self.dir} failed again: {e}")

    def _swapped(self, way: str) -> None:
        self._engine_synced = True
        self.status.swaps[way] += 1
        self.status.last_swap_at = time.time()
        if self.metrics is not None:
            self.metrics.swaps.labels(self.model_id, way).inc()

    def _note_error(self, reason: str) -> None:
        self.status.last_error = reason
        log.warning("%s: %s", self.model_id, reason)


async def _wait_event(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
