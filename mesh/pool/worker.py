"""The rollout worker loop: lease tasks from the broker, run the workflow's episodes, submit trajectories.

While the lease gate allows it (every engine serves a published version within the staleness
bound), the worker keeps up to `max_episodes` episodes running, leasing at most `lease_batch` tasks
per request; episodes that run side by side share engine batches (see `batching.py`). Each episode's
trajectories (tagged by the workflow with pool, region, model_id and the version of every token) are
submitted together; submission is idempotent, so the client retries it (and fails over to another
broker) on a 503 or a lost broker. An
episode that fails, or a pool that dies, simply lets its lease expire: the broker then hands the
task out again. On stop the worker leases nothing more (a lease request under way, retrying through a
broker outage, is given up) and gives running episodes `drain_s` to finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, TypeVar

from deltamesh.broker_client import BrokerClient, HeldBack, TaskLease
from deltamesh.http import HttpError
from deltamesh.mesh.pool.config import WorkerConfig
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.staleness import LeaseGate
from deltamesh.mesh.workflows import EpisodeContext, Task, Workflow
from deltamesh.signals import sleep_or_stop, until_stopped

log = logging.getLogger(__name__)

T = TypeVar("T")


def task_from_lease(lease: TaskLease) -> Task:
    """The workflow's view of a lease; a prompt that is not text (chat messages) is passed as JSON.

    The broker hands out a dataset line's other fields as the metadata; a line that nests them under
    "metadata" (as `digit_sum_tasks` writes records) has them lifted, so both layouts give the
    workflow `metadata["answer"]`.
    """
    prompt = lease.prompt if isinstance(lease.prompt, str) else json.dumps(lease.prompt)
    metadata = dict(lease.metadata)
    nested = metadata.pop("metadata", None)
    if isinstance(nested, dict):
        metadata = {**nested, **metadata}
    elif nested is not None:
        metadata["metadata"] = nested
    return Task(task_id=lease.task_id, prompt=prompt, group_id=lease.group_id, metadata=metadata,
                n_samples=lease.n_samples, model_ids=tuple(lease.model_ids))


async def unless_stopped(call: Awaitable[T], stop: asyncio.Event) -> T | None:
    """What `call` returns, or None once `stop` is set first (the call is then cancelled)."""
    task = asyncio.ensure_future(call)
    await until_stopped(task, stop)
    return None if task.cancelled() else task.result()


def record_acknowledged(path: str, lease_id: str, ids: list[str]) -> None:
    """Append one acknowledged submission to the pool's ledger (`WorkerConfig.ledger`). Written after the
    broker's answer, so a pool killed in between leaves out a submission the broker holds, never the
    other way round."""
    line = json.dumps({"time": time.time(), "lease": lease_id, "ids": ids}) + "\n"
    with open(path, "a") as f:
        f.write(line)


@dataclass
class WorkerCounts:
    leased: int = 0
    episodes_ok: int = 0
    episodes_failed: int = 0
    submitted: int = 0
    submitted_by_model: dict[str, int] = field(default_factory=dict)
    last_submit_at: float | None = None


class RolloutWorker:
    def __init__(self, client: BrokerClient, workflow: Workflow, ctx: EpisodeContext, gate: LeaseGate,
                 settings: WorkerConfig, *, tier: str = "", metrics: PoolMetrics | None = None) -> None:
        self.client = client
        self.workflow = workflow
        self.ctx = ctx
        self.gate = gate
        self.settings = settings
        self.tier = tier
        self.metrics = metrics
        self.counts = WorkerCounts()
        self._running: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        return len(self._running)

    async def run(self, stop: asyncio.Event) -> None:
        """Lease and run episodes until `stop`, then drain."""
        s = self.settings
        try:
            while not stop.is_set():
                room = s.max_episodes - len(self._running)
                if room <= 0:
                    await asyncio.wait(self._running, timeout=s.idle_s, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # A broker outage makes these calls retry for a while: a stop does not wait them out.
                verdict = await unless_stopped(self.gate.check(), stop)
                if verdict is None or not verdict.may_lease:
                    await sleep_or_stop(stop, s.idle_s)
                    continue
                try:
                    leases = await unless_stopped(self.client.lease(min(room, s.lease_batch), self.gate.served()),
                                                  stop)
                except HeldBack as e:
                    self.gate.held_back(e.training_versions)
                    log.debug("no lease: %s", e)  # the gate, now shut, logs the wait once
                    await sleep_or_stop(stop, s.idle_s)
                    continue
                except HttpError as e:
                    log.warning("cannot lease from the broker: %s", e)
                    await sleep_or_stop(stop, s.idle_s)
                    continue
                if leases is None:
                    continue  # stopped while asking; a lease granted meanwhile expires and goes out again
                if not leases:
                    await sleep_or_stop(stop, s.idle_s)
                    continue
                self.counts.leased += len(leases)
                if self.metrics is not None:
                    self.metrics.leases.inc(len(leases))
                for lease in leases:
                    episode = asyncio.create_task(self._episode(lease), name=f"episode-{lease.lease_id}")
                    self._running.add(episode)
                    episode.add_done_callback(self._running.discard)
                self._set_running()
            await self._drain()
        finally:
            for episode in list(self._running):
                episode.cancel()
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("stopping: waiting up to %.0f s for %d running episodes", self.settings.drain_s, len(self._running))
        _, pending = await asyncio.wait(set(self._running), timeout=self.settings.drain_s)
        if pending:
            log.warning("%d episodes did not finish; their leases will expire and go out again", len(pending))

    async def _episode(self, lease: TaskLease) -> None:
        leased_at = time.time()
        started = time.perf_counter()
        try:
            trajectories = await self.workflow.run(task_from_lease(lease), self.ctx)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a workflow is plug-in code; its failure must not stop the pool
            self._episode_done(False, started)
            log.warning("episode of task %s (lease %s) failed, the lease will expire: %s: %s",
                        lease.task_id, lease.lease_id, type(e).__name__, e)
            return
        for t in trajectories:
            t.timings["leased_at"] = leased_at
            t.timings["lease_deadline"] = lease.deadline
            if self.tier:
                t.metadata["tier"] = self.tier
        if time.time() > lease.deadline:
            log.warning("task %s finished after its lease %s expired; the broker may have handed it out again",
                        lease.task_id, lease.lease_id)
        try:
            await self.client.submit(trajectories)
        except HttpError as e:
            self._episode_done(False, started)
            log.error("submission of lease %s refused: %s", lease.lease_id, e)
            return
        self._episode_done(True, started)
        if self.settings.ledger:
            record_acknowledged(self.settings.ledger, lease.lease_id, [t.id for t in trajectories])
        c = self.counts
        c.submitted += len(trajectories)
        c.last_submit_at = time.time()
        for t in trajectories:
            c.submitted_by_model[t.model_id] = c.submitted_by_model.get(t.model_id, 0) + 1
            if self.metrics is not None:
                self.metrics.submitted.labels(t.model_id).inc()

    def _episode_done(self, ok: bool, started: float) -> None:
        if ok:
            self.counts.episodes_ok += 1
        else:
            self.counts.episodes_failed += 1
        if self.metrics is not None:
            self.metrics.episodes.labels("ok" if ok else "failed").inc()
            self.metrics.episode_seconds.observe(time.perf_counter() - started)
        self._set_running(-1)

    def _set_running(self, offset: int = 0) -> None:
        # An episode's done-callback removes it from the set only after its body returns.
        if self.metrics is not None:
            self.metrics.running.set(max(0, len(self._running) + offset))
