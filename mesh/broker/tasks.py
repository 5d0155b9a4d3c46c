"""Rollout tasks: reading the dataset, and the in-memory lease table and cursor that hand tasks out.

The dataset is JSONL, one prompt per line: `{"id": ..., "prompt": ..., ...}`; every other field
(reference answer, tests, ...) travels to pools as the task's metadata. The scheduler walks the
dataset epoch by epoch with a cursor, asks the curator about each prompt, and issues leases with a
deadline. Expired leases are issued again (to any pool) before the cursor moves on. Pools pull, and
each may hold at most `max_inflight_per_pool` leases (counted per token holder: the names it may lease
under share them), so a faster pool, which returns sooner, is handed more; one request gets at most
`max_lease_batch`, whatever it asks for. `plan` only proposes; the broker applies a plan with `commit` once the store holds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.auth import speaks_for
from deltamesh.mesh.broker.config import TasksConfig
from deltamesh.mesh.broker.curators import Curator
from deltamesh.mesh.broker.store_interface import Lease, StoreSnapshot, TaskRecord


class DatasetError(ValueError):
    """A dataset file that cannot be read as JSONL prompts; names the line."""


def read_dataset(path: str | Path) -> list[TaskRecord]:
    tasks: list[TaskRecord] = []
    seen: set[str] = set()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{n}: not JSON: {e}") from e
        if not isinstance(record, dict) or "prompt" not in record:
            raise DatasetError(f"{path}:{n}: each line must be an object with a prompt")
        task_id = str(record.pop("id", f"line{n}"))
        if task_id in seen:
            raise DatasetError(f"{path}:{n}: task id {task_id!r} appears twice")
        seen.add(task_id)
        tasks.append(TaskRecord(task_id, record.pop("prompt"), record))
    return tasks


@dataclass
class LeasePlan:
    new: list[Lease] = field(default_factory=list)
    reissued: list[str] = field(default_factory=list)
    cursor: tuple[int, int] = (0, 0)
    skipped: int = 0  # prompts the curator declined on the way


class TaskScheduler:
    def __init__(self, config: TasksConfig, curator: Curator, snapshot: StoreSnapshot):
        self.config = config
        self.curator = curator
        self.task_ids = snapshot.task_ids
        self.cursor = snapshot.cursor
        self.next_lease_no = snapshot.next_lease_no
        self.leases: dict[str, Lease] = {le.lease_id: le for le in snapshot.leases}

    def inflight(self, holder: str) -> int:
        """Active leases of `holder`, under its own name or one it may speak for (`NAME.SUFFIX`)."""
        return sum(1 for le in self.leases.values() if le.state == "active" and speaks_for(holder, le.pool))

    def plan(self, pool: str, region: str, want: int, now: float, model_ids: list[str],
             holder: str | None = None) -> LeasePlan:
        """Propose up to `want` leases for `pool`: expired tasks first, then new ones from the cursor.
        `holder` (default `pool`) is who asks: the token's name, whose active leases count towards its bound."""
        inflight = self.inflight(holder if holder is not None else pool)
        room = min(want, self.config.max_lease_batch, self.config.max_inflight_per_pool - inflight)
        plan = LeasePlan(cursor=self.cursor)
        deadline = now + self.config.lease_timeout_s
        expired = sorted((le for le in self.leases.values() if le.state == "expired"), key=lambda le: le.deadline)
        lease_no = self.next_lease_no
        for old in expired[:max(room, 0)]:
            plan.new.append(Lease(lease_no, old.task_id, old.epoch, pool, region, old.model_ids, old.n_samples, now,
                                  deadline))
            plan.reissued.append(old.lease_id)
            lease_no += 1
        epoch, pos = self.cursor
        while len(plan.new) < room and epoch < self.config.epochs and self.task_ids:
            task_id, task_epoch = self.task_ids[pos], epoch
            pos += 1
            if pos == len(self.task_ids):
                epoch, pos = epoch + 1, 0
            if not self.curator.admit(task_id):
                plan.skipped += 1
                continue
            plan.new.append(Lease(lease_no, task_id, task_epoch, pool, region, list(model_ids), self.config.n_samples,
                                  now, deadline))
            lease_no += 1
        plan.cursor = (epoch, pos)
        return plan

    def commit(self, plan: LeasePlan) -> None:
        for lease_id in plan.reissued:
            self.leases.pop(lease_id, None)
        for le in plan.new:
            self.leases[le.lease_id] = le
        self.cursor = plan.cursor
        self.next_lease_no += len(plan.new)

    def due(self, now: float) -> list[str]:
        """Active leases past their deadline."""
        return [le.lease_id for le in self.leases.values() if le.state == "active" and le.deadline < now]

    def mark_expired(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state == "active":
                lease.state = "expired"

    def mark_done(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self.leases.pop(lease_id, None)

    def progress(self) -> dict[str, object]:
        epoch, pos = self.cursor
        active = sum(1 for le in self.leases.values() if le.state == "active")
        return {
            "tasks": len(self.task_ids), "epochs": self.config.epochs, "cursor": {"epoch": epoch, "position": pos},
            "leases_active": active, "leases_expired": len(self.leases) - active,
            "exhausted": epoch >= self.config.epochs or not self.task_ids,
            "finished": (epoch >= self.config.epochs or not self.task_ids) and not self.leases,
        }
