"""The broker's durable store: the records it keeps and the narrow interface every backend implements.

The broker keeps its working state (buffers, lease table, cursor, curator) in memory and uses the
store as a durable log of changes: each method is one transaction that either commits completely or
changes nothing, and the broker acknowledges only after it returns. `load` rebuilds everything at
start-up. That is all a backend must do: the embedded SQLite one (`SqliteStore`) and PostgreSQL
(`PostgresStore`, which a standby broker can take over; see `LeaderTerm`) implement `BrokerStore`
(`stores.open_store` picks one). Methods are blocking; the broker calls them from one worker thread,
never from its event loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from deltamesh.data import Trajectory
from deltamesh.delta.hashing import digest

GroupKey = tuple[str, str]
"""(model_id, group_id): a group is the samples of one prompt for one model."""


class StoreUnavailable(Exception):
    """The store cannot commit right now (disk full, I/O error, locked); nothing was changed. HTTP 503."""


class NotLeader(StoreUnavailable):
    """This broker no longer holds the leadership lease; nothing was written. HTTP 503."""


@dataclass(frozen=True)
class LeaderTerm:
    """A broker's hold on the leadership of a shared store: who holds it and in which epoch (a takeover
    starts a new epoch). A store given a term commits only while the lease row still names it."""

    holder: str
    epoch: int


class StoreConflict(Exception):
    """A submission contradicts what is stored (e.g. more samples than its group's size). HTTP 400."""


class IdConflict(StoreConflict):
    """A trajectory id already stored with other content: ids are idempotency keys, never reused. HTTP 409."""


class LeaseNotHeld(StoreConflict):
    """A trajectory for a group named after a lease that its pool does not hold (another pool's lease,
    or a lease id not issued yet): only the lease's holder may fill its group. HTTP 403."""


LEASE_ID = re.compile(r"^L[0-9]+$")
"""What a lease id looks like (`Lease.lease_id`): a group of that name is a lease's, and only its pool's."""


def content_digest(t: Trajectory) -> str:
    """What a trajectory id stands for: everything a trainer uses of it (not where or when it was made),
    so a resubmission of the same trajectory is a duplicate and anything else under its id a conflict."""
    head = json.dumps([t.model_id, t.group_id, t.task_id, t.group_size, float(t.reward).hex()]).encode()
    arrays = (np.ascontiguousarray(t.tokens, "<i4"), np.ascontiguousarray(t.logprobs, "<f4"),
              np.ascontiguousarray(t.versions, "<i4"), np.ascontiguousarray(t.loss_mask, "u1"))
    return digest(b"".join([head, *(a.tobytes() for a in arrays)]))


@dataclass(frozen=True)
class Submission:
    """One submission as a store takes it: its trajectories, each with its content digest and its row
    (store_rows.pack_submission: the packed payload and the rest of the row). The broker packs a
    submission as it arrives, on the event loop, while the store thread waits on the commit before it,
    so that work is off the one serial path every acknowledgement waits on (on PostgreSQL a third of
    the broker's part of a commit)."""

    trajectories: Sequence[Trajectory]
    digests: Sequence[str]
    rows: Sequence[tuple[Any, ...]]


@dataclass
class GroupSummary:
    """What policies need to know about a complete group, without its token arrays."""

    model_id: str
    group_id: str
    task_id: str
    size: int
    min_version: int
    max_version: int
    reward_min: float
    reward_max: float
    reward_mean: float
    seq: int = 0  # completion order, across all models
    state: str = "fresh"  # fresh | filtered | delivered (in a batch awaiting its ack) | consumed | stale | retired
    reason: str = ""  # which filter dropped it, when state is filtered

    @property
    def key(self) -> GroupKey:
        return self.model_id, self.group_id


@dataclass
class TaskRecord:
    """One prompt of the dataset: what a pool needs to produce a group for it."""

    task_id: str
    prompt: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    n_samples: int | None = None  # None: the configured default
    model_ids: list[str] | None = None  # None: the configured default


@dataclass
class Lease:
    """A task handed to a pool until `deadline` (unix time). Its id doubles as the group id."""

    lease_no: int
    task_id: str
    epoch: int
    pool: str
    region: str
    model_ids: list[str]
    n_samples: int
    issued_at: float
    deadline: float
    state: str = "active"  # active | expired (waiting to be issued again) | reissued | done

    @property
    def lease_id(self) -> str:
        return f"L{self.lease_no}"


@dataclass
class IngestResult:
    """What one submission changed: new trajectories, duplicates skipped, groups and leases completed."""

    accepted: int
    duplicates: int
    accepted_by_model: dict[str, int] = field(default_factory=dict)
    completed: list[GroupSummary] = field(default_factory=list)
    done_leases: list[str] = field(default_factory=list)


@dataclass
class Delivery:
    """A batch served to a trainer and not yet acknowledged: the fresh groups it took, oldest first.

    Until its ack those groups are neither fresh nor consumed; a requeue puts them back in the fresh
    buffer. The replay groups a batch also carried are not listed: they stay in replay whatever happens.
    """

    batch_id: str
    model_id: str
    groups: list[GroupSummary]

    @property
    def samples(self) -> int:
        return sum(g.size for g in self.groups)


@dataclass
class StoreSnapshot:
    """Everything the broker rebuilds its memory from after a restart."""

    models: dict[str, int]  # model_id -> trainer version
    task_ids: list[str]  # in dataset order
    cursor: tuple[int, int]  # (epoch, position) of the next task never issued
    next_lease_no: int
    leases: list[Lease]  # active and expired ones
    fresh: list[GroupSummary]  # complete, not yet served, in completion order
    replay: list[GroupSummary]  # served, acknowledged and kept for replay, oldest first
    deliveries: list[Delivery]  # batches served and not yet acknowledged, oldest first
    history: list[GroupSummary]  # recent complete groups (any state), oldest first, for curators


GroupVerdict = Callable[[GroupSummary], str | None]
"""Post-rollout filter chain: the name of the filter that drops a just-completed group, or None."""


class BrokerStore(Protocol):
    def load(self) -> StoreSnapshot: ...

    def import_tasks(self, tasks: Sequence[TaskRecord]) -> None: ...

    def set_model_version(self, model_id: str, version: int) -> None: ...

    def issue_leases(self, new: Sequence[Lease], reissued: Sequence[str], cursor: tuple[int, int]) -> dict[str, TaskRecord]:
        """Record new leases, mark `reissued` ones, move the cursor; return the leased tasks by id."""
        ...

    def expire_leases(self, lease_ids: Sequence[str]) -> list[str]:
        """Mark active leases expired; return those that were still active."""
        ...

    def ingest(self, submissions: Sequence[Submission], verdict: GroupVerdict) -> list[IngestResult | StoreConflict]:
        """Store several submissions in one commit (group commit); each is all-or-nothing on its own.

        A submission that conflicts comes back as its StoreConflict and stores nothing; the others
        commit. StoreUnavailable means the whole commit failed and nothing was stored.
        """
        ...

    def take_batch(self, batch_id: str, model_id: str, version: int, fresh: Sequence[GroupKey],
                   replay: Sequence[GroupKey], drop: Sequence[tuple[GroupKey, str]]) -> list[Trajectory]:
        """Record the batch as delivered (awaiting its ack) with `fresh` groups delivered in it, move
        `drop` groups to their state (see drop_groups), and return the trajectories of `replay` then
        `fresh` groups, in order."""
        ...

    def batch_states(self, model_id: str, batch_ids: Sequence[str]) -> dict[str, str]:
        """The state (delivered | acked | requeued) of each of `batch_ids` served for `model_id`;
        ids never served for it are absent."""
        ...

    def ack_batches(self, batch_ids: Sequence[str], drop: Sequence[tuple[GroupKey, str]]) -> None:
        """Mark delivered batches acknowledged: their groups become consumed (replay candidates), and
        `drop` groups (replay overflow) move to their state. Batches not delivered are left alone."""
        ...

    def requeue_batches(self, batch_ids: Sequence[str]) -> None:
        """Mark delivered batches requeued: their groups are fresh again, to be served in another batch."""
        ...

    def drop_groups(self, drop: Sequence[tuple[GroupKey, str]]) -> None:
        """Move groups to a final state (`stale`, `retired`); their token arrays are deleted, their
        trajectory ids stay (so a late duplicate is still recognised)."""
        ...

    def close(self) -> None: ...
