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
the newest head its gateways in good standing announce (each one's is in `book`).

Every request carries the pool's token (or its client certificate) over TLS as `tls` says. Whatever a
gateway's plan says, the pool never moves below the version it holds nor takes another weights hash
for a version it verified (`deltamesh.mesh.pool.head_check`), and it checks each gateway's freshness by
the trainer's signed head statement and its other gateways' heads (`deltamesh.mesh.pool.head_watch`).
A refused or stale gateway is logged once, counted (`book`, `on_refusal`) and asked last for a while,
so the next round goes to another. Credentials every gateway refuses end the loop with one
CredentialsError (`deltamesh.gateway.fetch.errors`); a clean stop deregisters the pool from the gateway
it registered with (`deltamesh.mesh.pool.presence`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Sequence

import aiohttp

from deltamesh.delta import (
    CodecError,
    DecodedVersion,
    HeldWeights,
    Manifest,
    apply_to_dir,
    decode_version,
    dir_manifest,
    load_public_key,
)
from deltamesh.gateway.fetch.errors import CredentialsError, Refused, SyncError
from deltamesh.gateway.fetch.fetcher import Fetcher, FetchError, Inline
from deltamesh.gateway.fetch.parts import EarlyParts
from deltamesh.gateway.fetch.plan_steps import Step, fetch_verified, inline_envelopes
from deltamesh.gateway.fetch.sources import Source, ask_first
from deltamesh.gateway.plan import Plan, PlanStep
from deltamesh.gateway_client import MODELS_PATH, PEER_HEADER, model_path
from deltamesh.http import HttpError, bearer, client_session
from deltamesh.mesh.pool.head_check import GatewayBook, Refusal, Rejected, VersionGuard
from deltamesh.mesh.pool.head_watch import HeadWatch, valid_head
from deltamesh.mesh.pool.membership import Membership
from deltamesh.mesh.pool.presence import Presence
from deltamesh.mesh.pool.retry_log import Outage
from deltamesh.mesh.pool.supersede import fetch_superseding
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.signals import sleep_or_stop, until_stopped

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Longest pause before a round when the engine must catch up; failed rounds back off (`outage`)."""


class WeightSync(Membership):
    def __init__(self, config: PoolSyncConfig, *, on_refusal: Callable[[Refusal], None] | None = None,
                 hold_weights: bool = False):
        self.config = config
        self._held = HeldWeights(adopt=True) if hold_weights else None  # `pool sync`'s: no engine shares them
        self.trusted_keys = [load_public_key(p) for p in config.trusted_keys]
        self.model = config.model
        self.version: int | None = None
        """The version the directory holds (None before the first sync)."""
        self.state = "idle"
        self.transfer: dict = {}
        self._fetched: dict[int, dict] = {}  # the transfers of fetched versions not yet persisted, by version
        self.since_full = 0
        self.last_error = ""
        self.sources = [Source(url) for url in config.gateways]
        self.guard = VersionGuard()
        """The weights hash of every version this pool verified: no rollback, no equivocation."""
        self.book = GatewayBook(self.sources)
        """Each gateway's standing (ok, stale, refused) and the refusals by reason."""
        self.watch = HeadWatch(config, self.sources, self.trusted_keys, self.guard, self.book, on_refusal)
        """Each round's freshness checks; it books refusals, and tells `on_refusal` of each (and of each
        gateway newly found stale: a pool's metrics count them)."""
        self._peer = {PEER_HEADER: f"pool/{config.name}"}
        self._round: Source | None = None
        """The gateway whose head this round follows: its plan is asked for first."""
        self._step: tuple[int, str] | None = None
        """The plan step being fetched (version, kind), for a stall's report of what no gateway serves."""
        self._opening: asyncio.Future | None = None
        self._parts_due = False
        self._parts: EarlyParts | None = None
        """A cold pool's parts of the newest full version, until its first plan step takes them."""
        self._checking: asyncio.Future | None = None
        """The freshness checks of the round's head answer, while they overlap the plan request."""
        self._inline: dict[tuple[int, str], Inline] = {}
        """The head's signed envelopes, per (version, kind), that the last head answer carried (a gateway
        of an earlier release sends none): verified like fetched ones, they spare a manifest request."""
        self.presence = Presence(config, self.sources)
        """The pool's entry in a gateway's registry."""
        self._session: aiohttp.ClientSession | None = None
        self._beat_now = asyncio.Event()
        self.outage = Outage(f"pool {config.name}: sync")
        """Failed rounds: the backoff before the next, and one log line per outage, not per try."""
        self._beats = Outage(f"pool {config.name}: heartbeat", retrying=f"every {config.heartbeat_s:g} s")
        self.on_progress: Callable[[dict], None] | None = None
        """Told `transfer` as it starts, as each verified piece arrives and, with `applied` set to the
        version, once the directory holds it: the terminal progress of `deltamesh pool sync` and `pool
        run` (`deltamesh.mesh.cli.progress`)."""
        self.on_stage: Callable[[int, str], None] | None = None
        """Told (version, "fetched") once every piece of a plan step is in and checked, and (version,
        "verified") once it is decoded: a rollout pool's version timeline (mesh/pool/timeline.py)."""

    @property
    def head(self) -> int | None:
        """The newest head the pool's gateways in good standing announced at their last head answers (None
        before the first): what its status and metrics show, beside each gateway's own (`book`)."""
        return self.book.newest_head()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def __aenter__(self) -> "WeightSync":
        # The token rides on every request (the config refused it for plain http:// off loopback).
        self._session = client_session(connections=2 * self.config.connections + 4, timeout_s=None,
                                       tls=self.config.tls,
                                       headers=bearer(self.config.token) if self.config.token else None)
        held = await asyncio.to_thread(dir_manifest, self.config.dir)
        if held is not None and (not self.model or held.model_id == self.model):
            self.model, self.version = held.model_id, held.version
            self.guard.hold(held.version, held.weights_hash)
        # Cold: the newest full's parts go with the first head poll, not here (a pool may only be showing credentials).
        self._parts_due = self.version is None and bool(self.model)
        if not self._parts_due:
            # The parallel requests find their connections up (handshakes done beside registration
            # and the first head poll), as a relay's do (`Fetcher.open_connections`).
            self._opening = asyncio.ensure_future(self._fetcher().open_connections(self.config.connections))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._parts is not None:
            await self._parts.close()
        for task in (self._checking, self._opening):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Register, heartbeat and keep the directory at the head until `stop` is set, then deregister.
        Raises CredentialsError when every gateway refuses the pool's credentials."""
        stop = stop or asyncio.Event()
        while not self.model and not stop.is_set():
            try:
                self.model = await self._pick_model()
            except CredentialsError:
                raise
            except (SyncError, HttpError) as e:
                await sleep_or_stop(stop, self.set_error(str(e)))
        await self.register_once()
        heartbeats = asyncio.create_task(self.heartbeat_loop(stop))
        try:
            while not stop.is_set():
                try:
                    await until_stopped(self.sync_once(self.config.poll_wait_s), stop)
                    self.outage.succeeded()
                except CredentialsError:
                    raise
                except (SyncError, HttpError, CodecError, OSError) as e:
                    # The directory is untouched (apply is atomic); try again from where it is.
                    await sleep_or_stop(stop, self.set_error(f"{type(e).__name__}: {e}", logged=isinstance(e, Refused)))
        finally:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats
            await self.deregister()

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

    async def wait_for_head(self, wait_s: float = 0.0, *, after: int | None = None) -> int | None:
        """Wait (up to `wait_s`) until a gateway announces a version newer than `after` (by default the
        directory's); that version, or None if none came. Checks the answering gateway's head statement
        and freshness on the way (Refused for a forged statement; a stale gateway is flagged, and asked
        last next time)."""
        after = self.version if after is None else after
        if not self.model:
            self.model = await self._pick_model()
        await self._checked()  # a round whose plan was never asked for
        if self._parts_due:
            # On every connection beside the head poll, plan and manifest (`deltamesh.gateway.fetch.parts`).
            self._parts_due = False
            self._parts = self._fetcher().ask_parts(self.model, "full", self.config.connections)
        source, answer = await self._ask("GET", model_path(self.model, "head"),
                                         params={"after": after, "wait": wait_s, "manifests": 1}, timeout=wait_s)
        head = answer.get("head", "?") if isinstance(answer, dict) else "?"
        if not valid_head(head):
            raise SyncError(f"gateway {source.url} answered a malformed head {head!r:.40}")
        self._round = source
        self._inline = inline_envelopes(source, head, answer.get("manifests"))
        self.book.saw_head(source, head)
        # With a new head, the checks run beside the plan request (no round trip added to a version's
        # way); `fetch_plan` takes their verdict before it accepts the plan.
        self._checking = asyncio.ensure_future(
            self.watch.check(self._session, source, self.model, head, self.version, self._peer))
        if head is None or (after is not None and head <= after):
            await self._checked()
            return None
        return head

    async def _checked(self) -> None:
        """Wait for the checks of the last head answer; Refused if its gateway's statement was refused."""
        checking, self._checking = self._checking, None
        if checking is None:
            return
        try:
            await checking
        except Rejected as e:
            raise Refused(str(self._refuse(self._round, e))) from None

    async def fetch_plan(self, to: int | None = None, *, full: bool = False, base: int | None = None) -> Plan:
        """A transfer plan from the gateway this round follows (another if it does not answer), from
        `base` (by default the version the directory holds); Refused when it would leave the pool below
        the version it holds."""
        self.state = "planning"
        params = {"from": None if full else (self.version if base is None else base), "to": to}
        if self.config.full_after_deltas:  # the plan's query parameter keeps its wire name
            params.update(since_full=self.since_full, full_every=self.config.full_after_deltas)
        source, answer = await self._ask("GET", model_path(self.model, "plan"), params=params, prefer=self._round)
        await self._checked()
        try:
            plan = Plan.from_json(answer)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SyncError(f"gateway {source.url} answered a malformed plan: {type(e).__name__}: {e}") from None
        try:
            self.guard.check_plan(plan)
        except Rejected as e:
            raise Refused(str(self._refuse(source, e))) from None
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
        """Every step of `plan`, fetched and verified, then decoded once (off the event loop); a step that
        no gateway serves may be left for a newer plan from the same base (`deltamesh.mesh.pool.supersede`)."""
        return await fetch_superseding(
            plan, self._fetch_steps, stall_s=self.config.stall_timeout_s, who=f"pool {self.config.name}",
            progress=lambda: self.transfer.get("bytes_done", 0), stuck_step=lambda: self._step,
            replan=lambda old: self.fetch_plan(None, full=old.from_version is None, base=old.from_version))

    async def _fetch_steps(self, plan: Plan) -> list[DecodedVersion]:
        self.state = "fetching"
        self.transfer = {"from": plan.from_version, "to": plan.to_version, "reason": plan.reason,
                         "bytes_total": plan.payload_bytes, "bytes_done": 0, "started": time.time()}
        self._progressed()
        versions = []
        for i, step in enumerate(plan.steps):
            self._step = (step.version, step.kind)
            manifest, pieces = await self.fetch_step(step, final=i == len(plan.steps) - 1)
            self._staged(step.version, "fetched")
            versions.append(await asyncio.to_thread(decode_version, manifest, pieces))
            self._staged(step.version, "verified")
        self._step = None
        self.state = "applying"
        self._fetched[plan.to_version] = self.transfer
        return versions

    async def fetch_step(self, step: PlanStep, *, final: bool = True) -> Step:
        """The verified manifest and pieces of one plan step; the `final` one (the version the pool moves
        to) must also carry the weights hash the pool verified for its version, if it knows one."""
        def progress(n: int) -> None:
            self.transfer["bytes_done"] = self.transfer.get("bytes_done", 0) + n
            self._progressed()

        parts, self._parts = self._parts, None  # for the first step only (a cold pool's full version)
        try:
            # A manifest the guard refuses is one more the fetcher cannot accept: it books the refusal
            # (`on_rejected`) and asks another gateway for the same step.
            return await fetch_verified(self._fetcher(), self.model, step, self.trusted_keys,
                                        self.config.connections, progress,
                                        check=self.guard.check_manifest if final else None,
                                        inline=self._inline.get((step.version, step.kind)), parts=parts)
        except FetchError as e:
            raise SyncError(str(e)) from e

    async def persist(self, versions: Sequence[DecodedVersion]) -> Manifest:
        """Apply decoded versions to the directory atomically; returns the manifest it now holds."""
        if not versions:
            raise SyncError("nothing to apply")
        self.state = "applying"
        final = await asyncio.to_thread(apply_to_dir, self.config.dir, versions, held=self._held)
        # Deltas applied in a row since the last full snapshot, for the periodic full sync.
        self.since_full = len(versions) - 1 if versions[0].kind == "full" else self.since_full + len(versions)
        self.version = final.version
        self.guard.hold(final.version, final.weights_hash)
        # A pool writes its directory behind its engine (mesh/pool/dir_writer.py): the next version's
        # transfer may be under way, and is left as it is.
        done = self._fetched.pop(final.version, None)
        self._fetched = {v: t for v, t in self._fetched.items() if v > final.version}
        if done and self.on_progress is not None:
            self.on_progress({**done, "applied": final.version})
        if self.transfer.get("to", final.version) <= final.version:  # no newer transfer under way
            self.state, self.transfer = "idle", {}
        self.last_error = ""
        self._beat_now.set()
        log.info("pool %s: now at %s v%d", self.config.name, final.model_id, final.version)
        return final

    def _staged(self, version: int, stage: str) -> None:
        if self.on_stage is not None:
            self.on_stage(version, stage)

    def _progressed(self, **extra: Any) -> None:
        if self.on_progress is not None and self.transfer:
            self.on_progress({**self.transfer, **extra})

    # -- talking to gateways ------------------------------------------------------------------------------
    def _fetcher(self) -> Fetcher:
        return Fetcher(self._session, self.sources, f"pool/{self.config.name}",
                       stall_timeout_s=self.config.stall_timeout_s, give_up_s=self.config.give_up_s,
                       penalty_s=min(self.config.stall_timeout_s, 5.0), on_rejected=self._manifest_rejected)

    def _manifest_rejected(self, source: Source, key: tuple[str, int, str], error: CodecError) -> None:
        if isinstance(error, Rejected):  # a bad signature or a mislabelled manifest the fetcher handles alone
            self._refuse(source, error)

    def _refuse(self, source: Source, rejected: Rejected) -> Refusal:
        refusal = self.watch.refuse(source, rejected)
        self.last_error = str(refusal)
        return refusal

    async def _ask(self, method: str, path: str, *, params: dict | None = None, body=None,
                   timeout: float = 0.0, prefer: Source | None = None) -> tuple[Source, Any]:
        return await ask_first(self._session, self.sources, method, path, params=params, body=body,
                               headers=self._peer, timeout_s=timeout, stall_timeout_s=self.config.stall_timeout_s,
                               prefer=prefer, pool=self.config.name)

    async def _pick_model(self) -> str:
        _, answer = await self._ask("GET", MODELS_PATH)
        models = answer["models"]
        if len(models) != 1:
            raise SyncError(f"gateway serves {len(models)} models {sorted(models)}; name one")
        return next(iter(models))

    async def authenticate(self) -> None:
        """Name the model (the gateway's only one, if none was given) and register: a token refused, or
        bound to another pool's name, fails here (CredentialsError), before anything is downloaded."""
        if not self.model:
            self.model = await self._pick_model()
        await self.heartbeat()

    def set_error(self, reason: str, *, logged: bool = False) -> float:
        """Report a failed round (in heartbeats and status), logged once per outage (`logged`: its line
        is written already); returns the backoff before the next round. `outage.succeeded()` ends it."""
        self.state, self.last_error = "error", reason
        return self.outage.failed(reason, quiet=logged)

