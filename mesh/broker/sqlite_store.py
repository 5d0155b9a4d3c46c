"""The embedded store of the broker: SQLite in WAL mode, one connection owned by one worker thread.

Durability: an acknowledgement is sent only after COMMIT returns. With `durability = "fsync"`
(synchronous=FULL) a committed transaction survives power loss; with "process" (synchronous=NORMAL)
it survives the broker process being killed (the WAL is in the OS page cache) but not the machine
crashing. The connection runs in EXCLUSIVE locking mode, so SQLite keeps the WAL index in process
memory (no shared-memory file that could fault on a full disk) and a second broker on the same file
fails at start instead of interleaving writes. Token arrays are stored as one blob per trajectory
(store_rows.pack_submission, shared with PostgresStore). Disk full and I/O errors roll the transaction back
and surface as StoreUnavailable.

A served batch is a row of `batches` in state `delivered` until the trainer acknowledges it (`acked`)
or the broker puts its groups back (`requeued`); its fresh groups point at it (`groups.batch_no`) and
keep their token arrays meanwhile, so an unacknowledged batch survives a restart and can be served
again. Schema 1 stores (before acknowledgements) are upgraded in place: their batches count as acked.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import zstandard

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.store_interface import (
    GroupKey,
    GroupSummary,
    GroupVerdict,
    IngestResult,
    Lease,
    StoreConflict,
    StoreSnapshot,
    StoreUnavailable,
    Submission,
    TaskRecord,
)
from deltamesh.mesh.broker.store_rows import (
    TASK_COLUMNS,
    TRAJECTORY_COLUMNS,
    check_lease_holders,
    disagreeing_samples,
    group_mismatch,
    group_overflow,
    id_conflict,
    lease_values,
    read_snapshot,
    task_from_row,
    task_values,
    trajectory_from_row,
)

SCHEMA_VERSION = "3"
_UNAVAILABLE = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY}
_ID_CHUNK = 500  # ids per IN (...) query, well under SQLite's variable limit

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models(model_id TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tasks(seq INTEGER PRIMARY KEY, task_id TEXT UNIQUE NOT NULL, prompt TEXT NOT NULL,
    metadata TEXT NOT NULL, n_samples INTEGER, model_ids TEXT);
CREATE TABLE IF NOT EXISTS leases(lease_no INTEGER PRIMARY KEY, lease_id TEXT UNIQUE NOT NULL,
    task_id TEXT NOT NULL, epoch INTEGER NOT NULL, pool TEXT NOT NULL, region TEXT NOT NULL,
    model_ids TEXT NOT NULL, n_samples INTEGER NOT NULL, issued_at REAL NOT NULL, deadline REAL NOT NULL,
    state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state);
CREATE TABLE IF NOT EXISTS groups(model_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL,
    size INTEGER NOT NULL, count INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
    seq INTEGER, batch_no INTEGER, min_version INTEGER, max_version INTEGER,
    reward_min REAL, reward_max REAL, reward_mean REAL, PRIMARY KEY(model_id, group_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, seq);
CREATE INDEX IF NOT EXISTS groups_group ON groups(group_id);
CREATE TABLE IF NOT EXISTS trajectories(id TEXT PRIMARY KEY, model_id TEXT NOT NULL, group_id TEXT NOT NULL,
    task_id TEXT NOT NULL, reward REAL NOT NULL, min_version INTEGER NOT NULL, max_version INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL, pool TEXT NOT NULL, region TEXT NOT NULL, meta TEXT NOT NULL, payload BLOB,
    digest TEXT);
CREATE INDEX IF NOT EXISTS trajectories_group ON trajectories(model_id, group_id);
CREATE TABLE IF NOT EXISTS batches(batch_no INTEGER PRIMARY KEY, batch_id TEXT UNIQUE NOT NULL,
    model_id TEXT NOT NULL, version INTEGER NOT NULL, served_at REAL NOT NULL, n_groups INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'acked', settled_at REAL);
"""
_UPGRADES = {  # from schema -> statements that bring it to the next one
    "1": ["ALTER TABLE batches ADD COLUMN state TEXT NOT NULL DEFAULT 'acked'",
          "ALTER TABLE batches ADD COLUMN settled_at REAL"],
    # Rows from before have no content digest: a reused id among them still counts as a duplicate.
    "2": ["ALTER TABLE trajectories ADD COLUMN digest TEXT"],
}


