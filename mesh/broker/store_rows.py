"""What the broker's store backends share: the token payload blob and the mapping of rows to records.

SqliteStore and PostgresStore keep the same columns in the same order, so one set of functions turns
records into row values and rows back into records for both. A trajectory's token arrays are one blob:
tokens int32 | logprobs float32 (raw little-endian) | zstd(versions int32 | loss_mask uint8).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import zstandard

from deltamesh.auth import speaks_for
from deltamesh.data import Trajectory
from deltamesh.mesh.broker.store_interface import (
    LEASE_ID,
    Delivery,
    GroupKey,
    GroupSummary,
    IdConflict,
    Lease,
    LeaseNotHeld,
    StoreConflict,
    StoreSnapshot,
    Submission,
    TaskRecord,
    content_digest,
)

SUMMARY_COLUMNS = ("model_id, group_id, task_id, size, min_version, max_version, reward_min, reward_max, reward_mean, "
                   "seq, state, reason")
"""The columns of a group row that make a GroupSummary, in its field order."""
LEASE_COLUMNS = "lease_no, task_id, epoch, pool, region, model_ids, n_samples, issued_at, deadline, state"
"""The columns of a lease row that make a Lease, in its field order."""
TASK_COLUMNS = "task_id, prompt, metadata, n_samples, model_ids"
TRAJECTORY_COLUMNS = "id, task_id, reward, n_tokens, pool, region, meta, min_version, max_version, payload"
"""The columns of a trajectory row that `trajectory_from_row` reads (with its group's key and size)."""


def pack_submission(trajectories: Sequence[Trajectory],
                    compressor: zstandard.ZstdCompressor | None = None) -> Submission:
    """`trajectories` with their content digests and rows, as a store takes them."""
    compressor = compressor or zstandard.ZstdCompressor(level=1)
    digests = [content_digest(t) for t in trajectories]
    return Submission(trajectories, digests,
                      [trajectory_values(t, pack_payload(t, compressor), d) for t, d in zip(trajectories, digests)])


def submissions(*groups: Sequence[Trajectory]) -> list[Submission]:
    """Each of `groups` as one Submission (for callers of a store outside the broker: tests, tools)."""
    compressor = zstandard.ZstdCompressor(level=1)
    return [pack_submission(g, compressor) for g in groups]


def pack_payload(t: Trajectory, compressor: zstandard.ZstdCompressor) -> bytes:
    # versions and loss_mask are nearly constant along a trajectory: 5 bytes a token shrink to a few dozen
    # bytes in all, a third less to write and sync for 8 us. Tokens and logprobs barely compress; raw.
    def raw(a: np.ndarray, dtype: str) -> memoryview:  # the array's own bytes: joined below with one copy, not two
        return np.ascontiguousarray(a, dtype=dtype).data

    tail = compressor.compress(b"".join((raw(t.versions, "<i4"), raw(t.loss_mask, "u1"))))
    return b"".join((raw(t.tokens, "<i4"), raw(t.logprobs, "<f4"), tail))


def unpack_payload(blob: bytes, n: int, decompressor: zstandard.ZstdDecompressor
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, logprobs, versions, loss_mask) of a stored blob of `n` tokens."""
    tail = decompressor.decompress(blob[8 * n:], max_output_size=5 * n) if len(blob) > 8 * n else b""
    if len(tail) != 5 * n:
        raise ValueError(f"stored payload does not hold {n} tokens")
    return (np.frombuffer(blob, "<i4", n, 0), np.frombuffer(blob, "<f4", n, 4 * n),
            np.frombuffer(tail, "<i4", n, 0), np.frombuffer(tail, "u1", n, 4 * n))


def without_payload(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row of trajectory_values whose payload is dropped (its group was filtered out)."""
    return (*row[:-2], None, row[-1])


def trajectory_values(t: Trajectory, payload: bytes | None, digest: str) -> tuple[Any, ...]:
    """A trajectory's row: id, model_id, group_id, task_id, reward, min_version, max_version, n_tokens,
    pool, region, meta, payload, digest."""
    return (t.id, t.model_id, t.group_id, t.task_id, t.reward, t.min_version, t.max_version, len(t.tokens), t.pool,
            t.region, json.dumps({"timings": t.timings, "metadata": t.metadata}), payload, digest)


def trajectory_from_row(key: GroupKey, size: int, row: Sequence[Any],
                        decompressor: zstandard.ZstdDecompressor) -> Trajectory:
    """The trajectory of a row of TRAJECTORY_COLUMNS in group `key` of `size` samples."""
    tid, task_id, reward, n, pool, region, meta, vmin, vmax, payload = row
    if payload is None:
        raise StoreConflict(f"group {key[1]!r} of {key[0]!r} has no stored tokens (it was dropped)")
    tokens, logprobs, versions, loss_mask = unpack_payload(payload, n, decompressor)
    extra = json.loads(meta)
    return Trajectory(tid, task_id, key[1], size, key[0], tokens, logprobs, loss_mask, versions, reward,
                      pool, region, extra["timings"], extra["metadata"], vmin, vmax)


def lease_values(le: Lease) -> tuple[Any, ...]:
    """A lease's row: lease_no, lease_id, task_id, epoch, pool, region, model_ids, n_samples, issued_at,
    deadline, state."""
    return (le.lease_no, le.lease_id, le.task_id, le.epoch, le.pool, le.region, json.dumps(le.model_ids),
            le.n_samples, le.issued_at, le.deadline, le.state)


def lease_from_row(row: Sequence[Any]) -> Lease:
    """The lease of a row of LEASE_COLUMNS."""
    no, task, epoch, pool, region, mids, n, issued, deadline, state = row
    return Lease(no, task, epoch, pool, region, json.loads(mids), n, issued, deadline, state)


def task_values(t: TaskRecord) -> tuple[Any, ...]:
    """A task's row, in TASK_COLUMNS order."""
    return (t.task_id, json.dumps(t.prompt), json.dumps(t.metadata), t.n_samples,
            None if t.model_ids is None else json.dumps(t.model_ids))


def task_from_row(row: Sequence[Any]) -> TaskRecord:
    """The task of a row of TASK_COLUMNS."""
    task_id, prompt, meta, n, mids = row
    return TaskRecord(task_id, json.loads(prompt), json.loads(meta), n, None if mids is None else json.loads(mids))


def read_snapshot(query: Callable[[str, Sequence[Any]], Iterable[Sequence[Any]]], *, prefix: str, param: str,
                  cursor: tuple[int, int], history_limit: int) -> StoreSnapshot:
    """The StoreSnapshot of a backend: `query(sql, params)` runs a query there, whose tables are named
    `prefix` + models, tasks, leases, groups, batches and whose parameter placeholder is `param`. Where
    the backend keeps its task cursor differs: it is given."""
    models, tasks, leases, groups, batches = (prefix + t for t in ("models", "tasks", "leases", "groups", "batches"))
    cols = SUMMARY_COLUMNS

    def summaries(where: str, params: Sequence[Any] = ()) -> list[GroupSummary]:
        return [GroupSummary(*r) for r in query(f"SELECT {cols} FROM {groups} WHERE {where}", params)]

    history = summaries(f"seq IS NOT NULL ORDER BY seq DESC LIMIT {param}", (history_limit,))
    deliveries = {batch_id: Delivery(batch_id, model_id, []) for batch_id, model_id in query(
        f"SELECT batch_id, model_id FROM {batches} WHERE state = 'delivered' ORDER BY batch_no", ())}
    for batch_id, *summary in query(
            f"SELECT b.batch_id, {', '.join('g.' + c for c in cols.split(', '))} FROM {groups} g "
            f"JOIN {batches} b ON b.batch_no = g.batch_no WHERE g.state = 'delivered' ORDER BY g.seq", ()):
        deliveries[batch_id].groups.append(GroupSummary(*summary))
    return StoreSnapshot(
        models={m: v for m, v in query(f"SELECT model_id, version FROM {models}", ())},
        task_ids=[r[0] for r in query(f"SELECT task_id FROM {tasks} ORDER BY seq", ())],
        cursor=cursor,
        next_lease_no=next(iter(query(f"SELECT COALESCE(MAX(lease_no), 0) + 1 FROM {leases}", ())))[0],
        leases=[lease_from_row(r) for r in query(
            f"SELECT {LEASE_COLUMNS} FROM {leases} WHERE state IN ('active', 'expired') ORDER BY lease_no", ())],
        fresh=summaries("state = 'fresh' ORDER BY seq"),
        replay=summaries("state = 'consumed' ORDER BY batch_no, seq"),
        deliveries=list(deliveries.values()),
        history=history[::-1],
    )


def id_conflict(reused: Sequence[str]) -> IdConflict:
    return IdConflict(f"trajectory id {reused[0]!r} was submitted before with other content "
                      f"({len(reused)} such ids); ids must name one trajectory")


def disagreeing_samples(key: GroupKey) -> StoreConflict:
    return StoreConflict(f"group {key[1]!r} of {key[0]!r}: trajectories disagree on group_size or task_id")


def group_mismatch(key: GroupKey, size: int, task_id: str, sample: Trajectory) -> StoreConflict:
    return StoreConflict(f"group {key[1]!r} of {key[0]!r} has size {size} and task {task_id!r}; "
                         f"got group_size {sample.group_size} and task {sample.task_id!r}")


def group_overflow(key: GroupKey, total: int, size: int) -> StoreConflict:
    return StoreConflict(f"group {key[1]!r} of {key[0]!r} would hold {total} samples; its size is {size}")


def check_lease_holders(new: Sequence[Trajectory], lease_pools: Mapping[str, str]) -> None:
    """LeaseNotHeld unless each of `new` fills a group that no lease names, or one of a lease its pool
    holds (`lease_pools`: lease id -> the pool it was issued to, in any state, for the group ids of
    `new`). A lease's group id is known in advance (`L` + a number), so one not issued yet is refused
    too: a pool cannot fill a group before the lease it belongs to goes to another."""
    for t in new:
        holder = lease_pools.get(t.group_id)
        if holder is None and LEASE_ID.match(t.group_id):
            raise LeaseNotHeld(f"group {t.group_id!r} of {t.model_id!r}: no lease {t.group_id} has been issued; "
                               f"a pool submits for a lease it holds")
        if holder is not None and not speaks_for(t.pool, holder):
            raise LeaseNotHeld(f"group {t.group_id!r} of {t.model_id!r} is lease {t.group_id} of pool {holder!r}; "
                               f"pool {t.pool!r} may not submit for it")
