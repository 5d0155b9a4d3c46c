"""The broker's store on a PostgreSQL server: the same records and semantics as SqliteStore.

One connection, used only from the broker's store worker thread. Every method is one transaction;
an acknowledgement is sent only after COMMIT returns, with `synchronous_commit = on` (durability
"fsync": the commit is flushed to the server's WAL, and to a synchronous replica where the server has
one) or `off` (durability "process": a killed broker loses nothing, a crashed server the last moments).
A group commit (`ingest`) reads what its submissions touch in one pipelined round trip, decides them
in memory (ingest_plan.py: each submission all-or-nothing, in order), then writes the accepted ones
with one binary COPY and one pipelined batch of updates. Payload blobs are SqliteStore's, packed
before the commit (store_rows.pack_submission).

Groups just committed stay in memory until a batch takes them (recent_groups.py), so a batch reads
back from the server only what this store did not commit itself.

Fencing: a store opened with a `LeaderTerm` starts every write transaction by locking the leadership
row `FOR SHARE` where it still names that holder and epoch and has not expired; with no such row it
rolls back and raises NotLeader. A takeover's UPDATE of that row waits for the share locks, so each
commit lands either before the takeover or not at all. Reads (`load`, `batch_states`) are not fenced.
Without a term nothing stops two brokers from writing one database; `deltamesh broker` on PostgreSQL
always runs with one (leadership.py).

A lost connection, a server restarting, a full disk or a read-only server is StoreUnavailable, with
nothing changed; the next call reconnects, so the broker recovers by itself once the server is back.
An idle transaction is cut off after 5 s, so a paused broker cannot hold locks for longer.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

import psycopg
import zstandard
from psycopg import conninfo
from psycopg.pq import TransactionStatus

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.ingest_plan import CommitPlan, StoredGroup, StoredState, plan_commit
from deltamesh.mesh.broker.postgres_schema import UNAVAILABLE, apply_migrations
from deltamesh.mesh.broker.recent_groups import DEFAULT_BUDGET_BYTES, RecentGroups
from deltamesh.mesh.broker.store_interface import (
    GroupKey,
    GroupVerdict,
    IngestResult,
    LeaderTerm,
    Lease,
    NotLeader,
    StoreConflict,
    StoreSnapshot,
    StoreUnavailable,
    Submission,
    TaskRecord,
)
from deltamesh.mesh.broker.store_rows import (
    TASK_COLUMNS,
    TRAJECTORY_COLUMNS,
    lease_values,
    read_snapshot,
    task_from_row,
    task_values,
    trajectory_from_row,
    without_payload,
)

T = TypeVar("T")
IDLE_IN_TRANSACTION_TIMEOUT = "5s"
CONNECT = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3}
"""A server that vanished without closing the connection is noticed in about 20 s, not hours."""

_FENCE = ("SELECT 1 FROM broker_leader WHERE id = 1 AND holder = %s AND epoch = %s AND expires_at > clock_timestamp() "
          "FOR SHARE")
_TRAJECTORY_INSERT = ("COPY broker_trajectories (id, model_id, group_id, task_id, reward, min_version, max_version, "
                      "n_tokens, pool, region, meta, payload, digest) FROM STDIN (FORMAT BINARY)")
_TRAJECTORY_TYPES = ["text", "text", "text", "text", "float8", "int8", "int8", "int4", "text", "text", "text", "bytea",
                     "text"]
_KEYS = "unnest(%s::text[], %s::text[]) WITH ORDINALITY AS k(model_id, group_id, n)"
_STORED_GROUPS = f"""
SELECT g.model_id, g.group_id, g.task_id, g.size, g.count, g.seq IS NOT NULL, a.*
FROM {_KEYS} JOIN broker_groups g ON g.model_id = k.model_id AND g.group_id = k.group_id
LEFT JOIN LATERAL (SELECT MIN(t.min_version), MAX(t.max_version), MIN(t.reward), MAX(t.reward), COALESCE(SUM(t.reward), 0)
                   FROM broker_trajectories t
                   WHERE g.seq IS NULL AND t.model_id = g.model_id AND t.group_id = g.group_id) a ON true