class SqliteStore:
    """`BrokerStore` on one SQLite file. Use from a single thread (the broker's store worker)."""

    def __init__(self, path: str | Path, *, durability: str = "fsync", history_limit: int = 100_000):
        self.path = Path(path)
        self.history_limit = history_limit
        self._decompressor = zstandard.ZstdDecompressor()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=2.0)
            # Exclusive mode before WAL: the WAL index then lives in heap memory, not in a -shm mmap.
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA page_size=16384")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if durability == 'fsync' else 'NORMAL'}")
            self._db.execute("PRAGMA wal_autocheckpoint=4096")  # 64 MiB of WAL between checkpoints, not 16
            self._db.execute("PRAGMA temp_store=MEMORY")
            self._db.execute("PRAGMA cache_size=-65536")
            self._db.executescript(SCHEMA)  # idempotent; executescript would commit any open transaction
            with self._transaction():
                row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
                if row is None:
                    self._db.execute("INSERT INTO meta VALUES('schema', ?), ('cursor', '[0, 0]')", (SCHEMA_VERSION,))
                schema = SCHEMA_VERSION if row is None else row[0]
                while schema in _UPGRADES:
                    for statement in _UPGRADES[schema]:
                        self._db.execute(statement)
                    schema = str(int(schema) + 1)
                    self._db.execute("UPDATE meta SET value=? WHERE key='schema'", (schema,))
                if schema != SCHEMA_VERSION:
                    raise StoreUnavailable(f"{self.path} has schema {schema}, this broker needs {SCHEMA_VERSION}")
            self._seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM groups").fetchone()[0]
        except sqlite3.Error as e:
            raise StoreUnavailable(f"cannot open {self.path}: {e}") from e

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            yield
            self._db.execute("COMMIT")
        except BaseException as e:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the failed COMMIT may already have rolled back
            if isinstance(e, sqlite3.Error) and _result_code(e) in _UNAVAILABLE:
                raise StoreUnavailable(f"store unavailable: {e}") from e
            raise

    # ---- start-up -------------------------------------------------------------------------------------

    def load(self) -> StoreSnapshot:
        epoch, position = json.loads(self._db.execute("SELECT value FROM meta WHERE key='cursor'").fetchone()[0])
        return read_snapshot(self._db.execute, prefix="", param="?", cursor=(int(epoch), int(position)),
                             history_limit=self.history_limit)

    def import_tasks(self, tasks: Sequence[TaskRecord]) -> None:
        with self._transaction():
            self._db.executemany(f"INSERT INTO tasks({TASK_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                                 [task_values(t) for t in tasks])

    def set_model_version(self, model_id: str, version: int) -> None:
        with self._transaction():
            self._db.execute("INSERT INTO models VALUES (?, ?) ON CONFLICT(model_id) DO UPDATE SET version=excluded.version",
                             (model_id, version))

    # ---- leases ---------------------------------------------------------------------------------------

    def issue_leases(self, new: Sequence[Lease], reissued: Sequence[str], cursor: tuple[int, int]) -> dict[str, TaskRecord]:
        with self._transaction():
            self._db.executemany(
                "INSERT INTO leases(lease_no, lease_id, task_id, epoch, pool, region, model_ids, n_samples, issued_at, "
                "deadline, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [lease_values(le) for le in new])
            self._db.executemany("UPDATE leases SET state='reissued' WHERE lease_id=?", [(i,) for i in reissued])
            self._db.execute("UPDATE meta SET value=? WHERE key='cursor'", (json.dumps(list(cursor)),))
            tasks = {}
            for task_id in {le.task_id for le in new}:
                tasks[task_id] = task_from_row(self._db.execute(
                    f"SELECT {TASK_COLUMNS} FROM tasks WHERE task_id=?", (task_id,)).fetchone())
        return tasks

    def expire_leases(self, lease_ids: Sequence[str]) -> list[str]:
        expired = []
        with self._transaction():
            for lid in lease_ids:
                if self._db.execute("UPDATE leases SET state='expired' WHERE lease_id=? AND state='active'", (lid,)).rowcount:
                    expired.append(lid)
        return expired

    # ---- trajectories ---------------------------------------------------------------------------------

    def ingest(self, submissions: Sequence[Submission], verdict: GroupVerdict) -> list[IngestResult | StoreConflict]:
        results: list[IngestResult | StoreConflict] = []
        with self._transaction():
            for submission in submissions:
                self._db.execute("SAVEPOINT submission")
                try:
                    results.append(self._ingest_one(submission, verdict))
                except StoreConflict as e:
                    self._db.execute("ROLLBACK TO submission")
                    results.append(e)
                self._db.execute("RELEASE submission")
        return results

    def _ingest_one(self, submission: Submission, verdict: GroupVerdict) -> IngestResult:
        db, trajectories = self._db, submission.trajectories
        ids = [t.id for t in trajectories]
        digests = dict(zip(ids, submission.digests))
        rows = dict(zip(ids, submission.rows))
        existing: dict[str, str | None] = {}
        for i in range(0, len(ids), _ID_CHUNK):
            chunk = ids[i:i + _ID_CHUNK]
            existing.update(db.execute(
                f"SELECT id, digest FROM trajectories WHERE id IN ({','.join('?' * len(chunk))})", chunk))
        reused = [i for i, d in existing.items() if d is not None and d != digests[i]]
        if reused:
            raise id_conflict(reused)
        new = [t for t in trajectories if t.id not in existing]
        group_ids = list(dict.fromkeys(t.group_id for t in new))
        lease_pools: dict[str, str] = {}
        for i in range(0, len(group_ids), _ID_CHUNK):
            chunk = group_ids[i:i + _ID_CHUNK]
            lease_pools.update(db.execute(
                f"SELECT lease_id, pool FROM leases WHERE lease_id IN ({','.join('?' * len(chunk))})", chunk))
        check_lease_holders(new, lease_pools)
        db.executemany(
            "INSERT INTO trajectories VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [rows[t.id] for t in new])
        result = IngestResult(accepted=len(new), duplicates=len(existing),
                              accepted_by_model=dict(Counter(t.model_id for t in new)))
        first: dict[GroupKey, Trajectory] = {}
        counts: Counter[GroupKey] = Counter()
        for t in new:
            key = (t.model_id, t.group_id)
            seen = first.setdefault(key, t)
            if (seen.group_size, seen.task_id) != (t.group_size, t.task_id):
                raise disagreeing_samples(key)
            counts[key] += 1
        for key, added in counts.items():
            summary = self._add_to_group(key, first[key], added, verdict)
            if summary is not None:
                result.completed.append(summary)
        for group_id in {s.group_id for s in result.completed}:
            if self._finish_lease(group_id):
                result.done_leases.append(group_id)
        return result

    def _add_to_group(self, key: GroupKey, sample: Trajectory, added: int, verdict: GroupVerdict) -> GroupSummary | None:
        db = self._db
        row = db.execute("SELECT size, count, task_id FROM groups WHERE model_id=? AND group_id=?", key).fetchone()
        size, count = (sample.group_size, 0) if row is None else (row[0], row[1])
        if row is not None and (size, row[2]) != (sample.group_size, sample.task_id):
            raise group_mismatch(key, size, row[2], sample)
        if count + added > size:
            raise group_overflow(key, count + added, size)
        if row is None:
            db.execute("INSERT INTO groups(model_id, group_id, task_id, size, count, state) VALUES (?, ?, ?, ?, ?, 'open')",
                       (*key, sample.task_id, size, added))
        else:
            db.execute("UPDATE groups SET count=? WHERE model_id=? AND group_id=?", (count + added, *key))
        if count + added < size:
            return None
        agg = db.execute("SELECT MIN(min_version), MAX(max_version), MIN(reward), MAX(reward), AVG(reward) "
                         "FROM trajectories WHERE model_id=? AND group_id=?", key).fetchone()
        self._seq += 1
        summary = GroupSummary(key[0], key[1], sample.task_id, size, *agg, seq=self._seq)
        reason = verdict(summary)
        if reason is not None:
            summary.state, summary.reason = "filtered", reason
            db.execute("UPDATE trajectories SET payload=NULL WHERE model_id=? AND group_id=?", key)
        db.execute("UPDATE groups SET state=?, reason=?, seq=?, min_version=?, max_version=?, reward_min=?, reward_max=?, "
                   "reward_mean=? WHERE model_id=? AND group_id=?",
                   (summary.state, summary.reason, summary.seq, *agg, *key))
        return summary

    def _finish_lease(self, group_id: str) -> bool:
        """Mark the lease behind `group_id` done once every model it asked for has a complete group."""
        row = self._db.execute("SELECT model_ids FROM leases WHERE lease_id=? AND state IN ('active', 'expired')",
                               (group_id,)).fetchone()
        if row is None:
            return False
        complete = {r[0] for r in self._db.execute(
            "SELECT model_id FROM groups WHERE group_id=? AND seq IS NOT NULL", (group_id,))}
        if not set(json.loads(row[0])) <= complete:
            return False
        self._db.execute("UPDATE leases SET state='done' WHERE lease_id=?", (group_id,))
        return True

    # ---- batches --------------------------------------------------------------------------------------

    def take_batch(self, batch_id: str, model_id: str, version: int, fresh: Sequence[GroupKey],
                   replay: Sequence[GroupKey], drop: Sequence[tuple[GroupKey, str]]) -> list[Trajectory]:
        out: list[Trajectory] = []
        with self._transaction():
            batch_no = self._db.execute(
                "INSERT INTO batches(batch_id, model_id, version, served_at, n_groups, state) "
                "VALUES (?, ?, ?, ?, ?, 'delivered')",
                (batch_id, model_id, version, time.time(), len(fresh) + len(replay))).lastrowid
            self._db.executemany("UPDATE groups SET state='delivered', batch_no=? WHERE model_id=? AND group_id=?",
                                 [(batch_no, *key) for key in fresh])
            for key in [*replay, *fresh]:
                out.extend(self._group_trajectories(key))
            self._drop(drop)  # after reading: served groups may be retired by this very batch
        return out

    def _group_trajectories(self, key: GroupKey) -> list[Trajectory]:
        size = self._db.execute("SELECT size FROM groups WHERE model_id=? AND group_id=?", key).fetchone()[0]
        return [trajectory_from_row(key, size, row, self._decompressor) for row in self._db.execute(
            f"SELECT {TRAJECTORY_COLUMNS} FROM trajectories WHERE model_id=? AND group_id=? ORDER BY rowid", key)]

    def batch_states(self, model_id: str, batch_ids: Sequence[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        ids = list(dict.fromkeys(batch_ids))
        for i in range(0, len(ids), _ID_CHUNK):
            chunk = ids[i:i + _ID_CHUNK]
            out.update(self._db.execute(
                f"SELECT batch_id, state FROM batches WHERE model_id=? AND batch_id IN ({','.join('?' * len(chunk))})",
                [model_id, *chunk]))
        return out

    def ack_batches(self, batch_ids: Sequence[str], drop: Sequence[tuple[GroupKey, str]]) -> None:
        with self._transaction():
            self._settle(batch_ids, "acked", "consumed")
            self._drop(drop)  # after settling: an acknowledged group may retire at once (replay full or off)

    def requeue_batches(self, batch_ids: Sequence[str]) -> None:
        with self._transaction():
            self._settle(batch_ids, "requeued", "fresh")

    def _settle(self, batch_ids: Sequence[str], batch_state: str, group_state: str) -> None:
        """Move delivered batches to `batch_state` and their delivered groups to `group_state`."""
        now = time.time()
        for batch_id in batch_ids:
            row = self._db.execute("SELECT batch_no FROM batches WHERE batch_id=? AND state='delivered'",
                                   (batch_id,)).fetchone()
            if row is None:
                continue
            self._db.execute("UPDATE batches SET state=?, settled_at=? WHERE batch_no=?", (batch_state, now, row[0]))
            # A consumed group keeps its batch (replay is ordered by it); a requeued one forgets it.
            batch_no = row[0] if group_state == "consumed" else None
            self._db.execute("UPDATE groups SET state=?, batch_no=? WHERE batch_no=? AND state='delivered'",
                             (group_state, batch_no, row[0]))

    def drop_groups(self, drop: Sequence[tuple[GroupKey, str]]) -> None:
        with self._transaction():
            self._drop(drop)

    def _drop(self, drop: Sequence[tuple[GroupKey, str]]) -> None:
        self._db.executemany("UPDATE groups SET state=? WHERE model_id=? AND group_id=?", [(st, *k) for k, st in drop])
        self._db.executemany("UPDATE trajectories SET payload=NULL WHERE model_id=? AND group_id=?", [k for k, _ in drop])


def _result_code(e: sqlite3.Error) -> int:
    """The primary SQLite result code of an error (Python 3.11+ carries it; 3.10 only says it in text)."""
    if sys.version_info >= (3, 11):
        return e.sqlite_errorcode & 0xFF
    text = str(e).lower()  # pragma: no cover - Python 3.10
    return sqlite3.SQLITE_FULL if "full" in text else sqlite3.SQLITE_IOERR if "i/o" in text else 0
