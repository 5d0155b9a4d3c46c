"""The pool side of weight sync: the steps that move a pool's weights to a gateway's head, one by one.

`WeightSync` registers the pool with its region's gateway and heartbeats its version and transfer
state. A round is: `wait_for_head` (long-poll the head of the model), `fetch_plan` (a transfer plan from
the version the directory holds), `fetch_decoded` (each step's signed manifest, verified against the
trainer keys so relays need not be trusted, and its pieces, fetched in parallel, ranged,
hash-checked and failing over to alternate gateways, then decoded once), `persist` (the decoded
versions applied to the directory atomically: it moves to the new version bit-exact or stays where
it was). A delta that does not fit what the directory holds, or weights that do not hash right, lead
to `fallback_plan`, a full snapshot. A rollout pool (mesh/pool/weights.py) calls these itself, with
its engine's update between decoding and persisting; `sync_once` and `run` are the directory-only
round and loop that `deltamesh pool sync` runs. `version` tells what the directory holds and `head`
the newest version seen at a gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Sequence

import aiohttp

from deltamesh.delta import (
    CodecError,
    DecodedVersion,
    Manifest,
    apply_to_dir,
    decode_version,
    dir_manifest,
    load_public_key,
)
from deltamesh.gateway.config import PoolSyncConfig
from deltamesh.gateway.fetch import Fetcher, FetchError
from deltamesh.gateway.sources import Source
from deltamesh.http import HttpError, bearer, client_session, request_json
from deltamesh.gateway.links import PEER_HEADER
from deltamesh.gateway.plan import Plan, PlanStep
from deltamesh.gateway.verified import Step, fetch_verified

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Pause after a failed round before the next one."""


class SyncError(Exception):
    """A transfer that could not complete (no gateway answered, or the plan's data did not verify)."""


