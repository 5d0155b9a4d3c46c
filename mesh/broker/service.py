"""The dataflow broker itself, without HTTP: tasks out to pools, trajectories in, batches out to trainers.

`Broker` owns the working state in memory (one `ModelBuffer` per model_id, the task scheduler, the
curator, the pools seen, the balance windows) and changes it only after the store has committed the
matching change, so a restart (`start` loads the store) finds exactly what was acknowledged. Store
work runs on the `StoreRunner`'s thread; this class runs on the event loop and needs no locks beyond
one for lease issuing and one per model for taking batches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import Any, Callable, Sequence

from deltamesh.mesh.broker.balance import PoolRegistry, balance_report
from deltamesh.mesh.broker.buffers import ModelBuffer
from deltamesh.mesh.broker.config import MODEL_ID, BrokerConfig
from deltamesh.mesh.broker.curators import make_curator
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.policies import REPLAY_SELECTORS, BatchPlan, BatchPolicy, filter_chain, resolve
from deltamesh.mesh.broker.runner import StoreRunner
from deltamesh.mesh.broker.store import BrokerStore, GroupKey, GroupSummary, IngestResult, StoreUnavailable
from deltamesh.mesh.broker.tasks import TaskScheduler, read_dataset
from deltamesh.trainer.data import DataFormatError, Trajectory, encode_batch

log = logging.getLogger(__name__)


class UnknownModel(LookupError):
    """A model_id the broker does not serve. HTTP 404."""


class VersionConflict(ValueError):
    """A trainer reported a version older than the one it reported before. HTTP 409."""


class Broker:
    def __init__(self, config: BrokerConfig, open_store: Callable[[], BrokerStore], *,
                 metrics: BrokerMetrics | None = None):
        self.config = config
        self.metrics = metrics or BrokerMetrics()
        replay = config.policies.replay
        self.policy = BatchPolicy(config.policies.max_staleness, replay.fraction, replay.max_staleness,
                                  resolve(REPLAY_SELECTORS, replay.selector, "replay selector"))
        self.replay_capacity = replay.capacity if replay.fraction > 0 else 0
        self.curator = make_curator(config.tasks.curator)
        self.runner = StoreRunner(open_store, filter_chain(config.policies.filters),
                                  max_commit=config.max_commit_trajectories, on_ingested=self._ingested,
                                  on_commit=self.metrics.commits.inc)
        self.models: dict[str, ModelBuffer] = {}
        self.pools = PoolRegistry(config.balance.pool_ttl_s)
        self.scheduler: TaskScheduler | None = None
        self._rng = random.Random(replay.seed)
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
            evicted = buf.replay_overflow([], [], self.replay_capacity)
            if evicted:  # capacity shrank, or replay was switched off, since the last run
                await self.runner.call(self.store.drop_groups, [(g.key, "retired") for g in evicted])
                buf.remove_replay(evicted)
        for g in snapshot.history:
            self.curator.observe(g)
        self.scheduler = TaskScheduler(self.config.tasks, self.curator, snapshot)
        self._expiry = asyncio.create_task(self._expire_forever(), name="broker-lease-expiry")
        self._refresh_gauges()
        log.info("broker ready: models %s, %d fresh groups, %d leases restored", sorted(self.models),
                 len(snapshot.fresh), len(snapshot.leases))

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
        """Store a submission durably (all or nothing); returns after the commit."""
        for t in trajectories:
            self.model(t.model_id)
        return await self.runner.ingest(trajectories)

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

    async def lease(self, pool: str, region: str, gpus: int, max_tasks: int) -> list[dict[str, Any]]:
        """Lease up to `max_tasks` tasks to `pool`; each lease's id is the group id to submit under."""
        assert self.scheduler is not None
        now = time.time()
        self.pools.seen(pool, region, gpus, now)
        async with self._lease_lock:
            model_ids = self.config.tasks.model_ids or sorted(self.models)
            plan = self.scheduler.plan(pool, region, max_tasks, now, model_ids)
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
        interval = min(1.0, self.config.tasks.lease_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_due()
            except StoreUnavailable as e:
                log.warning("cannot expire leases now: %s", e)

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

    async def next_batch(self, model_id: str, size: int, version: int | None, timeout_s: float) -> tuple[str, bytes] | None:
        """Long-poll: a batch of at most `size` samples (whole groups) as bytes, or None after `timeout_s`."""
        buf = self.model(model_id)
        if version is not None and version > buf.version:
            await self.report_version(model_id, version)
        deadline = time.monotonic() + timeout_s
        while True:
            async with buf.taking:
                plan = self.policy.plan(list(buf.fresh.values()), list(buf.replay.values()), size=size,
                                        version=buf.version, rng=self._rng)
                if plan.ready:
                    return await self._serve(buf, plan)
                if plan.stale or plan.retired:
                    await self._drop(buf, plan)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await buf.wait_changed(remaining)

    def _drops(self, plan: BatchPlan, evicted: list[GroupSummary]) -> list[tuple[GroupKey, str]]:
        return ([(g.key, "stale") for g in plan.stale] + [(g.key, "retired") for g in plan.retired]
                + [(g.key, "retired") for g in evicted])

    async def _drop(self, buf: ModelBuffer, plan: BatchPlan) -> None:
        async def drop() -> None:
            await self.runner.call(self.store.drop_groups, self._drops(plan, []))
            self._forget(buf, plan, [])

        await asyncio.shield(drop())

    def _forget(self, buf: ModelBuffer, plan: BatchPlan, evicted: list[GroupSummary]) -> None:
        buf.remove_fresh(plan.stale)
        buf.remove_replay(plan.retired + evicted)
        for g in plan.stale:
            self.metrics.groups.labels(g.model_id, "stale").inc()

    async def _serve(self, buf: ModelBuffer, plan: BatchPlan) -> tuple[str, bytes]:
        start = time.perf_counter()
        batch_id = uuid.uuid4().hex

        async def take() -> list[Trajectory]:
            """The store's commit and the buffers' matching change, finished together even if the
            request is cancelled meanwhile (the batch then counts as served, as documented)."""
            evicted = buf.replay_overflow(plan.fresh, plan.retired, self.replay_capacity)
            trajectories = await self.runner.call(
                self.store.take_batch, batch_id, buf.model_id, buf.version, [g.key for g in plan.fresh],
                [g.key for g in plan.replay], self._drops(plan, evicted))
            buf.remove_fresh(plan.fresh)
            self._forget(buf, plan, evicted)
            gone = {g.group_id for g in evicted}
            buf.add_replay(g for g in plan.fresh if g.group_id not in gone)
            return trajectories

        trajectories = await asyncio.shield(take())
        replayed = {g.group_id for g in plan.replay}
        flags = [t.group_id in replayed for t in trajectories]
        data = await asyncio.to_thread(encode_batch, trajectories, flags, model_id=buf.model_id, batch_id=batch_id,
                                       version=buf.version)
        n_replay = sum(flags)
        buf.balance.consumed += len(trajectories) - n_replay
        m = self.metrics
        m.batches.labels(buf.model_id).inc()
        m.batch_samples.labels(buf.model_id, "fresh").inc(len(trajectories) - n_replay)
        m.batch_samples.labels(buf.model_id, "replay").inc(n_replay)
        m.batch_seconds.labels(buf.model_id).observe(time.perf_counter() - start)
        self._refresh_gauges()
        return batch_id, data

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
