"""A group commit decided in memory: which submissions are accepted and what each one writes.

PostgresStore reads what a commit's submissions touch in one round trip (a `StoredState`), decides
here which submissions are accepted, then writes the outcome in bulk, instead of a savepoint and a
dozen statements per submission. The rules are SqliteStore's, which applies them with SQL as it goes:
submissions are taken in order, each seeing what the ones before it stored, each all-or-nothing (a
conflict leaves `state` as it was); an id stored with the same content is a duplicate, with other
content an IdConflict; a lease's group takes samples only from the pool holding the lease (LeaseNotHeld); a group takes at most its size in samples, completes at exactly that, and is
then summarised, numbered (`seq`) and judged by the verdict; a lease is done once every model it asked
for has a complete group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.store_interface import (
    GroupKey,
    GroupSummary,
    GroupVerdict,
    IngestResult,
    StoreConflict,
    Submission,
)
from deltamesh.mesh.broker.store_rows import (
    check_lease_holders,
    disagreeing_samples,
    group_mismatch,
    group_overflow,
    id_conflict,
)


@dataclass
class StoredGroup:
    """A group as stored: its count so far and, while incomplete, the aggregates of its samples."""

    task_id: str
    size: int
    count: int
    complete: bool
    in_database: bool  # stored before this commit (its earlier samples' payloads are rows already)
    min_version: int | None = None
    max_version: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    reward_sum: float = 0.0

    def extended(self, samples: Sequence[Trajectory]) -> StoredGroup:
        def low(a: float | None, b: float) -> float:
            return b if a is None else min(a, b)

        def high(a: float | None, b: float) -> float:
            return b if a is None else max(a, b)

        out = replace(self, count=self.count + len(samples))
        for t in samples:
            out.min_version = int(low(out.min_version, t.min_version))
            out.max_version = int(high(out.max_version, t.max_version))
            reward = float(t.reward)
            out.reward_min, out.reward_max = low(out.reward_min, reward), high(out.reward_max, reward)
            out.reward_sum += reward
        out.complete = out.count == out.size
        return out


@dataclass
class StoredState:
    """What the database holds of the ids, groups and leases a commit touches."""

    digests: dict[str, str | None]  # stored trajectory id -> content digest (None: stored before digests)
    groups: dict[GroupKey, StoredGroup]
    open_leases: dict[str, list[str]]  # active or expired lease id -> the model ids it asked for
    complete: dict[str, set[str]]  # group id -> the model ids whose group of that id is complete
    seq: int  # the highest completion number so far
    lease_pools: dict[str, str] = field(default_factory=dict)  # lease id (any state) -> the pool it went to


@dataclass
class CommitPlan:
    """The outcome of one group commit, in the order submissions came."""

    results: list[IngestResult | StoreConflict] = field(default_factory=list)
    trajectories: list[tuple[Trajectory, str, tuple]] = field(default_factory=list)  # new ones: digest, row
    groups: dict[GroupKey, StoredGroup] = field(default_factory=dict)  # every group changed: its new row
    summaries: dict[GroupKey, GroupSummary] = field(default_factory=dict)  # groups completed in this commit
    done_leases: list[str] = field(default_factory=list)

    def filtered(self) -> set[GroupKey]:
        """Groups a filter dropped in this commit: their token payloads are not kept."""
        return {k for k, s in self.summaries.items() if s.state == "filtered"}


@dataclass
class Accepted:
    """What one accepted submission stores."""

    result: IngestResult
    new: list[tuple[Trajectory, str, tuple]]  # its new trajectories, with their digests and rows
    groups: dict[GroupKey, StoredGroup]  # the groups it changed: their new rows
    summaries: dict[GroupKey, GroupSummary]  # the groups it completed


def plan_commit(submissions: Sequence[Submission], state: StoredState, verdict: GroupVerdict) -> CommitPlan:
    """Decide every submission of a commit against `state`, which is updated with the accepted ones."""
    plan = CommitPlan()
    for submission in submissions:
        try:
            one = _plan_one(submission, state, verdict)
        except StoreConflict as e:
            plan.results.append(e)
            continue
        plan.results.append(one.result)
        plan.trajectories += one.new
        plan.groups.update(one.groups)
        plan.summaries.update(one.summaries)
        plan.done_leases += one.result.done_leases
        state.digests.update((t.id, d) for t, d, _ in one.new)
        state.groups.update(one.groups)
        for s in one.summaries.values():
            state.complete.setdefault(s.group_id, set()).add(s.model_id)
            state.seq = max(state.seq, s.seq)
        for lease_id in one.result.done_leases:
            del state.open_leases[lease_id]
    return plan


def _plan_one(submission: Submission, state: StoredState, verdict: GroupVerdict) -> Accepted:
    """One submission against `state` (left unchanged); StoreConflict when it cannot be stored."""
    trajectories = submission.trajectories
    digests = {t.id: d for t, d in zip(trajectories, submission.digests)}
    if len(digests) != len(trajectories):
        raise StoreConflict("a submission lists the same trajectory id twice")
    existing = {i: state.digests[i] for i in digests if i in state.digests}
    reused = [i for i, d in existing.items() if d is not None and d != digests[i]]
    if reused:
        raise id_conflict(reused)
    new = [t for t in trajectories if t.id not in existing]
    check_lease_holders(new, state.lease_pools)
    samples: dict[GroupKey, list[Trajectory]] = {}
    for t in new:
        key = (t.model_id, t.group_id)
        seen = samples.setdefault(key, [t])
        if seen[0] is not t:
            if (seen[0].group_size, seen[0].task_id) != (t.group_size, t.task_id):
                raise disagreeing_samples(key)
            seen.append(t)
    result = IngestResult(accepted=len(new), duplicates=len(existing),
                          accepted_by_model=dict(Counter(t.model_id for t in new)))
    groups: dict[GroupKey, StoredGroup] = {}
    summaries: dict[GroupKey, GroupSummary] = {}
    seq = state.seq
    for key, added in samples.items():
        sample = added[0]
        stored = state.groups.get(key)
        if stored is None:
            stored = StoredGroup(sample.task_id, sample.group_size, 0, False, in_database=False)
        elif (stored.size, stored.task_id) != (sample.group_size, sample.task_id):
            raise group_mismatch(key, stored.size, stored.task_id, sample)
        if stored.count + len(added) > stored.size:
            raise group_overflow(key, stored.count + len(added), stored.size)
        group = groups[key] = stored.extended(added)
        if not group.complete:
            continue
        seq += 1
        summary = GroupSummary(key[0], key[1], sample.task_id, group.size, group.min_version, group.max_version,
                               group.reward_min, group.reward_max, group.reward_sum / group.size, seq=seq)
        reason = verdict(summary)
        if reason is not None:
            summary.state, summary.reason = "filtered", reason
        summaries[key] = summary
        result.completed.append(summary)
    for group_id in dict.fromkeys(s.group_id for s in result.completed):
        models = state.open_leases.get(group_id)
        complete = state.complete.get(group_id, set()) | {m for m, g in summaries if g == group_id}
        if models is not None and set(models) <= complete:
            result.done_leases.append(group_id)
    rows = {t.id: r for t, r in zip(trajectories, submission.rows)}
    return Accepted(result, [(t, digests[t.id], rows[t.id]) for t in new], groups, summaries)
