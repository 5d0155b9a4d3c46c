"""The pool's weight stream for one policy: each new version into its engine and its synced directory.

`PolicyWeights.sync_round` is the whole way of a version into the pool, in one place, top to bottom
(the gateway-talking steps are `deltamesh.mesh.pool.weight_sync.WeightSync`'s):

1. head: long-poll the gateway for a head newer than the directory;
2. plan: ask for a transfer plan from the version the directory holds (a delta chain or a full);
3. fetch: each step's signed manifest and pieces, verified;
4. decode: each step decoded once;
5. engine: an engine that swaps in place (the transformers engine) takes the decoded versions into
   its live weights (`apply_update`: a delta chain step by step, a full snapshot copied in whole),
   so generation moves on without waiting for the disk. A failed update leaves the engine
   bit-identical on what it served, and is logged. An engine still behind the directory (no hot
   swap, as with SGLang; a failed update; a delta for weights the engine does not hold) reloads the
   version from it (`load_version`); if that fails too, the next round retries it first and polls
   the head only briefly until it succeeds;
6. prove: the engine's weights, read back, must be exactly the version it claims (`serve_check.py`:
   every tensor the swap wrote and a rotating share of the rest, against the manifest's signed
   hashes), before the directory is written. On a mismatch the policy is drifted: not `ready` (so
   the worker leases nothing), the version is reloaded in full from the directory and checked again;
   a reload that fails or does not pass is retried at the start of each round;
7. persist: the same decoded versions are applied to the synced directory, atomically, for restarts
   and for engines that load from disk. Behind an engine that took them in place and passed its
   check, the write is queued (`dir_writer.py`) and the round ends: the next round plans from the
   version the directory will hold, so the next version is fetched and decoded while the disk is
   written (its engine apply waits for the write);
8. report: `status` and the pool metrics (steps fetched, swaps by way, checks and drift, offers
   refused from gateways and gateways found stale: `deltamesh.mesh.pool.head_check`), and `timeline`,
   when each version reached each of these steps (`timeline.py`: head, fetched, verified, applied,
   serving, persisted).

These are the steps of docs/ARCHITECTURE.md's version path, numbered the same.

A delta that does not verify, or does not fit what the directory holds, sends the round back to
step 3 with a full snapshot. Start-up: a directory that already holds a version (a restarted pool)
is loaded into the engine first, so only what is newer is fetched; then the pool registers and syncs
to the gateway's head. `ready` turns true only after that first round, once the engine serves a
published version, and the rollout worker leases nothing before. Credentials that every gateway
refuses end the stream (and so the pool) with one error; a clean stop deregisters the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from deltamesh.delta import CodecError, DecodedVersion, Manifest, dir_manifest
from deltamesh.http import HttpError
from deltamesh.mesh.engines.base import Engine, EngineError
from deltamesh.mesh.pool.config import ServeCheckConfig
from deltamesh.mesh.pool.dir_writer import DirectoryWriter
from deltamesh.mesh.pool.head_check import Refusal
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.serve_check import CheckResult, ServeCheck
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.timeline import VersionTimeline
from deltamesh.mesh.pool.weight_sync import (
    RETRY_S,
    CredentialsError,
    Refused,
    SyncError,
    WeightSync,
)
from deltamesh.signals import sleep_or_stop, until_stopped

log = logging.getLogger(__name__)


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
    drifted: bool = False
    """The engine's weights read back differ from the version it claims (cleared by a passing check)."""
    checks: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})
    """Checks of what the engine serves (`serve_check.py`), by result."""
    last_check: str = ""


