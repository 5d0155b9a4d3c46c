"""What only the PostgreSQL store has: its schema migrations, fencing by the leadership lease, and
riding out a server that stops mid-burst (tests/broker/test_store.py has the semantics both share).

Every test gets an empty database of its own on the session's throwaway cluster (`postgres_dsn`).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from deltamesh.mesh.broker.backends import is_postgres, open_store
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.postgres_schema import SCHEMA_VERSION, SchemaTooNew, migrate
from deltamesh.mesh.broker.postgres_store import PostgresStore
from deltamesh.mesh.broker.store_interface import LeaderTerm, Lease, NotLeader, StoreUnavailable, TaskRecord
from deltamesh.mesh.broker.store_rows import submissions
from deltamesh.mesh.cli import main


def keep(summary):
    return None


def query(dsn: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def test_migration_creates_the_schema_once_and_the_command_says_so(postgres_dsn, capsys):
    assert main(["broker", "migrate", "--db", postgres_dsn]) == 0
    assert capsys.readouterr().out == f"broker schema: version 0 -> {SCHEMA_VERSION} (migrated)\n"
    assert migrate(postgres_dsn) == (SCHEMA_VERSION, SCHEMA_VERSION)
    tables = {r[0] for r in query(postgres_dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"broker_schema", "broker_leader", "broker_tokens", "broker_tokens_version", "broker_trajectories"} <= tables
    assert query(postgres_dsn, "SELECT id, version FROM broker_tokens_version") == [(1, 0)]
    assert query(postgres_dsn, "SELECT count(*) FROM broker_leader") == [(0,)]  # until a broker takes the lease
    assert main(["broker", "migrate", "--db", postgres_dsn]) == 0
    assert "already current" in capsys.readouterr().out


def test_brokers_starting_at_once_migrate_once(postgres_dsn):
    with ThreadPoolExecutor(4) as pool:
        found = sorted(pool.map(migrate, [postgres_dsn] * 4))
    assert found == [(0, SCHEMA_VERSION)] + [(SCHEMA_VERSION, SCHEMA_VERSION)] * 3


def test_a_schema_newer_than_this_code_is_refused(postgres_dsn):
    migrate(postgres_dsn)
    query(postgres_dsn, "UPDATE broker_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaTooNew, match=f"version {SCHEMA_VERSION + 1}, newer than this deltamesh knows"):
        PostgresStore(postgres_dsn)
    with pytest.raises(SchemaTooNew):
        migrate(postgres_dsn)
    assert query(postgres_dsn, "SELECT version FROM broker_schema") == [(SCHEMA_VERSION + 1,)]


def test_brokers_may_run_as_a_role_that_cannot_create_tables(postgres_dsn, make_group):
    migrate(postgres_dsn)  # as the owner, ahead of time (`deltamesh broker migrate`)
    role = f"rw_{postgres_dsn.rsplit('_', 1)[1]}"
    for grant in (f"CREATE ROLE {role} LOGIN",
                  f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
                  f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}"):
        query(postgres_dsn, grant)
    as_role = postgres_dsn.replace("postgresql://postgres@", f"postgresql://{role}@")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        query(as_role, "CREATE TABLE broker_probe(x INT)")
    store = PostgresStore(as_role)
    assert store.ingest(submissions(make_group("g", [0.0, 1.0])), keep)[0].accepted == 2
    store.close()


def test_the_db_setting_names_the_backend(tmp_path):
    assert is_postgres("postgresql://u@h/db") and is_postgres("postgres://h/db") and not is_postgres("broker.db")
    assert BrokerConfig(db="postgresql://u@h/db").db == "postgresql://u@h/db"
    with pytest.raises(ValueError, match="not a valid PostgreSQL URL"):
        BrokerConfig(db="postgresql://%zz")
    with pytest.raises(ValueError, match="needs a PostgreSQL store"):
        open_store(str(tmp_path / "b.db"), durability="fsync", term=LeaderTerm("a", 1))


def set_lease(dsn: str, holder: str, epoch: int, ttl_s: float) -> None:
    query(dsn, "INSERT INTO broker_leader VALUES (1, %s, 'http://127.0.0.1:1', %s, "
               "clock_timestamp() + make_interval(secs => %s)) ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, "
               "epoch = excluded.epoch, expires_at = excluded.expires_at", (holder, epoch, ttl_s))


def test_a_store_without_the_lease_writes_nothing(postgres_dsn, make_group):
    migrate(postgres_dsn)
    set_lease(postgres_dsn, "a", 2, 60)
    lease = Lease(1, "t", 0, "pool", "r", ["m"], 2, 1.0, 2.0)
    for term in (LeaderTerm("a", 1), LeaderTerm("b", 2)):  # an older epoch; another holder
        store = PostgresStore(postgres_dsn, term=term)
        with pytest.raises(NotLeader, match="no longer holds the leadership lease"):
            store.ingest(submissions(make_group("g", [0.0, 1.0])), keep)
        with pytest.raises(NotLeader):
            store.issue_leases([lease], [], (0, 1))
        with pytest.raises(NotLeader):
            store.take_batch("b", "m", 0, [], [], [])
        with pytest.raises(NotLeader):
            store.import_tasks([TaskRecord("t", "p")])
        assert store.load().task_ids == []  # reads need no lease
        store.close()
    assert query(postgres_dsn, "SELECT (SELECT count(*) FROM broker_trajectories) + (SELECT count(*) FROM broker_leases) "
                               "+ (SELECT count(*) FROM broker_batches) + (SELECT count(*) FROM broker_tasks)") == [(0,)]

    leader = PostgresStore(postgres_dsn, term=LeaderTerm("a", 2))
    assert leader.ingest(submissions(make_group("g", [0.0, 1.0])), keep)[0].accepted == 2
    assert len(leader.take_batch("b", "m", 0, [("m", "g")], [], [])) == 2
    set_lease(postgres_dsn, "a", 2, -1)  # the same term, expired (not renewed in time)
    with pytest.raises(NotLeader):
        leader.ingest(submissions(make_group("h", [0.0, 1.0])), keep)
    assert isinstance(NotLeader("x"), StoreUnavailable)  # the broker answers 503 and writes nothing
    assert query(postgres_dsn, "SELECT group_id FROM broker_trajectories ORDER BY id") == [("g",), ("g",)]
    leader.close()


def test_postgres_stopped_mid_burst_is_unavailable_then_the_same_store_recovers(postgres_cluster, postgres_dsn,
                                                                                make_group):
    store = PostgresStore(postgres_dsn)
    acked: list[str] = []
    stopper = threading.Timer(0.3, postgres_cluster.stop, kwargs={"mode": "immediate"})
    stopper.start()
    try:
        failed = None
        for i in range(10_000):
            submission = make_group(f"g{i}", [0.0, 1.0, 1.0, 0.0], tokens=512)
            try:
                store.ingest(submissions(submission), keep)
            except StoreUnavailable:
                failed = submission
                break
            acked += [t.id for t in submission]
        stopper.join()
        assert failed is not None and acked, "the server was stopped while submissions were being committed"
        with pytest.raises(StoreUnavailable):
            store.load()
    finally:
        stopper.join()
        postgres_cluster.ensure_running()
    [again] = store.ingest(submissions(failed), keep)  # the failed commit may or may not have landed: never half
    assert again.accepted + again.duplicates == 4 and again.accepted in (0, 4)
    stored = {r[0] for r in query(postgres_dsn, "SELECT id FROM broker_trajectories")}
    assert set(acked) <= stored and len(stored) == len(acked) + 4
    assert len(store.load().fresh) == len(acked) // 4 + 1
    store.close()


def _same(a, b) -> bool:
    return [(t.id, t.reward, t.tokens.tolist(), t.logprobs.tolist(), t.versions.tolist(), t.loss_mask.tolist(),
             t.timings, t.metadata) for t in a] == \
           [(t.id, t.reward, t.tokens.tolist(), t.logprobs.tolist(), t.versions.tolist(), t.loss_mask.tolist(),
             t.timings, t.metadata) for t in b]


def test_a_batch_from_memory_is_what_the_database_holds(postgres_dsn, make_group):
    """Groups a store committed come from its memory, the rest from the database: a group half stored by
    another broker (before a takeover) is read back whole, and a requeued batch from the database."""
    first = PostgresStore(postgres_dsn)
    half = make_group("half", [0.0, 1.0, 1.0, 0.0])
    first.ingest(submissions(half[:2]), keep)
    first.close()
    store = PostgresStore(postgres_dsn)
    whole, ours = make_group("whole", [1.0, 0.0]), half[2:]
    store.ingest(submissions(whole, ours), keep)
    assert store._recent.get(("m", "whole")) is not None and store._recent.get(("m", "half")) is None
    served = store.take_batch("b1", "m", 0, [("m", "half"), ("m", "whole")], [], [])
    assert _same(served, half + whole)
    assert len(store._recent) == 0  # delivered groups are not held any longer
    store.requeue_batches(["b1"])
    again = store.take_batch("b2", "m", 0, [("m", "half"), ("m", "whole")], [], [])
    assert _same(again, served)
    store.close()


def test_held_groups_stay_inside_their_budget(make_group):
    from deltamesh.mesh.broker.recent_groups import RecentGroups

    groups = [make_group(f"g{i}", [1.0, 0.0], tokens=100) for i in range(4)]
    one = sum(t.tokens.nbytes + t.logprobs.nbytes + t.versions.nbytes + t.loss_mask.nbytes for t in groups[0])
    recent = RecentGroups(budget_bytes=2 * one)
    for g in groups:
        recent.committed(("m", g[0].group_id), g, new_group=True)
    assert [recent.get(("m", f"g{i}")) is not None for i in range(4)] == [False, False, True, True]
    recent.committed(("m", "old"), groups[0], new_group=False)  # its first samples are not held: not held
    assert recent.get(("m", "old")) is None
