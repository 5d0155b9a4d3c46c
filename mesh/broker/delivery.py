"""Batches out to trainers, at least once: plan a batch, serve it, take its acknowledgement, or requeue it.

A served batch is committed as *delivered* together with the fresh groups it took, which keep their
token arrays until the trainer acknowledges the batch (`ack` in its next poll, or `POST .../acks`).
The acknowledgement makes those groups consumed: replay candidates, or retired at once when replay is
off or full. Unacknowledged, a batch goes back to the buffer (the same whole groups, in their old
place in completion order) when its ack deadline passes, or as soon as the model's trainer polls
without listing it among the batches it still holds: that trainer restarted, or the answer carrying
the batch never reached it. A trajectory the broker acknowledged to its pool is therefore trained on
at least once, and served twice only if a trainer never acknowledged a batch holding it. One poller
per model_id is assumed (the trainer's rank 0), polling one batch at a time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from deltamesh.data import encode_batch
from deltamesh.mesh.broker.buffers import ModelBuffer
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.policies import REPLAY_SELECTORS, BatchPlan, BatchPolicy, resolve
from deltamesh.mesh.broker.runner import StoreRunner
from deltamesh.mesh.broker.store_interface import BrokerStore, Delivery, GroupKey

log = logging.getLogger(__name__)


class UnknownBatch(LookupError):
    """An acknowledgement of a batch id this broker never served to that model. HTTP 404."""


@dataclass
class AckResult:
    """What an acknowledgement did, batch id by batch id."""

    acked: list[str] = field(default_factory=list)  # delivered and now acknowledged
    already_acked: list[str] = field(default_factory=list)  # acknowledged before: a no-op
    requeued: list[str] = field(default_factory=list)  # too late: its groups went back to the buffer first
    unknown: list[str] = field(default_factory=list)  # never served to this model

    def as_json(self) -> dict[str, Any]:
        return {"acked": self.acked, "already_acked": self.already_acked, "requeued": self.requeued}


class BatchDelivery:
    """The batch side of one broker: the planner with its policies, and the at-least-once bookkeeping.

    Every change of a model's buffers runs under that model's `taking` lock and inside a shield, so
    a cancelled request never leaves the store and memory apart. `on_change` refreshes the gauges.
    """

    def __init__(self, config: BrokerConfig, runner: StoreRunner, metrics: BrokerMetrics,
                 on_change: Callable[[], None]):
        replay = config.policies.replay
        self.policy = BatchPolicy(config.policies.max_staleness, replay.fraction, replay.max_staleness,
                                  resolve(REPLAY_SELECTORS, replay.selector, "replay selector"))
        self.replay_capacity = replay.capacity if replay.fraction > 0 else 0
        self.ack_timeout_s = config.ack_timeout_s
        self.runner = runner
        self.metrics = metrics
        self._on_change = on_change
        self._rng = random.Random(replay.seed)

    @property
    def store(self) -> BrokerStore:
        assert self.runner.store is not None, "Broker.start() first"
        return self.runner.store

    def restore(self, buf: ModelBuffer, delivery: Delivery) -> None:
        """An unacknowledged batch found at start-up. Its deadline starts again: while the broker was
        down, the trainer holding it could neither acknowledge it nor say that it still holds it."""
        buf.deliver(delivery, time.monotonic() + self.ack_timeout_s)

    # ---- serving --------------------------------------------------------------------------------------

    async def poll(self, buf: ModelBuffer, size: int, timeout_s: float, *, ack: Sequence[str] = (),
                   held: Sequence[str] = (), alive: Callable[[], bool] = lambda: True) -> tuple[str, bytes] | None:
        """Long-poll: first settle `ack` (unknown ids are only logged) and requeue every unacknowledged
        batch not in `held` (the ones in it get a new deadline), then wait up to `timeout_s` for a batch
        of at most `size` samples (whole groups). None on timeout, or once `alive()` says the poller
        has gone: a batch is never taken for a connection already closed."""
        if ack:
            await self.ack(buf, ack, strict=False)
        keep = set(held)
        renewed = time.monotonic() + self.ack_timeout_s
        for batch_id in keep.intersection(buf.unacked):
            buf.unacked[batch_id].deadline = renewed
        await self._requeue(buf, lambda: [b for b in buf.unacked if b not in keep], "not_held")
        deadline = time.monotonic() + timeout_s
        while True:
            if not alive():
                return None
            changed = buf.watch()
            served = await asyncio.shield(self._try_serve(buf, size, alive))
            if served is not None:
                return served
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await buf.wait_changed(remaining, changed)

    async def _try_serve(self, buf: ModelBuffer, size: int, alive: Callable[[], bool]) -> tuple[str, bytes] | None:
        async with buf.taking:
            if not alive():
                return None
            # Staleness from the version this batch will train, not the last one reported: the trainer
            # may still be publishing the version its previous batch made.
            plan = self.policy.plan(list(buf.fresh.values()), list(buf.replay.values()), size=size,
                                    version=buf.training_version, rng=self._rng)
            if plan.ready:
                return await self._serve(buf, plan)
            if plan.stale or plan.retired:
                await self.runner.call(self.store.drop_groups, _drops(plan))
                self._forget(buf, plan)
            return None

    def _forget(self, buf: ModelBuffer, plan: BatchPlan) -> None:
        buf.remove_fresh(plan.stale)
        buf.remove_replay(plan.retired)
        for g in plan.stale:
            self.metrics.groups.labels(g.model_id, "stale").inc()

    async def _serve(self, buf: ModelBuffer, plan: BatchPlan) -> tuple[str, bytes]:
        start = time.perf_counter()
        batch_id, version = uuid.uuid4().hex, buf.version
        replayed = {g.group_id for g in plan.replay}

        def take_and_encode() -> tuple[bytes, int, int]:
            """On the store thread: commit the batch as delivered, then lay it out (one hand-off, not two)."""
            trajectories = self.store.take_batch(batch_id, buf.model_id, version, [g.key for g in plan.fresh],
                                                 [g.key for g in plan.replay], _drops(plan))
            flags = [t.group_id in replayed for t in trajectories]
            data = encode_batch(trajectories, flags, model_id=buf.model_id, batch_id=batch_id, version=version)
            return data, len(trajectories), sum(flags)

        data, n, n_replay = await self.runner.call(take_and_encode)
        buf.remove_fresh(plan.fresh)
        self._forget(buf, plan)
        buf.deliver(Delivery(batch_id, buf.model_id, plan.fresh), time.monotonic() + self.ack_timeout_s)
        buf.balance.consumed += n - n_replay
        m = self.metrics
        m.batches.labels(buf.model_id).inc()
        m.batch_samples.labels(buf.model_id, "fresh").inc(n - n_replay)
        m.batch_samples.labels(buf.model_id, "replay").inc(n_replay)
        m.batch_seconds.labels(buf.model_id).observe(time.perf_counter() - start)
        self._on_change()
        return batch_id, data

    # ---- acknowledgements and requeues ----------------------------------------------------------------

    async def ack(self, buf: ModelBuffer, batch_ids: Iterable[str], *, strict: bool = True) -> AckResult:
        """Acknowledge batches (idempotent). With `strict`, an id never served to this model raises
        UnknownBatch and nothing is acknowledged; without, such ids are only logged and counted."""
        result = await asyncio.shield(self._ack(buf, list(dict.fromkeys(batch_ids)), strict))
        model_id = buf.model_id
        for outcome, ids in (("acked", result.acked), ("duplicate", result.already_acked),
                             ("late", result.requeued), ("unknown", result.unknown)):
            if ids:
                self.metrics.acks.labels(model_id, outcome).inc(len(ids))
        if result.requeued:
            log.warning("%s: late ack of %d batch(es) already requeued after their deadline or a restart; "
                        "their samples are served again: %s", model_id, len(result.requeued), result.requeued)
        if result.unknown and not strict:
            log.warning("%s: ignored the ack of batch ids never served to it: %s", model_id, result.unknown)
        return result

    async def _ack(self, buf: ModelBuffer, ids: list[str], strict: bool) -> AckResult:
        async with buf.taking:
            result = AckResult(acked=[i for i in ids if i in buf.unacked])
            others = [i for i in ids if i not in buf.unacked]
            states = await self.runner.call(self.store.batch_states, buf.model_id, others) if others else {}
            for batch_id in others:
                {"acked": result.already_acked, "requeued": result.requeued}.get(
                    states.get(batch_id, ""), result.unknown).append(batch_id)
            if strict and result.unknown:
                raise UnknownBatch(f"batch ids never served to {buf.model_id!r}: {result.unknown}"[:1000])
            if result.acked:
                groups = [g for batch_id in result.acked for g in buf.unacked[batch_id].delivery.groups]
                evicted = buf.replay_overflow(groups, [], self.replay_capacity)
                await self.runner.call(self.store.ack_batches, result.acked, [(g.key, "retired") for g in evicted])
                for batch_id in result.acked:
                    buf.settle(batch_id)
                buf.add_replay(groups)
                buf.remove_replay(evicted)
                self._on_change()
            return result

    async def requeue_overdue(self, buffers: Iterable[ModelBuffer]) -> None:
        """Requeue every unacknowledged batch past its ack deadline."""
        for buf in buffers:
            if buf.overdue(time.monotonic()):
                await self._requeue(buf, lambda buf=buf: buf.overdue(time.monotonic()), "deadline")

    async def _requeue(self, buf: ModelBuffer, select: Callable[[], list[str]], reason: str) -> None:
        """Put the groups of the batches `select()` names (asked under the lock) back in the buffer."""
        async def requeue() -> list[str]:
            async with buf.taking:
                ids = select()
                if ids:
                    await self.runner.call(self.store.requeue_batches, ids)
                    for batch_id in ids:
                        buf.take_back(batch_id)
                    self._on_change()
                return ids

        if not buf.unacked:
            return
        ids = await asyncio.shield(requeue())
        if ids:
            self.metrics.requeued.labels(buf.model_id, reason).inc(len(ids))
            log.info("%s: %d unacknowledged batch(es) back in the buffer (%s): %s", buf.model_id, len(ids),
                     "ack deadline passed" if reason == "deadline" else "the trainer polled without holding them",
                     ids)


def _drops(plan: BatchPlan) -> list[tuple[GroupKey, str]]:
    return [(g.key, "stale") for g in plan.stale] + [(g.key, "retired") for g in plan.retired]
