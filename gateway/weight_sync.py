"""The pool side of weight sync: follow a gateway's head and keep a safetensors directory on it.

`WeightSync` registers the pool with its region's gateway, long-polls the head of its model, asks
for a transfer plan from the version its directory holds, fetches each step's signed manifest
(verified against the trainer keys, so relays need not be trusted) and pieces (parallel, ranged,
hash-checked, failing over to alternate gateways), and applies the steps atomically to the
directory, which either moves to the new version bit-exact or stays where it was. A delta that does
not fit what the directory holds, or weights that do not hash right, make it fall back to a full
snapshot. Heartbeats report its version and transfer state all along.

The steps are composable for pools that hot-swap weights in place: `fetch_plan()` ->
`fetch_step(step)` (or `fetch_plan_steps(plan)`) -> `apply(steps)`; `on_fetched` is handed each
plan's verified steps before they are written to the directory (an engine that swaps in place takes
them there, so it need not wait for the disk), `on_applied` is called after each new version lands in
the directory, `version` tells what the directory holds and `head` the newest version seen at a gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import Awaitable, Callable, Sequence

import aiohttp

from deltamesh.delta import CodecError, CorruptError, Manifest, apply_to_dir, dir_manifest, load_manifest, load_public_key
from deltamesh.gateway.config import PoolSyncConfig
from deltamesh.gateway.fetch import Fetcher, FetchError
from deltamesh.gateway.sources import Source
from deltamesh.http import HttpError, bearer, client_session, request_json
from deltamesh.gateway.links import PEER_HEADER
from deltamesh.gateway.plan import Plan, PlanStep

log = logging.getLogger(__name__)

Step = tuple[Manifest, list[bytes]]
AppliedHook = Callable[[Manifest], Awaitable[None] | None]
FetchedHook = Callable[[Sequence[Step]], Awaitable[None] | None]


class SyncError(Exception):
    """A transfer that could not complete (no gateway answered, or the plan's data did not verify)."""


class WeightSync:
    def __init__(self, config: PoolSyncConfig, *, on_applied: AppliedHook | None = None,
                 on_progress: Callable[[int], None] | None = None, on_fetched: FetchedHook | None = None):
        self.config = config
        self.on_applied = on_applied
        self.on_fetched = on_fetched
        self.on_progress = on_progress
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
                self._set_error(str(e))
                await _sleep_or_stop(stop, 1.0)
        heartbeats = asyncio.create_task(self._heartbeat_loop(stop))
        try:
            while not stop.is_set():
                try:
                    await _unless_stopped(self.sync_once(self.config.poll_wait_s), stop)
                except (SyncError, HttpError, CodecError, OSError) as e:
                    # The directory is untouched (apply is atomic); try again from where it is.
                    self._set_error(f"{type(e).__name__}: {e}")
                    await _sleep_or_stop(stop, 1.0)
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats

    # -- one round -------------------------------------------------------------------------------------
    async def sync_once(self, wait_s: float = 0.0) -> bool:
        """Wait (up to `wait_s`) for a head newer than ours and move to it; True if the directory moved."""
        if not self.model:
            self.model = await self._pick_model()
        answer = await self._ask("GET", f"/v1/models/{self.model}/head",
                                 params={"after": self.version, "wait": wait_s}, timeout=wait_s)
        head = answer["head"]
        if head is not None:
            self.head = max(head, self.head if self.head is not None else head)
        if head is None or (self.version is not None and head <= self.version):
            return False
        plan = await self.fetch_plan(head)
        try:
            steps = await self.fetch_plan_steps(plan)
            await self.apply(steps)
        except CodecError as e:
            if plan.from_version is None:
                raise SyncError(f"full snapshot v{plan.to_version} did not verify: {e}") from e
            log.warning("pool %s: %s; falling back to a full snapshot", self.config.name, e)
            plan = await self.fetch_plan(head, full=True)
            await self.apply(await self.fetch_plan_steps(plan))
        return True

    async def fetch_plan(self, to: int | None = None, *, full: bool = False) -> Plan:
        self.state = "planning"
        params = {"from": None if full else self.version, "to": to}
        if self.config.full_every:
            params.update(since_full=self.since_full, full_every=self.config.full_every)
        plan = Plan.from_json(await self._ask("GET", f"/v1/models/{self.model}/plan", params=params))
        log.info("pool %s: plan v%s -> v%d: %s, %d steps, %d bytes", self.config.name, plan.from_version,
                 plan.to_version, plan.reason, len(plan.steps), plan.payload_bytes)
        return plan

    async def fetch_plan_steps(self, plan: Plan) -> list[Step]:
        self.state = "fetching"
        self.transfer = {"from": plan.from_version, "to": plan.to_version, "reason": plan.reason,
                         "bytes_total": plan.payload_bytes, "bytes_done": 0, "started": time.time()}
        return [await self.fetch_step(step) for step in plan.steps]

    async def fetch_step(self, step: PlanStep) -> Step:
        """The verified manifest and pieces of one plan step."""
        fetcher = self._fetcher()

        async def accept(raw: bytes) -> Manifest:
            m = load_manifest(raw, self.trusted_keys)
            if (m.model_id, m.version, m.kind) != (self.model, step.version, step.kind):
                raise CorruptError(f"gateway sent {m.model_id} v{m.version} {m.kind} for step v{step.version} {step.kind}")
            return m

        try:
            manifest = await fetcher.manifest_bytes(self.model, step.version, step.kind, accept,
                                                    prefetch=self.config.connections)
            pieces: list[bytes | None] = [None] * len(manifest.pieces)

            async def keep(index: int, data: bytes) -> None:
                pieces[index] = data
                self.transfer["bytes_done"] = self.transfer.get("bytes_done", 0) + len(data)
                if self.on_progress is not None:
                    self.on_progress(len(data))

            await fetcher.pieces(manifest, range(len(pieces)), self.config.connections, keep)
        except FetchError as e:
            raise SyncError(str(e)) from e
        return manifest, pieces

    async def apply(self, steps: Sequence[Step]) -> Manifest:
        """Apply fetched steps to the directory atomically, then call the `on_applied` hook."""
        if not steps:
            raise SyncError("nothing to apply")
        self.state = "applying"
        if self.on_fetched is not None:
            result = self.on_fetched(steps)
            if inspect.isawaitable(result):
                await result
        await asyncio.to_thread(apply_to_dir, self.config.dir, steps)
        final = steps[-1][0]
        # Deltas applied in a row since the last full snapshot, for the periodic full sync.
        self.since_full = len(steps) - 1 if steps[0][0].kind == "full" else self.since_full + len(steps)
        self.version = final.version
        self.state, self.transfer, self.last_error = "idle", {}, ""
        self._beat_now.set()
        log.info("pool %s: now at %s v%d", self.config.name, final.model_id, final.version)
        if self.on_applied is not None:
            result = self.on_applied(final)
            if inspect.isawaitable(result):
                await result
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

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._beat_now.clear()
            try:
                await self.heartbeat()
            except (HttpError, SyncError) as e:
                log.warning("pool %s: heartbeat: %s", self.config.name, e)
            # The next beat comes after the period, or at once when a new version has been applied.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.config.heartbeat_s)

    def _set_error(self, reason: str) -> None:
        self.state, self.last_error = "error", reason
        log.warning("pool %s: %s", self.config.name, reason)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _unless_stopped(coro: Awaitable, stop: asyncio.Event) -> None:
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

