"""The backend's network side: versions fetched and verified through the mesh, the follow loop, metrics.

It runs on the backend's own event loop thread (`deltamesh.loop_thread`), one per vLLM worker. It
is the pool's weight sync, unchanged (`deltamesh.mesh.pool.weight_sync.WeightSync`): head long polls
with the freeze and rollback checks, transfer plans, signed manifests verified against the trusted
keys, pieces hash-checked with failover between the listed gateways, a full snapshot when a delta
does not verify, registration and heartbeats when the server has a pool name. `fetch` hands the
worker decoded versions; the worker applies them (`engine.py`) and reports back with `served`. With
tensor parallelism the lead rank's `plan` names the steps instead, and each rank fetches its own share
of each (`rank_updates.py`); the follow loop then leaves all fetching to the ranks.

Follow mode: `follow` long-polls the head and, for each newer version, fetches and decodes it here
first, then takes it through the server's own RL routes (`/start_weight_update`, `/update_weights`
with the version, `/finish_weight_update` naming it, `/reset_prefix_cache` so that no new request
reuses KV computed with the old weights): the worker finds the version ready and only applies it,
between two engine steps, as vLLM runs every RL call. Its metrics are the pool's (versions behind
the head, serve checks and drift, refusals and stale gateways, transfers, updates), served with a
JSON status at `metrics_listen`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from deltamesh.delta import CodecError, DecodedVersion, Manifest
from deltamesh.gateway.plan import Plan, PlanStep
from deltamesh.http import HttpError, client_session, request_json, serving
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.pool.head_check import Refusal
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.serve_check import CheckResult
from deltamesh.mesh.pool.weight_sync import Refused, SyncError, WeightSync
from deltamesh.mesh.vllm_plugin.config import BackendConfig
from deltamesh.metrics import service_registry, status_app
from deltamesh.signals import sleep_or_stop, until_stopped

log = logging.getLogger(__name__)


class VersionReceiver:
    """One worker's way to the mesh (see the module docstring). Every coroutine runs on the backend's loop."""

    def __init__(self, config: BackendConfig, model_dir: str, *, lead: bool = True, decodes: bool = True) -> None:
        """`lead`: this worker is the server's first (rank 0), the one that registers, serves the metrics,
        plans and follows the head; with tensor parallelism every rank fetches and applies its own share,
        only one speaks for them. `decodes`: the worker takes whole decoded versions from `fetch` (False:
        tensor-parallel ranks, which take `plan`'s steps share by share, `rank_updates.py`)."""
        self.config = config
        self.lead = lead
        self.decodes = decodes
        self.sync = WeightSync(config.sync_config(model_dir), on_refusal=self._refused)
        self.registry = service_registry("vllm-backend")
        self.pool_metrics = PoolMetrics(self.registry)
        self.engine_metrics = EngineMetrics(config.model, "vllm-backend", self.registry)
        self.proof: dict[str, Any] = {}
        """The last update's proof: its version, weights hash, and the check of what vLLM holds."""
        self.metrics_url = ""
        self.last_error = ""
        self._ready: tuple[int | None, int, list[DecodedVersion]] | None = None
        """(base, version, decoded steps) fetched ahead by the follow loop."""
        self._stack = contextlib.AsyncExitStack()
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._fetching = asyncio.Lock()

    @property
    def version(self) -> int | None:
        """The version the worker serves (None: one no gateway published, until the first update)."""
        return self.sync.version

    async def open(self, served: int | None = None, weights_hash: str | None = None) -> None:
        """Connect; `served` (with its `weights_hash`): the version the worker serves already, when it
        took versions before (else the one its directory's manifest names, if any)."""
        self._stop = asyncio.Event()
        await self._stack.enter_async_context(self.sync)
        if served is not None and weights_hash is not None:
            self.sync.version = served
            self.sync.guard.hold(served, weights_hash)
        if self.config.name and self.lead:
            await self.sync.register_once()  # refused credentials end here, with one error
            self._tasks.append(asyncio.create_task(self.sync.heartbeat_loop(self._stop)))
        if self.config.metrics_listen and self.lead:
            self.metrics_url = await self._stack.enter_async_context(
                serving(status_app(self.registry, self.status), self.config.metrics_listen))
            log.info("deltamesh backend: metrics and status at %s", self.metrics_url)
        if self.version is not None:
            self.engine_metrics.version.set(self.version)
        if self.config.follow and self.lead:
            self._tasks.append(asyncio.create_task(self._follow(self._stop)))

    async def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.config.name and self.lead:
            await self.sync.deregister()
        await self._stack.aclose()

    # -- fetching a version ----------------------------------------------------------------------
    async def fetch(self, target: int | None) -> list[DecodedVersion]:
        """The decoded, verified steps from the version served to `target` (None: the head); [] when
        it is served already. Refused for a version older than the one served; SyncError when no gateway
        announces `target` within `wait_s`."""
        held = self._not_back(target)
        async with self._fetching:  # the follow loop and a caller of the RL routes take turns
            return await self._fetch(target, held)

    async def plan(self, target: int | None) -> list[PlanStep]:
        """The steps from the version served to `target` (None: the head), for ranks that fetch their own
        shares of each; [] when it is served already. Refused and SyncError as `fetch`."""
        held = self._not_back(target)
        async with self._fetching:
            plan = await self._plan(target, held)
            return [] if plan is None else list(plan.steps)

    def _not_back(self, target: int | None) -> int | None:
        held = self.version
        if target is not None and held is not None and target < held:
            raise Refused(f"v{target} is older than v{held}, which this server serves: a server never moves back")
        return held

    async def _plan(self, target: int | None, held: int | None) -> Plan | None:
        if target is not None and target == held:
            return None
        if target is None:
            head = await self.sync.wait_for_head(0.0, after=held)
            if head is None:
                return None
        else:
            head = await self.sync.wait_for_head(self.config.wait_s, after=target - 1)
            if head is None:
                raise SyncError(f"no gateway announced v{target} of {self.config.model} within {self.config.wait_s:g} s")
        return await self.sync.fetch_plan(head if target is None else target, base=held)

    async def _fetch(self, target: int | None, held: int | None) -> list[DecodedVersion]:
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == held and (target is None or ready[1] == target):
            return ready[2]
        plan = await self._plan(target, held)
        if plan is None:
            return []
        try:
            versions = await self.sync.fetch_decoded(plan)
        except CodecError as e:
            versions = await self.sync.fetch_decoded(await self.sync.fallback_plan(plan, e))
        for version in versions:
            self.pool_metrics.transfers.labels(self.config.model, version.kind).inc()
            self.pool_metrics.transfer_bytes.labels(self.config.model).inc(version.manifest.payload_bytes)
        return versions

    # -- what the worker reports -----------------------------------------------------------------
    def served(self, manifest: Manifest, seconds: float, check: CheckResult | None,
               ranks: list[dict[str, Any]] | None = None) -> None:
        """The worker serves the version of `manifest` now (its update took `seconds`), proven by `check`
        (None: not checked); `ranks`: what each tensor-parallel rank fetched and proved of its share."""
        if ranks is not None:
            self.pool_metrics.transfers.labels(self.config.model, manifest.kind).inc()
            self.pool_metrics.transfer_bytes.labels(self.config.model).inc(sum(r["fetched_bytes"] for r in ranks))
        self.sync.version = manifest.version
        self.sync.guard.hold(manifest.version, manifest.weights_hash)
        self.sync.state, self.last_error = "idle", ""
        self.proof = {"version": manifest.version, "kind": manifest.kind, "weights_hash": manifest.weights_hash,
                      "verified": True, "at": time.time(),
                      "served_check": check.describe() if check is not None else "off",
                      "checked_tensors": check.checked if check is not None else 0,
                      "unreadable_tensors": check.unreadable if check is not None else 0}
        if ranks is not None:
            self.proof["ranks"] = ranks
        self.engine_metrics.version.set(manifest.version)
        self.engine_metrics.update_done(manifest.kind, True, seconds)
        self.pool_metrics.swaps.labels(self.config.model, "in_place").inc()
        self._behind()
        if check is not None:
            self._checked(check)

    def failed(self, kind: str, reason: str, check: CheckResult | None = None) -> None:
        """An update the worker refused or could not take; what it serves is unchanged."""
        self.last_error = reason
        self.engine_metrics.update_done(kind, False, 0.0)
        if check is not None:
            self._checked(check)

    def status(self) -> dict[str, Any]:
        return {"model": self.config.model, "version": self.version, "head": self.sync.head, "proof": self.proof,
                "follow": self.config.follow, "last_error": self.last_error,
                "gateways": self.sync.book.describe()}

    def _checked(self, check: CheckResult) -> None:
        model = self.config.model
        self.pool_metrics.checks.labels(model, "ok" if check.ok else "failed").inc()
        self.pool_metrics.check_seconds.labels(model).observe(check.seconds)
        if not check.ok:
            self.pool_metrics.check_failures.labels(model).inc()

    def _behind(self) -> None:
        if self.version is not None and self.sync.head is not None:
            self.pool_metrics.behind.labels(self.config.model).set(max(0, self.sync.head - self.version))
        for url, standing in self.sync.book.describe().items():
            self.pool_metrics.stale_gateways.labels(self.config.model, url).set(1 if standing["state"] == "stale" else 0)

    def _refused(self, refusal: Refusal) -> None:
        self.last_error = str(refusal)
        self.pool_metrics.refusals.labels(self.config.model, refusal.reason).inc()

    # -- follow mode -----------------------------------------------------------------------------
    async def _follow(self, stop: asyncio.Event) -> None:
        """Take every new head through the server's RL routes until `stop` (see the module docstring)."""
        # vLLM's RL routes take no credential (its --api-key guards only /v1 and the like): docs/SECURITY.md.
        async with client_session(timeout_s=None) as session:
            while not stop.is_set():
                try:
                    await until_stopped(self._follow_once(session), stop)
                    self.sync.outage.succeeded()
                except (SyncError, HttpError, CodecError, OSError) as e:
                    # The server keeps what it serves (a refused update leaves it untouched): try again later.
                    self.last_error = f"follow: {type(e).__name__}: {e}"
                    await sleep_or_stop(stop, self.sync.set_error(self.last_error, logged=isinstance(e, Refused)))
                except Exception as e:  # noqa: BLE001 - the server must keep following the head whatever broke
                    log.exception("deltamesh backend: following the head failed")
                    self.last_error = f"follow: unexpected {type(e).__name__}: {e}"
                    await sleep_or_stop(stop, self.sync.set_error(self.last_error, logged=True))
                finally:
                    self._behind()

    async def _follow_once(self, session: Any) -> None:
        held = self.version
        head = await self.sync.wait_for_head(self.config.poll_wait_s, after=held)
        self._behind()
        if head is None:
            return
        if self.decodes:  # fetched ahead here; tensor-parallel ranks fetch their own shares in the update
            self._ready = (held, head, await self.fetch(head))
        server = self.config.server
        # A refused version ends vLLM's update session in the worker (it keeps what it served): the
        # update's error is this round's, and there is nothing to finish.
        await request_json(session, "POST", f"{server}/start_weight_update")
        await request_json(session, "POST", f"{server}/update_weights", body={"update_info": {"version": head}})
        await request_json(session, "POST", f"{server}/finish_weight_update", body={"weight_version": str(head)})
        await request_json(session, "POST", f"{server}/reset_prefix_cache")
        log.info("deltamesh backend: %s follows the head, now v%s", self.config.model, self.version)
