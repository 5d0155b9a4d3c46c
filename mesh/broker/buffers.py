"""One model's buffers in the broker's memory: fresh groups waiting to be trained on, replay groups, the
batches delivered and awaiting their ack, the trainer's version, its balance window, and the signal
that wakes long-polling trainers.

Only group summaries live here; token arrays stay in the store until a batch is served. Groups are
kept in completion order (dicts preserve insertion order), which is the order the planner takes them
in; a requeued batch's groups go back to where they were in that order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Iterable

from deltamesh.mesh.broker.balance import BalanceWindow
from deltamesh.mesh.broker.store_interface import Delivery, GroupSummary
from deltamesh.signals import wait_event


@dataclass
class Unacked:
    """A delivered batch and when (time.monotonic) its groups go back to the buffer unless acknowledged."""

    delivery: Delivery
    deadline: float


class ModelBuffer:
    def __init__(self, model_id: str, version: int, window_steps: int):
        self.model_id = model_id
        self.version = version
        self.fresh: dict[str, GroupSummary] = {}
        self.replay: dict[str, GroupSummary] = {}
        self.fresh_samples = 0  # kept in step with the dicts: summing them per request would cost O(groups)
        self.replay_samples = 0
        self.unacked: dict[str, Unacked] = {}  # batch_id -> delivery, oldest first
        self.unacked_samples = 0
        self.taken = 0
        """Batches served since the trainer's version last moved past them: each makes one more version."""
        self.balance = BalanceWindow(window_steps)
        self._changed = asyncio.Event()
        self.taking = asyncio.Lock()  # one batch is planned and taken at a time per model

    def add_fresh(self, groups: Iterable[GroupSummary]) -> None:
        for g in groups:
            if g.group_id not in self.fresh:
                self.fresh[g.group_id] = g
                self.fresh_samples += g.size
        self._notify()

    def remove_fresh(self, groups: Iterable[GroupSummary]) -> None:
        for g in groups:
            if self.fresh.pop(g.group_id, None) is not None:
                self.fresh_samples -= g.size

    def requeue(self, groups: Iterable[GroupSummary]) -> None:
        """Put groups of an unacknowledged batch back among the fresh ones, in completion order."""
        back = {g.group_id: g for g in groups if g.group_id not in self.fresh}
        if not back:
            return
        self.fresh_samples += sum(g.size for g in back.values())
        self.fresh = dict(sorted({**self.fresh, **back}.items(), key=lambda item: item[1].seq))
        self._notify()

    def deliver(self, delivery: Delivery, deadline: float) -> None:
        self.unacked[delivery.batch_id] = Unacked(delivery, deadline)
        self.unacked_samples += delivery.samples
        self.taken += 1

    def settle(self, batch_id: str) -> Delivery:
        """Forget an unacknowledged batch (acknowledged or requeued now); returns its delivery."""
        delivery = self.unacked.pop(batch_id).delivery
        self.unacked_samples -= delivery.samples
        return delivery

    def take_back(self, batch_id: str) -> None:
        """Requeue an unacknowledged batch: its groups go back, and the version it was counted to make
        is not counted twice when they are served again."""
        self.requeue(self.settle(batch_id).groups)
        self.taken = max(0, self.taken - 1)

    def overdue(self, now: float) -> list[str]:
        return [batch_id for batch_id, u in self.unacked.items() if u.deadline <= now]

    def replay_overflow(self, adding: list[GroupSummary], removing: list[GroupSummary],
                        capacity: int) -> list[GroupSummary]:
        """The oldest groups that would no longer fit in `capacity` samples after this change."""
        gone = {g.group_id for g in removing}
        order = [g for g in self.replay.values() if g.group_id not in gone] + adding
        total = sum(g.size for g in order)
        evicted = []
        for g in order:
            if total <= capacity:
                break
            evicted.append(g)
            total -= g.size
        return evicted

    def add_replay(self, groups: Iterable[GroupSummary]) -> None:
        for g in groups:
            if g.group_id not in self.replay:
                self.replay[g.group_id] = g
                self.replay_samples += g.size
        self._notify()  # replay can fill a batch's replay share: fewer fresh samples make it ready

    def remove_replay(self, groups: Iterable[GroupSummary]) -> None:
        for g in groups:
            if self.replay.pop(g.group_id, None) is not None:
                self.replay_samples -= g.size

    def set_version(self, version: int) -> None:
        if version > self.version:
            self.taken = max(0, self.taken - (version - self.version))
        self.version = version
        self._notify()  # a new version can make waiting groups stale: let waiters re-plan

    def watch(self) -> asyncio.Event:
        """The event the next change sets. Taken before looking at the buffers and waited on after
        (`wait_changed`), it catches a change that comes in between."""
        return self._changed

    async def wait_changed(self, timeout_s: float, event: asyncio.Event | None = None) -> None:
        """Return when groups arrive or the version moves (since `event` was taken with `watch`), or
        after `timeout_s`."""
        event = event or self._changed
        await wait_event(event, timeout_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def training_version(self) -> int:
        """The version the trainer's batches in hand will have made: the version the next batch trains.
        Staleness is measured from it (a pool that far behind makes samples staler than their lag from
        `version` says: a synchronous run's pools wait for it)."""
        return self.version + self.taken

    def status(self) -> dict[str, int]:
        return {"version": self.version, "training_version": self.training_version,
                "fresh_groups": len(self.fresh), "fresh_samples": self.fresh_samples,
                "replay_groups": len(self.replay), "replay_samples": self.replay_samples,
                "unacked_batches": len(self.unacked), "unacked_samples": self.unacked_samples}