class PolicyWeights:
    """One policy's weight stream (see the module docstring). `await run(stop)` until stopped; rounds
    never run concurrently (`run` drives them one after another)."""

    def __init__(self, engine: Engine, sync_config: PoolSyncConfig, *, hot_swap: bool = True,
                 metrics: PoolMetrics | None = None, check: ServeCheckConfig | None = None) -> None:
        self.engine = engine
        self.model_id = engine.model_id
        self.hot_swap = hot_swap and engine.supports_in_place
        self.metrics = metrics
        self.sync = WeightSync(sync_config, on_refusal=self._refused)
        self.status = WeightsStatus()
        self.timeline = VersionTimeline(on_stage=self._stage_reached)
        """When each recent version reached each step of its way in (the latency budget's pool side)."""
        self.sync.on_stage = lambda version, stage: self.timeline.mark(version, stage)
        self._engine_synced = False  # the engine serves a version of the gateway's lineage
        self._started = False  # the first sync round after start-up is done
        self.check = ServeCheck(check)
        self._served: Manifest | None = None  # manifest of the version last put into the engine
        self._touched: set[str] | None = set()  # tensors written since the last check (None: all)
        self._check_due = False
        self.last_result: CheckResult | None = None
        """The last check of what the engine serves (`serve_check.py`)."""
        self.writer = DirectoryWriter(
            self.sync, on_written=lambda versions: self.timeline.mark(versions, "persisted"),
            on_error=self._note_error)
        """The synced directory's writes, queued behind the engine's swaps (`dir_writer.py`)."""

    @property
    def dir(self) -> str:
        return self.sync.config.dir

    @property
    def ready(self) -> bool:
        """The engine serves a published version, and the start-up sync to the head is done."""
        return self._started and self._engine_synced and not self.status.drifted

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
        try:
            await self.writer.flush()  # a clean stop leaves the directory at the version served
        finally:
            await self.sync.__aexit__(*exc)

    async def run(self, stop: asyncio.Event, rounds: Callable[[float], Awaitable[bool]] | None = None) -> None:
        """Resume from the directory, register, sync to the head, then follow the head until `stop`
        (the long poll in progress is cut short when `stop` is set). `rounds` replaces `sync_round` as
        what each round does (the evaluator's: move to the version it scores next, then score it);
        failed rounds back off the same way."""
        async with self:
            await self.sync.register_once()  # the heartbeat loop keeps trying if this fails
            heartbeats = asyncio.create_task(self.sync.heartbeat_loop(stop))
            try:
                await self._follow(stop, rounds or self.sync_round)
            finally:
                heartbeats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeats
                await self.sync.deregister()

    # -- the way of a version into the pool ------------------------------------------------------
    async def sync_round(self, wait_s: float = 0.0, *, to: int | None = None) -> bool:
        """One round (steps 1-8 of the module docstring): wait up to `wait_s` for a head newer than the
        directory and bring it into the engine and the directory; True if a new version came in. With
        `to` (above the version held) the round waits for a head at or past `to` and moves to `to`
        itself, not to the head. Raises SyncError/HttpError/CodecError/OSError when the transfer fails
        (the directory is then where it was)."""
        if self._engine_behind():
            await self.writer.flush()  # the reload reads the directory
            await self._reload_from_dir()  # a reload that failed (or a drift) in an earlier round
            await self._prove()
            if self._engine_behind():
                wait_s = min(wait_s, RETRY_S)
            elif self.version is not None and "serving" not in self.timeline.get(self.version):
                self._serving([self.version])
        base = self.writer.held
        if to is not None and base is not None and to <= base:
            raise ValueError(f"{self.model_id}: a round moves forward only, and v{base} is held (asked for v{to})")
        after = base if to is None else max(to - 1, -1 if base is None else base)
        head = await self.sync.wait_for_head(wait_s, after=after)
        if head is None:
            return False
        seen = time.time()
        plan = await self.sync.fetch_plan(head if to is None else min(head, to), base=base)
        self.timeline.mark([s.version for s in plan.steps], "head", seen)
        while True:
            try:
                versions = await self.sync.fetch_decoded(plan)  # verified, decoded once for both below
                self._count_fetched(versions)
                if self.hot_swap:
                    await self._update_engine(versions)
                    if self._engine_synced and self.engine.version == versions[-1].version:
                        # A failed check drifts the engine: reloaded below, once the directory has it.
                        if await self._check() and not self.status.drifted:
                            self._serving([v.version for v in versions])
                            # Served and proven: the directory is written while the next version comes.
                            self.writer.write_behind(None if versions[0].kind == "full" else plan.from_version,
                                                     versions)
                            return True
                await self.sync.persist(versions)
                self.timeline.mark([v.version for v in versions], "persisted")
                break
            except CodecError as e:
                plan = await self.sync.fallback_plan(plan, e)  # a full snapshot; raises if that was one
        if self._engine_behind():
            await self._reload_from_dir()
        await self._prove()
        self._serving([v.version for v in versions if "serving" not in self.timeline.get(v.version)])
        return True

    def _serving(self, versions: Sequence[int]) -> None:
        """Mark the versions the engine now serves (itself or a newer one), if it may lease on them."""
        if self._engine_synced and not self.status.drifted:
            self.timeline.mark([v for v in versions if v <= self.engine.version], "serving")

    async def _update_engine(self, versions: Sequence[DecodedVersion]) -> None:
        """Hot-swap the versions into the engine, in order; stop at the first that cannot go in (the
        engine keeps what it serves and catches up from the directory once it is written)."""
        for version in versions:
            if self._engine_synced and version.version <= self.engine.version:
                continue  # already served (an earlier round swapped it in but could not persist it)
            if version.kind == "delta" and not self._engine_synced:
                log.info("%s: the engine does not serve a published version; it will load v%d from %s",
                         self.model_id, versions[-1].version, self.dir)
                return
            try:
                await self.engine.apply_update(version)
            except (CodecError, EngineError) as e:
                self._note_error(f"in-place update to v{version.version} failed, the engine stays on "
                                 f"v{self.engine.version} and will load from the directory: {e}")
                return
            self._swapped("in_place")
            self.timeline.mark(version.version, "applied")
            self._put_in(version.manifest, [version.manifest.tensors[i].name
                                            for i in (*version.updates, *version.whole)]
                         if version.kind == "delta" else None)

    async def _reload_from_dir(self) -> None:
        """Load the version the directory holds into the engine; a failure is logged, not raised (the
        directory did move), and retried at the start of the next round."""
        held = self.sync.version
        try:
            await self.engine.load_version(self.dir, held)
        except (EngineError, CodecError, OSError) as e:
            self._note_error(f"loading v{held} from {self.dir} failed, the next round tries again: {e}")
            return
        self._swapped("reload")
        self.timeline.mark(held, "applied")
        self._put_in(await asyncio.to_thread(dir_manifest, self.dir), None)

    def _engine_behind(self) -> bool:
        held = self.sync.version
        return held is not None and (self.status.drifted or not (self._engine_synced and self.engine.version >= held))

    # -- proof of what the engine serves (step 6) ------------------------------------------------
    def _put_in(self, manifest: Manifest | None, touched: Sequence[str] | None) -> None:
        """Note a version that went into the engine and the tensors it wrote (None: every tensor)."""
        self._served = manifest if manifest is not None and manifest.model_id == self.model_id else None
        self._touched = None if touched is None or self._touched is None else self._touched | set(touched)
        self._check_due = True

    async def _check(self) -> bool:
        """Check the engine if a swap since the last check is due one; False only when a check failed."""
        if not self._check_due or self._served is None:
            return True
        if not self.check.checkable(self.engine):  # switched off, or an engine without read-back
            self._check_due = False
            self.status.last_check = "not checked: off, or the engine cannot read its weights back"
            return True
        result = await self.check.run(self.engine, self._served, self._touched)
        self._checked(result)
        return result.ok

    async def _prove(self) -> None:
        """Check the engine after the round's swaps; on a mismatch, drift: reload in full and check again."""
        if await self._check():
            return
        await self._reload_from_dir()
        if self._check_due and self._served is not None:
            self._checked(await self.check.run(self.engine, self._served, self._touched))

    @property
    def proven(self) -> Manifest | None:
        """The signed manifest of the version the engine serves, if the last check of it passed (the
        engine's weights read back matched its hashes) and nothing went in since; else None."""
        result, served = self.last_result, self._served
        if (result is None or not result.ok or served is None or self._check_due or self.status.drifted
                or not self._engine_synced or served.version != self.engine.version or result.version != served.version):
            return None
        return served

    def _checked(self, result: CheckResult) -> None:
        self.last_result = result
        self._check_due, self._touched = False, set()
        self.status.checks["ok" if result.ok else "failed"] += 1
        self.status.last_check = result.describe()
        was_drifted, self.status.drifted = self.status.drifted, not result.ok
        if not result.ok:
            log.error("%s: the engine does not serve what it claims, %s; not leasing until a full reload "
                      "passes", self.model_id, result.reason)
            self.status.last_error = f"drifted: {result.reason}"
        elif was_drifted:
            log.info("%s: recovered, the engine serves %s", self.model_id, result.describe())
        if self.metrics is not None:
            self.metrics.checks.labels(self.model_id, "ok" if result.ok else "failed").inc()
            self.metrics.check_seconds.labels(self.model_id).observe(result.seconds)
            self.metrics.drifted.labels(self.model_id).set(0 if result.ok else 1)
            if not result.ok:
                self.metrics.check_failures.labels(self.model_id).inc()

    # -- start-up and following the head ---------------------------------------------------------
    async def _resume_from_dir(self) -> None:
        held = await asyncio.to_thread(dir_manifest, self.dir)
        if held is None or held.model_id != self.model_id:
            return
        try:
            await self.engine.load_version(self.dir, held.version)
        except (EngineError, CodecError, OSError) as e:
            self._note_error(f"cannot load v{held.version} from {self.dir}: {e}")
            return
        self._swapped("reload")
        self._put_in(held, None)
        self.status.resumed_from_dir = held.version
        log.info("%s: resumed v%d from %s", self.model_id, held.version, self.dir)

    async def _follow(self, stop: asyncio.Event, rounds: Callable[[float], Awaitable[bool]]) -> None:
        """Rounds until `stop`: the first without waiting (the start-up sync), then long polls."""
        while not stop.is_set():
            wait_s = self.sync.config.poll_wait_s if self._started else 0.0
            try:
                await until_stopped(rounds(wait_s), stop)
                self._started = True
                self.sync.outage.succeeded()
            except CredentialsError:
                raise  # revoked or wrong: nothing will come until an operator acts
            except (SyncError, HttpError, CodecError, OSError) as e:
                # Engine and directory hold what they held (every apply is atomic): try again from there,
                # after a backoff that grows while the failures last (one log line per outage).
                await sleep_or_stop(stop, self._round_failed(f"{type(e).__name__}: {e}", logged=isinstance(e, Refused)))
            except Exception as e:  # noqa: BLE001 - the pool must keep following the head whatever broke
                await sleep_or_stop(stop, self._round_failed(f"unexpected {type(e).__name__}: {e}"))
            finally:
                self._report_gateways()

    # -- report ----------------------------------------------------------------------------------
    def _count_fetched(self, versions: Sequence[DecodedVersion]) -> None:
        for version in versions:
            self.status.fetched[version.kind] += 1
            if self.metrics is not None:
                self.metrics.transfers.labels(self.model_id, version.kind).inc()
                self.metrics.transfer_bytes.labels(self.model_id).inc(version.manifest.payload_bytes)

    def _stage_reached(self, stage: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.version_stage_seconds.labels(self.model_id, stage).observe(seconds)

    def _refused(self, refusal: Refusal) -> None:
        self.status.last_error = str(refusal)
        if self.metrics is not None:
            self.metrics.refusals.labels(self.model_id, refusal.reason).inc()

    def _report_gateways(self) -> None:
        if self.metrics is not None:
            for url, standing in self.sync.book.describe().items():
                self.metrics.stale_gateways.labels(self.model_id, url).set(1 if standing["state"] == "stale" else 0)

    def _swapped(self, way: str) -> None:
        self._engine_synced = True
        self.status.swaps[way] += 1
        self.status.last_swap_at = time.time()
        if self.metrics is not None:
            self.metrics.swaps.labels(self.model_id, way).inc()

    def _round_failed(self, reason: str, *, logged: bool = False) -> float:
        """Report a failed round; the backoff before the next."""
        reason = f"{'sync' if self._started else 'start-up sync'}: {reason}"
        self.status.last_error = reason
        return self.sync.set_error(reason, logged=logged)  # heartbeats report the error state

    def _note_error(self, reason: str) -> None:
        self.status.last_error = reason
        log.warning("%s: %s", self.model_id, reason)