"""
_GROUP_WRITE = """
INSERT INTO broker_groups (model_id, group_id, task_id, size, count, state, reason, seq, min_version, max_version,
                           reward_min, reward_max, reward_mean)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (model_id, group_id) DO UPDATE SET count = excluded.count, state = excluded.state, reason = excluded.reason,
    seq = excluded.seq, min_version = excluded.min_version, max_version = excluded.max_version,
    reward_min = excluded.reward_min, reward_max = excluded.reward_max, reward_mean = excluded.reward_mean
"""
_GROUP_TRAJECTORIES = f"""
SELECT g.model_id, g.group_id, g.size, {', '.join('t.' + c for c in TRAJECTORY_COLUMNS.split(', '))}
FROM {_KEYS} JOIN broker_groups g ON g.model_id = k.model_id AND g.group_id = k.group_id
JOIN broker_trajectories t ON t.model_id = k.model_id AND t.group_id = k.group_id
ORDER BY k.n, t.ord
"""
_SETTLE = """
WITH b AS (UPDATE broker_batches SET state = %s, settled_at = %s WHERE batch_id = ANY(%s) AND state = 'delivered'
           RETURNING batch_no)
UPDATE broker_groups g SET state = %s, batch_no = CASE WHEN %s THEN g.batch_no END
FROM b WHERE g.batch_no = b.batch_no AND g.state = 'delivered'
"""


def _columns(keys: Sequence[GroupKey]) -> tuple[list[str], list[str]]:
    """(model ids, group ids) of `keys`: the two arrays an unnest of keys takes."""
    return [k[0] for k in keys], [k[1] for k in keys]


class PostgresStore:
    """`BrokerStore` on a PostgreSQL database (see the module docstring). Use from a single thread."""

    def __init__(self, dsn: str, *, durability: str = "fsync", term: LeaderTerm | None = None,
                 history_limit: int = 100_000, recent_bytes: int = DEFAULT_BUDGET_BYTES):
        self.dsn = dsn
        self.term = term
        self.history_limit = history_limit
        self._synchronous_commit = "on" if durability == "fsync" else "off"
        self._decompressor = zstandard.ZstdDecompressor()
        self._recent = RecentGroups(recent_bytes)
        self._conn: psycopg.Connection | None = None
        with self._errors("cannot open the broker's database"):
            apply_migrations(self._connection())

    def close(self) -> None:
        self._disconnect()

    # ---- connection, errors, fencing -------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._disconnect()
            given = conninfo.conninfo_to_dict(self.dsn)  # the URL's own settings win over our defaults
            conn = psycopg.connect(self.dsn, autocommit=True, **{k: v for k, v in CONNECT.items() if k not in given})
            conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false), "
                         "set_config('synchronous_commit', %s, false)",
                         (IDLE_IN_TRANSACTION_TIMEOUT, self._synchronous_commit))
            self._conn = conn
        return self._conn

    def _disconnect(self) -> None:
        # A commit cut off may have landed or not: what memory holds of its groups could be half of one.
        self._recent.clear()
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass  # a broken connection: closing it is all that was left to do
            self._conn = None

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except UNAVAILABLE as e:
            self._disconnect()  # whatever state it is in, the next call starts on a fresh connection
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise StoreUnavailable(f"{doing}: {reason}") from e

    @contextmanager
    def _read(self) -> Iterator[psycopg.Connection]:
        """One consistent snapshot of the database, even while another broker writes."""
        with self._errors("reading the broker's database failed"):
            conn = self._connection()
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                yield conn

    @contextmanager
    def _write(self, queue_first: Callable[[psycopg.Connection], T]) -> Iterator[tuple[psycopg.Connection, T]]:
        """A write transaction: yields the connection and what `queue_first` returned (its cursors), and
        commits when the block ends, unless the block queued COMMIT itself with its last statements.

        BEGIN, the fence (when this store holds a term) and the statements `queue_first` queues go in one
        round trip (pipeline mode), and the fence's answer is checked before the block runs: whatever ran
        after it is rolled back with the rest when the lease is lost. The transaction is spelled out, not
        psycopg's, whose BEGIN would take a round trip of its own.
        """
        with self._errors("the commit did not complete"):
            conn, term = self._connection(), self.term
            try:
                with conn.pipeline():
                    conn.execute("BEGIN")
                    fence = None if term is None else conn.execute(_FENCE, (term.holder, term.epoch))
                    queued = queue_first(conn)
                if term is not None and fence is not None and fence.fetchone() is None:
                    raise NotLeader(f"this broker no longer holds the leadership lease (epoch {term.epoch}); "
                                    "nothing was written")
                yield conn, queued
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.execute("COMMIT")
            except BaseException:
                if not conn.broken and not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
                    try:
                        conn.execute("ROLLBACK")
                    except psycopg.Error:
                        pass  # the connection is gone, and the transaction with it
                raise

    def _transact(self, queue: Callable[[psycopg.Connection], T]) -> T:
        """The statements `queue` queues as one write transaction: two round trips in all."""
        with self._write(queue) as (_, queued):
            return queued

    # ---- start-up -------------------------------------------------------------------------------------

    def load(self) -> StoreSnapshot:
        with self._read() as db:
            epoch, position = db.execute("SELECT epoch, position FROM broker_cursor WHERE id = 1").fetchone()
            return read_snapshot(db.execute, prefix="broker_", param="%s", cursor=(int(epoch), int(position)),
                                 history_limit=self.history_limit)

    def import_tasks(self, tasks: Sequence[TaskRecord]) -> None:
        self._transact(lambda db: db.cursor().executemany(
            f"INSERT INTO broker_tasks ({TASK_COLUMNS}) VALUES (%s, %s, %s, %s, %s)", [task_values(t) for t in tasks]))

    def set_model_version(self, model_id: str, version: int) -> None:
        self._transact(lambda db: db.execute("INSERT INTO broker_models VALUES (%s, %s) ON CONFLICT (model_id) "
                                             "DO UPDATE SET version = excluded.version", (model_id, version)))

    # ---- leases ---------------------------------------------------------------------------------------

    def issue_leases(self, new: Sequence[Lease], reissued: Sequence[str], cursor: tuple[int, int]) -> dict[str, TaskRecord]:
        def issue(db: psycopg.Connection) -> psycopg.Cursor:
            db.cursor().executemany(
                "INSERT INTO broker_leases (lease_no, lease_id, task_id, epoch, pool, region, model_ids, n_samples, "
                "issued_at, deadline, state) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [lease_values(le) for le in new])
            db.execute("UPDATE broker_leases SET state = 'reissued' WHERE lease_id = ANY(%s)", (list(reissued),))
            db.execute("UPDATE broker_cursor SET epoch = %s, position = %s WHERE id = 1", cursor)
            return db.execute(f"SELECT {TASK_COLUMNS} FROM broker_tasks WHERE task_id = ANY(%s)",
                              (list({le.task_id for le in new}),))

        return {row[0]: task_from_row(row) for row in self._transact(issue)}

    def expire_leases(self, lease_ids: Sequence[str]) -> list[str]:
        expired = {r[0] for r in self._transact(lambda db: db.execute(
            "UPDATE broker_leases SET state = 'expired' WHERE lease_id = ANY(%s) AND state = 'active' RETURNING lease_id",
            (list(lease_ids),)))}
        return [lid for lid in dict.fromkeys(lease_ids) if lid in expired]

    # ---- trajectories ---------------------------------------------------------------------------------

    def ingest(self, submissions: Sequence[Submission], verdict: GroupVerdict) -> list[IngestResult | StoreConflict]:
        stored = _StoredStateQuery(submissions)
        try:
            with self._write(stored.queue) as (db, _):  # the reads share the round trip of BEGIN and the fence
                plan = plan_commit(submissions, stored.result(), verdict)
                self._write_plan(db, plan)
        except BaseException:
            self._recent.discard(stored.keys)
            raise
        self._remember(plan)
        return plan.results

    def _remember(self, plan: CommitPlan) -> None:
        filtered = plan.filtered()
        self._recent.discard(filtered)
        samples: dict[GroupKey, list[Trajectory]] = {}
        for t, _, _ in plan.trajectories:
            samples.setdefault((t.model_id, t.group_id), []).append(t)
        for key, added in samples.items():
            if key not in filtered:
                self._recent.committed(key, added, new_group=not plan.groups[key].in_database)

    def _write_plan(self, db: psycopg.Connection, plan: CommitPlan) -> None:
        """The accepted submissions: one binary COPY of their trajectories, then the group rows, dropped
        payloads and finished leases pipelined with COMMIT."""
        filtered = plan.filtered()
        cur = db.cursor()
        if plan.trajectories:
            with cur.copy(_TRAJECTORY_INSERT) as copy:
                copy.set_types(_TRAJECTORY_TYPES)
                for t, _, row in plan.trajectories:
                    copy.write_row(row if (t.model_id, t.group_id) not in filtered else without_payload(row))
        rows = []
        for key, g in plan.groups.items():
            s = plan.summaries.get(key)
            done = (s.state, s.reason, s.seq, s.min_version, s.max_version, s.reward_min, s.reward_max, s.reward_mean) \
                if s is not None else ("open", "", None, None, None, None, None, None)
            rows.append((*key, g.task_id, g.size, g.count, *done))
        dropped = [k for k in filtered if plan.groups[k].in_database]  # samples stored by earlier commits
        with db.pipeline():
            cur.executemany(_GROUP_WRITE, rows)
            if dropped:
                self._forget_payloads(db, dropped)
            if plan.done_leases:
                db.execute("UPDATE broker_leases SET state = 'done' WHERE lease_id = ANY(%s)", (plan.done_leases,))
            db.execute("COMMIT")

    # ---- batches --------------------------------------------------------------------------------------

    def take_batch(self, batch_id: str, model_id: str, version: int, fresh: Sequence[GroupKey],
                   replay: Sequence[GroupKey], drop: Sequence[tuple[GroupKey, str]]) -> list[Trajectory]:
        keys = [*replay, *fresh]
        held = {k: g for k in keys if (g := self._recent.get(k)) is not None}
        missing = [k for k in keys if k not in held]

        def deliver(db: psycopg.Connection) -> psycopg.Cursor:
            db.execute("INSERT INTO broker_batches (batch_id, model_id, version, served_at, n_groups, state) "
                       "VALUES (%s, %s, %s, %s, %s, 'delivered')",
                       (batch_id, model_id, version, time.time(), len(fresh) + len(replay)))
            db.execute("UPDATE broker_groups g SET state = 'delivered', batch_no = "
                       "(SELECT batch_no FROM broker_batches WHERE batch_id = %s) "
                       f"FROM {_KEYS} WHERE g.model_id = k.model_id AND g.group_id = k.group_id",
                       (batch_id, *_columns(fresh)))
            # binary: payloads arrive as raw bytes, not as hex text to decode
            return db.cursor(binary=True).execute(_GROUP_TRAJECTORIES, _columns(missing))

        with self._write(deliver) as (db, served):
            read: dict[GroupKey, list[Trajectory]] = {}
            for m, g, size, *row in served:
                read.setdefault((m, g), []).append(trajectory_from_row((m, g), size, row, self._decompressor))
            with db.pipeline():
                self._drop(db, drop)  # after reading: served groups may be retired by this very batch
                db.execute("COMMIT")
        self._recent.discard(keys)  # delivered: a delivery again (requeued, replayed) reads the database
        return [t for k in keys for t in held.get(k) or read.get(k, [])]

    def batch_states(self, model_id: str, batch_ids: Sequence[str]) -> dict[str, str]:
        with self._errors("reading the broker's database failed"):  # one statement: no transaction needed
            return dict(self._connection().execute(
                "SELECT batch_id, state FROM broker_batches WHERE model_id = %s AND batch_id = ANY(%s)",
                (model_id, list(batch_ids))).fetchall())

    def ack_batches(self, batch_ids: Sequence[str], drop: Sequence[tuple[GroupKey, str]]) -> None:
        def settle(db: psycopg.Connection) -> None:  # a consumed group keeps its batch (replay is ordered by it)
            db.execute(_SETTLE, ("acked", time.time(), list(batch_ids), "consumed", True))
            self._drop(db, drop)  # after settling: an acknowledged group may retire at once (replay full or off)

        self._transact(settle)

    def requeue_batches(self, batch_ids: Sequence[str]) -> None:
        self._transact(lambda db: db.execute(_SETTLE, ("requeued", time.time(), list(batch_ids), "fresh", False)))

    def drop_groups(self, drop: Sequence[tuple[GroupKey, str]]) -> None:
        self._transact(lambda db: self._drop(db, drop))

    def _drop(self, db: psycopg.Connection, drop: Sequence[tuple[GroupKey, str]]) -> None:
        self._recent.discard(k for k, _ in drop)  # before the write: whether or not it lands, none is served
        if drop:
            db.cursor().executemany("UPDATE broker_groups SET state = %s WHERE model_id = %s AND group_id = %s",
                                    [(st, *k) for k, st in drop])
            self._forget_payloads(db, [k for k, _ in drop])

    @staticmethod
    def _forget_payloads(db: psycopg.Connection, keys: Sequence[GroupKey]) -> None:
        db.execute("UPDATE broker_trajectories t SET payload = NULL "
                   f"FROM {_KEYS} WHERE t.model_id = k.model_id AND t.group_id = k.group_id AND t.payload IS NOT NULL",
                   _columns(keys))


class _StoredStateQuery:
    """The reads of a commit's StoredState: everything its submissions name, queued in one pipeline."""

    def __init__(self, submissions: Sequence[Submission]):
        self.ids = [t.id for s in submissions for t in s.trajectories]
        self.keys = list(dict.fromkeys((t.model_id, t.group_id) for s in submissions for t in s.trajectories))
        self.group_ids = list(dict.fromkeys(k[1] for k in self.keys))
        self._cursors: tuple[psycopg.Cursor, ...] = ()

    def queue(self, db: psycopg.Connection) -> None:
        self._cursors = (
            db.execute("SELECT id, digest FROM broker_trajectories WHERE id = ANY(%s)", (self.ids,)),
            db.execute(_STORED_GROUPS, _columns(self.keys)),
            db.execute("SELECT lease_id, model_ids, pool, state FROM broker_leases WHERE lease_id = ANY(%s)",
                       (self.group_ids,)),
            db.execute("SELECT group_id, model_id FROM broker_groups WHERE group_id = ANY(%s) AND seq IS NOT NULL",
                       (self.group_ids,)),
            db.execute("SELECT COALESCE(MAX(seq), 0) FROM broker_groups"),
        )

    def result(self) -> StoredState:
        digests, groups, leases, complete, seq = self._cursors
        rows = leases.fetchall()
        state = StoredState(dict(digests.fetchall()), {},
                            {lid: json.loads(m) for lid, m, _, st in rows if st in ("active", "expired")}, {},
                            seq.fetchone()[0], {lid: pool for lid, _, pool, _ in rows})
        for model_id, group_id, task_id, size, count, done, vmin, vmax, rmin, rmax, rsum in groups:
            state.groups[model_id, group_id] = StoredGroup(task_id, size, count, done, True, vmin, vmax, rmin, rmax, rsum)
        for group_id, model_id in complete:
            state.complete.setdefault(group_id, set()).add(model_id)
        return state
