"""The dataflow broker itself, without HTTP: tasks out to pools, trajectories in, batches out to trainers.

`Broker` owns the working state in memory (one `ModelBuffer` per model_id, the task scheduler, the
curator, the pools seen, the balance windows) and changes it only after the store has committed the
matching change, so a restart (`start` loads the store) finds exactly what was acknowledged. Store
work runs on the `StoreRunner`'s thread; this class runs on the event loop and needs no locks beyond
one for lease issuing and one per model for taking batches. Batches go out through `BatchDelivery`
(delivery.py): at least once, each held for the trainer's acknowledgement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from deltamesh.broker_client import HeldBack
from deltamesh.data import DataFormatError, Trajectory
from deltamesh.mesh.broker.balance import PoolRegistry, balance_report
from deltamesh.mesh.broker.buffers import ModelBuffer
from deltamesh.mesh.broker.config import MODEL_ID, BrokerConfig
from deltamesh.mesh.broker.curators import make_curator
from deltamesh.mesh.broker.delivery import AckResult, BatchDelivery
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.policies import filter_chain
from deltamesh.mesh.broker.runner import StoreRunner
from deltamesh.mesh.broker.store_interface import BrokerStore, IngestResult, LeaseNotHeld, StoreUnavailable
from deltamesh.mesh.broker.tasks import TaskScheduler, read_dataset

log = logging.getLogger(__name__)


class UnknownModel(LookupError):
    """A model_id the broker does not serve. HTTP 404."""


class VersionConflict(ValueError):
    """A trainer reported a version older than the one it reported before. HTTP 409."""


class VersionAhead(ValueError):
    """A trajectory claims a policy version above the newest its trainer reported, beyond the margin
    (`policies.max_version_ahead`): no pool can hold such a version. HTTP 409."""


class Broker:
    def __init__(self, config: BrokerConfig, open_store: Callable[[], BrokerStore], *,
                 metrics: BrokerMetrics | None = None):
        self.config = config
        self.metrics = metrics or BrokerMetrics()
        self.curator = make_curator(config.tasks.curator)
        self.runner = StoreRunner(open_store, filter_chain(config.policies.filters),
                                  max_commit=config.max_commit_trajectories, on_ingested=self._ingested,
                                  on_commit=self.metrics.commits.inc)
        self.delivery = BatchDelivery(config, self.runner, self.metrics, self._refresh_gauges)
        self.models: dict[str, ModelBuffer] = {}
        self.pools = PoolRegistry(config.balance.pool_ttl_s)
        self.scheduler: TaskScheduler | None = None
        self._lease_lock = asyncio.Lock()
        self._expiry: asyncio.Task[None] | None = None

    @property
    def store(self) -> BrokerStore:
        assert self.runner.store is not None, "Broker.start() first"
        return self.runner.store

    async def start(self) -> None:
        """Open the store and rebuild memory from it; import the dataset on first start."""
        await self.runner.start()
        snapshot = await self.runner.call(self.store.load)
        if not snapshot.task_ids and self.config.tasks.dataset:
            tasks = await asyncio.to_thread(read_dataset, self.config.tasks.dataset)
            await self.runner.call(self.store.import_tasks, tasks)
            snapshot.task_ids = [t.task_id for t in tasks]
            log.info("imported %d tasks from %s", len(tasks), self.config.tasks.dataset)
        elif self.config.tasks.dataset:
            log.info("the store already holds %d tasks; %s is not read again", len(snapshot.task_ids),
                     self.config.tasks.dataset)
        for model_id in self.config.models:
            if model_id not in snapshot.models:
                await self.runner.call(self.store.set_model_version, model_id, 0)
                snapshot.models[model_id] = 0
        for model_id, version in snapshot.models.items():
            self._buffer(model_id, version)
        for g in snapshot.fresh:
            self.models[g.model_id].add_fresh([g])
        replay = [g for g in snapshot.replay if g.model_id in self.models]
        for buf in self.models.values():
            buf.add_replay(g for g in replay if g.model_id == buf.model_id)
            evicted = buf.replay_overflow([], [], self.delivery.replay_capacity)
            if evicted:  # capacity shrank, or replay was switched off, since the last run
                await self.runner.call(self.store.drop_groups, [(g.key, "retired") for g in evicted])
                buf.remove_replay(evicted)
        for delivery in snapshot.deliveries:
            if delivery.model_id in self.models:
                self.delivery.restore(self.models[delivery.model_id], delivery)
        for g in snapshot.history:
            self.curator.observe(g)
        self.scheduler = TaskScheduler(self.config.tasks, self.curator, snapshot)
        self._expiry = asyncio.create_task(self._expire_forever(), name="broker-lease-expiry")
        self._refresh_gauges()
        log.info("broker ready: models %s, %d fresh groups, %d leases, %d unacknowledged batches restored",
                 sorted(self.models), len(snapshot.fresh), len(snapshot.leases), len(snapshot.deliveries))

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        await self.runner.close()

    def _buffer(self, model_id: str, version: int) -> ModelBuffer:
        buf = self.models.get(model_id)
        if buf is None:
            buf = self.models[model_id] = ModelBuffer(model_id, version, self.config.balance.window_steps)
        return buf

    def model(self, model_id: str) -> ModelBuffer:
        buf = self.models.get(model_id)
        if buf is None:
            raise UnknownModel(f"unknown model_id {model_id!r}; known: {sorted(self.models)}")
        return buf

    # ---- trajectories in ------------------------------------------------------------------------------

    async def submit(self, trajectories: Sequence[Trajectory]) -> IngestResult:
        """Store a submission durably (all or nothing); returns after the commit. VersionAhead for a
        trajectory claiming a version no pool can hold yet; LeaseNotHeld (from the store) for one
        submitted for another pool's lease."""
        ahead = self.config.policies.max_version_ahead
        for t in trajectories:
            buf = self.model(t.model_id)
            if t.max_version > buf.version + ahead:
                self.metrics.refused.labels(t.model_id, "version_ahead").inc()
                raise VersionAhead(f"trajectory {t.id!r:.80} claims policy version {t.max_version} of "
                                   f"{t.model_id!r}, whose trainer is at v{buf.version} (at most "
                                   f"{ahead} ahead is taken: policies.max_version_ahead)")
        try:
            return await self.runner.ingest(trajectories)
        except LeaseNotHeld:
            for model_id in dict.fromkeys(t.model_id for t in trajectories):
                self.metrics.refused.labels(model_id, "lease_not_held").inc()
            raise

    def _ingested(self, result: IngestResult) -> None:
        m = self.metrics
        m.duplicates.inc(result.duplicates)
        for model_id, n in result.accepted_by_model.items():
            self.models[model_id].balance.produced += n
            m.ingested.labels(model_id).inc(n)
        for g in result.completed:
            m.groups.labels(g.model_id, g.reason or "kept").inc()
            self.curator.observe(g)
            if g.state == "fresh":
                self.models[g.model_id].add_fresh([g])
        if self.scheduler is not None:
            self.scheduler.mark_done(result.done_leases)
        self._refresh_gauges()

    # ---- tasks out ------------------------------------------------------------------------------------

    async def lease(self, pool: str, region: str, gpus: int, max_tasks: int,
                    holder: str | None = None, served: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
        """Lease up to `max_tasks` tasks to `pool` (at most `tasks.max_lease_batch`); each lease's id is
        the group id to submit under. `holder` (default `pool`): the token's name, whose active leases
        count towards `tasks.max_inflight_per_pool`. `served`: the version of each model the pool
        generates with; HeldBack if one is beyond `policies.max_staleness` of its trainer's
        training_version (its samples would only be dropped as stale)."""
        assert self.scheduler is not None
        now = time.time()
        self.pools.seen(pool, region, gpus, now)
        async with self._lease_lock:
            model_ids = self.config.tasks.model_ids or sorted(self.models)
            self._check_served(model_ids, served or {})
            max_tasks = min(max_tasks, self._lease_room(model_ids))
            if max_tasks < 1:
                return []
            plan = self.scheduler.plan(pool, region, max_tasks, now, model_ids, holder)
            if not plan.new and plan.cursor == self.scheduler.cursor:
                return []
            tasks = await self.runner.call(self.store.issue_leases, plan.new, plan.reissued, plan.cursor)
            self.scheduler.commit(plan)
        self.pools.leased(pool, len(plan.new))
        self.metrics.leases.labels("issued").inc(len(plan.new))
        self.metrics.leases.labels("skipped").inc(plan.skipped)
        return [{
            "lease_id": le.lease_id, "group_id": le.lease_id, "task_id": le.task_id, "epoch": le.epoch,
            "prompt": tasks[le.task_id].prompt, "metadata": tasks[le.task_id].metadata, "n_samples": le.n_samples,
            "model_ids": le.model_ids, "deadline": le.deadline,
        } for le in plan.new]

    def _check_served(self, model_ids: Sequence[str], served: Mapping[str, int]) -> None:
        bound = self.config.policies.max_staleness
        if bound is None:
            return
        behind = {m: self.models[m].training_version for m in model_ids
                  if m in self.models and m in served and self.models[m].training_version - served[m] > bound}
        if behind:
            self.metrics.leases.labels("held_back").inc()
            lags = "; ".join(f"{m}: v{served[m]} is {v - served[m]} behind training_version v{v}"
                             for m, v in behind.items())
            raise HeldBack(behind, f"held back ({lags}; policies.max_staleness {bound}): lease again once "
                                   f"serving the training_version")

    def _lease_room(self, model_ids: Sequence[str]) -> int:
        """Backpressure (`tasks.max_buffered_groups`): leases that may go out before the fresh groups
        waiting plus the active leases reach the bound for every model (unbounded: a large number)."""
        cap = self.config.tasks.max_buffered_groups
        if cap is None or self.scheduler is None:
            return 1 << 30
        out = int(self.scheduler.progress()["leases_active"])
        return max((cap - len(self.models[m].fresh) - out for m in model_ids if m in self.models), default=cap - out)

    async def expire_due(self) -> list[str]:
        """Expire active leases past their deadline, so that their tasks are issued again."""
        assert self.scheduler is not None
        async with self._lease_lock:
            due = self.scheduler.due(time.time())
            if not due:
                return []
            expired = await self.runner.call(self.store.expire_leases, due)
            self.scheduler.mark_expired(expired)
        self.metrics.leases.labels("expired").inc(len(expired))
        log.info("%d leases expired; their tasks will be issued again", len(expired))
        return expired

    async def _expire_forever(self) -> None:
        """Expire leases and requeue batches whose ack deadline has passed."""
        interval = min(1.0, self.config.tasks.lease_timeout_s / 4, self.config.ack_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_due()
                await self.delivery.requeue_overdue(list(self.models.values()))
            except StoreUnavailable as e:
                log.warning("cannot expire leases or requeue batches now: %s", e)

    # ---- trainers -------------------------------------------------------------------------------------

    async def report_version(self, model_id: str, version: int) -> dict[str, Any]:
        buf = self.models.get(model_id)
        if buf is None and not self.config.allow_register:
            raise UnknownModel(f"unknown model_id {model_id!r} and registration is off")
        if buf is None and not MODEL_ID.match(model_id):
            raise DataFormatError(f"model_id {model_id!r:.140} does not match {MODEL_ID.pattern}")
        if buf is not None and version < buf.version:
            raise VersionConflict(f"{model_id!r} is at version {buf.version}; {version} is older")
        if buf is None or version != buf.version:
            await self.runner.call(self.store.set_model_version, model_id, version)
        buf = self._buffer(model_id, version)
        buf.set_version(version)
        self.metrics.trainer_version.labels(model_id).set(version)
        return buf.status()

    def report_step(self, model_id: str, wait_s: float, step_s: float) -> dict[str, Any]:
        buf = self.model(model_id)
        buf.balance.add_step(wait_s, step_s)
        report = self.balance()
        return report["models"][model_id]

    async def next_batch(self, model_id: str, size: int, version: int | None, timeout_s: float, *,
                         ack: Sequence[str] = (), held: Sequence[str] = (),
                         alive: Callable[[], bool] = lambda: True) -> tuple[str, bytes] | None:
        """Long-poll: a batch of at most `size` samples (whole groups) as bytes, or None after `timeout_s`.

        `ack` acknowledges batches first; unacknowledged batches not in `held` go back to the buffer
        (see `BatchDelivery.poll`)."""
        buf = self.model(model_id)
        if version is not None and version > buf.version:
            await self.report_version(model_id, version)
        return await self.delivery.poll(buf, size, timeout_s, ack=ack, held=held, alive=alive)

    async def ack(self, model_id: str, batch_ids: Sequence[str]) -> AckResult:
        """Acknowledge batches of `model_id`; UnknownBatch (nothing changed) if one was never served to it."""
        return await self.delivery.ack(self.model(model_id), batch_ids)

    # ---- reports --------------------------------------------------------------------------------------

    def balance(self) -> dict[str, Any]:
        report = balance_report({m: b.balance for m, b in self.models.items()}, self.pools, time.time(),
                                self.config.balance)
        self.metrics.rollout_gpus.set(report["gpus"])
        for model_id, entry in report["models"].items():
            self.metrics.wait_fraction.labels(model_id).set(entry["wait_fraction"])
            self.metrics.target_gpus.labels(model_id).set(entry["target_gpus"])
        return report

    def status(self) -> dict[str, Any]:
        assert self.scheduler is not None
        return {"models": {m: b.status() for m, b in self.models.items()}, "tasks": self.scheduler.progress()}

    def leases(self, pool: str | None = None) -> list[dict[str, Any]]:
        assert self.scheduler is not None
        return [{"lease_id": le.lease_id, "task_id": le.task_id, "epoch": le.epoch, "pool": le.pool,
                 "region": le.region, "model_ids": le.model_ids, "n_samples": le.n_samples,
                 "deadline": le.deadline, "state": le.state}
                for le in self.scheduler.leases.values() if pool is None or le.pool == pool]

    def _refresh_gauges(self) -> None:
        for model_id, buf in self.models.items():
            self.metrics.buffer_samples.labels(model_id, "fresh").set(buf.fresh_samples)
            self.metrics.buffer_samples.labels(model_id, "replay").set(buf.replay_samples)
            self.metrics.unacked.labels(model_id).set(len(buf.unacked))