class WeightSync:
    def __init__(self, config: PoolSyncConfig):
        self.config = config
        self.trusted_keys = [load_public_key(p) for p in config.trusted_keys]
        self.model = config.model
        self.version: int | None = None
        """The version the directory holds (None before the first sync)."""
        self.head: int | None = None
        """The newest version a gateway has announced for the model (None before the first answer)."""
        self.state = "idle"
        self.transfer: dict = {}
        self.since_full = 0
        self.last_error = ""
        self.sources = [Source(url) for url in config.gateways]
        self._session: aiohttp.ClientSession | None = None
        self._registered_at: str | None = None
        self._beat_now = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def __aenter__(self) -> "WeightSync":
        self._session = client_session(connections=2 * self.config.connections + 4, timeout_s=None)
        held = await asyncio.to_thread(dir_manifest, self.config.dir)
        if held is not None and (not self.model or held.model_id == self.model):
            self.model, self.version = held.model_id, held.version
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Register, heartbeat and keep the directory at the head until `stop` is set."""
        stop = stop or asyncio.Event()
        while not self.model and not stop.is_set():
            try:
                self.model = await self._pick_model()
            except (SyncError, HttpError) as e:
                self.set_error(str(e))
                await sleep_or_stop(stop, RETRY_S)
        heartbeats = asyncio.create_task(self.heartbeat_loop(stop))
        try:
            while not stop.is_set():
                try:
                    await until_stopped(self.sync_once(self.config.poll_wait_s), stop)
                except (SyncError, HttpError, CodecError, OSError) as e:
                    # The directory is untouched (apply is atomic); try again from where it is.
                    self.set_error(f"{type(e).__name__}: {e}")
                    await sleep_or_stop(stop, RETRY_S)
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats

    # -- the steps of a round --------------------------------------------------------------------------
    async def sync_once(self, wait_s: float = 0.0) -> bool:
        """The directory-only round: wait (up to `wait_s`) for a head newer than the directory, fetch,
        decode and persist it; True if the directory moved."""
        head = await self.wait_for_head(wait_s)
        if head is None:
            return False
        plan = await self.fetch_plan(head)
        try:
            await self.persist(await self.fetch_decoded(plan))
        except CodecError as e:
            plan = await self.fallback_plan(plan, e)
            await self.persist(await self.fetch_decoded(plan))
        return True

    async def wait_for_head(self, wait_s: float = 0.0) -> int | None:
        """Wait (up to `wait_s`) until a gateway announces a version newer than the directory's; that
        version, or None if none came."""
        if not self.model:
            self.model = await self._pick_model()
        answer = await self._ask("GET", f"/v1/models/{self.model}/head",
                                 params={"after": self.version, "wait": wait_s}, timeout=wait_s)
        head = answer["head"]
        if head is not None:
            self.head = max(head, self.head if self.head is not None else head)
        if head is None or (self.version is not None and head <= self.version):
            return None
        return head

    async def fetch_plan(self, to: int | None = None, *, full: bool = False) -> Plan:
        self.state = "planning"
        params = {"from": None if full else self.version, "to": to}
        if self.config.full_every:
            params.update(since_full=self.since_full, full_every=self.config.full_every)
        plan = Plan.from_json(await self._ask("GET", f"/v1/models/{self.model}/plan", params=params))
        log.info("pool %s: plan v%s -> v%d: %s, %d steps, %d bytes", self.config.name, plan.from_version,
                 plan.to_version, plan.reason, len(plan.steps), plan.payload_bytes)
        return plan

    async def fallback_plan(self, failed: Plan, error: CodecError) -> Plan:
        """The full snapshot to take after `failed` did not verify or apply; raises SyncError when
        `failed` was a first pull already (nothing smaller to fall back to)."""
        if failed.from_version is None:
            raise SyncError(f"full snapshot v{failed.to_version} did not verify: {error}") from error
        log.warning("pool %s: %s; falling back to a full snapshot", self.config.name, error)
        return await self.fetch_plan(failed.to_version, full=True)

    async def fetch_decoded(self, plan: Plan) -> list[DecodedVersion]:
        """Every step of `plan`, fetched and verified, then decoded once (off the event loop)."""
        self.state = "fetching"
        self.transfer = {"from": plan.from_version, "to": plan.to_version, "reason": plan.reason,
                         "bytes_total": plan.payload_bytes, "bytes_done": 0, "started": time.time()}
        versions = []
        for step in plan.steps:
            manifest, pieces = await self.fetch_step(step)
            versions.append(await asyncio.to_thread(decode_version, manifest, pieces))
        self.state = "applying"
        return versions

    async def fetch_step(self, step: PlanStep) -> Step:
        """The verified manifest and pieces of one plan step."""
        def progress(n: int) -> None:
            self.transfer["bytes_done"] = self.transfer.get("bytes_done", 0) + n

        try:
            return await fetch_verified(self._fetcher(), self.model, step, self.trusted_keys,
                                        self.config.connections, progress)
        except FetchError as e:
            raise SyncError(str(e)) from e

    async def persist(self, versions: Sequence[DecodedVersion]) -> Manifest:
        """Apply decoded versions to the directory atomically; returns the manifest it now holds."""
        if not versions:
            raise SyncError("nothing to apply")
        self.state = "applying"
        final = await asyncio.to_thread(apply_to_dir, self.config.dir, versions)
        # Deltas applied in a row since the last full snapshot, for the periodic full sync.
        self.since_full = len(versions) - 1 if versions[0].kind == "full" else self.since_full + len(versions)
        self.version = final.version
        self.state, self.transfer, self.last_error = "idle", {}, ""
        self._beat_now.set()
        log.info("pool %s: now at %s v%d", self.config.name, final.model_id, final.version)
        return final

    # -- talking to gateways ------------------------------------------------------------------------------
    def _fetcher(self) -> Fetcher:
        return Fetcher(self._session, self.sources, f"pool/{self.config.name}",
                       stall_timeout_s=self.config.stall_timeout_s, give_up_s=self.config.give_up_s,
                       penalty_s=min(self.config.stall_timeout_s, 5.0))

    async def _ask(self, method: str, path: str, *, params: dict | None = None, body=None,
                   timeout: float = 0.0) -> dict:
        """A JSON call to the first gateway that answers it, in order of preference."""
        errors = []
        now = time.monotonic()
        ordered = [s for s in self.sources if s.healthy(now)] + [s for s in self.sources if not s.healthy(now)]
        for source in ordered:
            try:
                return await request_json(self._session, method, f"{source.url}{path}", params=params, body=body,
                                          headers={PEER_HEADER: f"pool/{self.config.name}"},
                                          timeout_s=timeout + self.config.stall_timeout_s)
            except HttpError as e:
                errors.append(str(e))
                if e.status == 0 or e.status >= 500:
                    source.bad_until = time.monotonic() + min(self.config.stall_timeout_s, 5.0)
                elif e.status != 404:
                    raise
        raise SyncError("no gateway answered: " + "; ".join(errors))

    async def _pick_model(self) -> str:
        models = (await self._ask("GET", "/v1/models"))["models"]
        if len(models) != 1:
            raise SyncError(f"gateway serves {len(models)} models {sorted(models)}; name one")
        return next(iter(models))

    async def register(self) -> None:
        body = {"name": self.config.name, "model": self.model, "gpus": self.config.gpus,
                "engine": self.config.engine, "tier": self.config.tier, "endpoint": self.config.endpoint,
                "version": self.version}
        last: HttpError | None = None
        for source in self.sources:
            try:
                await request_json(self._session, "POST", f"{source.url}/v1/pools", body=body,
                                   headers=bearer(self.config.token), timeout_s=self.config.stall_timeout_s)
                self._registered_at = source.url
                return
            except HttpError as e:
                last = e
        raise SyncError(f"pool {self.config.name} could not register: {last}")

    async def heartbeat(self) -> None:
        if self._registered_at is None:
            await self.register()
        body = {"version": self.version, "state": self.state, "transfer": self.transfer}
        try:
            answer = await request_json(self._session, "POST",
                                        f"{self._registered_at}/v1/pools/{self.config.name}/heartbeat",
                                        body=body, headers=bearer(self.config.token),
                                        timeout_s=self.config.stall_timeout_s)
            if answer["head"] is not None:
                self.head = max(answer["head"], self.head if self.head is not None else answer["head"])
        except HttpError as e:
            self._registered_at = None  # re-register next time, there or at an alternate
            if e.status == 401:
                raise

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        """Heartbeat until `stop`: every `heartbeat_s`, and at once after a new version is persisted."""
        while not stop.is_set():
            self._beat_now.clear()
            try:
                await self.heartbeat()
            except (HttpError, SyncError) as e:
                log.warning("pool %s: heartbeat: %s", self.config.name, e)
            # The next beat comes after the period, or at once when a new version has been applied.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.config.heartbeat_s)

    def set_error(self, reason: str) -> None:
        self.state, self.last_error = "error", reason
        log.warning("pool %s: %s", self.config.name, reason)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def until_stopped(coro: Awaitable, stop: asyncio.Event) -> None:
    """Run `coro`, cancelling it if `stop` is set first (a long poll must not delay a shutdown)."""
    work = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.done() and not work.cancelled():
        work.result()

