"""The broker's durable store, one suite for both backends (SQLite and PostgreSQL, `store_factory`).

Each test drives a store the way the broker does and checks what it returns and what a store opened
again loads: ids are idempotency keys, each submission of a group commit is all-or-nothing on its own,
groups complete at their size and are judged once, leases finish when every model has its group, and
batches are delivered, requeued, acknowledged and dropped with their token arrays intact until then.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deltamesh.mesh.broker.store_interface import Delivery, IdConflict, Lease, StoreConflict, TaskRecord
from deltamesh.mesh.broker.store_rows import submissions


def keep(summary):
    return None


def zero_adv(summary):
    return "zero_adv" if summary.reward_min == summary.reward_max else None


def keys(summaries):
    return [(s.model_id, s.group_id) for s in summaries]


def test_ids_are_idempotency_keys(store_factory, make_group):
    store = store_factory()
    g = make_group("g1", [0.0, 1.0, 1.0, 0.0])
    first, again = store.ingest(submissions(g, g), keep)  # one commit: the second sees the first
    assert (first.accepted, first.duplicates, keys(first.completed)) == (4, 0, [("m", "g1")])
    assert (again.accepted, again.duplicates, again.completed) == (0, 4, [])
    [changed] = store.ingest(submissions([dataclasses.replace(g[0], reward=0.5)]), keep)
    assert isinstance(changed, IdConflict) and "'g1-0'" in str(changed)
    [later] = store.ingest(submissions(g[:2]), keep)
    assert (later.accepted, later.duplicates) == (0, 2)


def test_each_submission_of_a_commit_is_all_or_nothing(store_factory, make_group, make_trajectory):
    store = store_factory()
    a = make_group("a", [0.0, 1.0])
    b0, b1 = make_group("b", [1.0, 0.0])
    disagreeing = [b0, make_trajectory("c-0", "c", group_size=2), make_trajectory("c-1", "c", group_size=3)]
    overflow = [make_trajectory("a-9", "a", group_size=2)]
    results = store.ingest(submissions(a, disagreeing, [b0, b1], overflow), keep)
    assert [type(r).__name__ for r in results] == ["IngestResult", "StoreConflict", "IngestResult", "StoreConflict"]
    assert "disagree" in str(results[1]) and "would hold 3 samples" in str(results[3])
    assert (results[2].accepted, results[2].duplicates) == (2, 0)  # b0 of the refused submission was not kept
    mismatch = make_trajectory("a-8", "a", group_size=4)
    [refused] = store.ingest(submissions([mismatch]), keep)
    assert isinstance(refused, StoreConflict) and "has size 2" in str(refused)
    fresh = store.load().fresh
    assert keys(fresh) == [("m", "a"), ("m", "b")] and fresh[0].seq < fresh[1].seq
    assert (fresh[0].reward_min, fresh[0].reward_max, fresh[0].reward_mean, fresh[0].size) == (0.0, 1.0, 0.5, 2)


def test_groups_complete_across_commits_and_finish_their_lease(store_factory, make_trajectory):
    store = store_factory()
    store.import_tasks([TaskRecord("t1", {"q": 1}), TaskRecord("t2", "p", {"k": 1}, 2, ["m", "m2"])])
    store.set_model_version("m", 3)
    tasks = store.issue_leases([Lease(1, "t2", 0, "pool", "r", ["m", "m2"], 2, 10.0, 20.0)], [], (0, 2))
    assert tasks == {"t2": TaskRecord("t2", "p", {"k": 1}, 2, ["m", "m2"])}

    def sample(model_id, i, reward, version):
        t = make_trajectory(f"{model_id}-{i}", "L1", model_id=model_id, group_size=2, reward=reward,
                            version=version, task_id="t2", seed=i)
        t.pool = "pool"  # the lease's holder: only it may fill the lease's group
        return t

    [half] = store.ingest(submissions([sample("m", 0, 1.0, 2)]), zero_adv)
    assert (half.accepted, half.completed, half.done_leases) == (1, [], [])
    [m] = store.ingest(submissions([sample("m", 1, 0.0, 3)]), zero_adv)
    assert keys(m.completed) == [("m", "L1")] and m.done_leases == []
    done = m.completed[0]
    assert (done.min_version, done.max_version, done.reward_mean, done.state) == (2, 3, 0.5, "fresh")
    [m2] = store.ingest(submissions([sample("m2", 0, 1.0, 3), sample("m2", 1, 1.0, 3)]), zero_adv)
    assert [(s.state, s.reason) for s in m2.completed] == [("filtered", "zero_adv")] and m2.done_leases == ["L1"]
    snap = store.load()
    assert (snap.models, snap.task_ids, snap.cursor, snap.next_lease_no) == ({"m": 3}, ["t1", "t2"], (0, 2), 2)
    assert snap.leases == [] and keys(snap.fresh) == [("m", "L1")]
    assert [(s.model_id, s.state) for s in snap.history] == [("m", "fresh"), ("m2", "filtered")]
    with pytest.raises(StoreConflict, match="no stored tokens"):  # a filtered group keeps no token arrays
        store.take_batch("b1", "m2", 3, [("m2", "L1")], [], [])
    assert store.batch_states("m2", ["b1"]) == {}  # and the refused batch was not recorded


def test_leases_expire_and_are_reissued(store_factory):
    store = store_factory()
    store.import_tasks([TaskRecord(f"t{i}", i) for i in range(3)])
    leases = [Lease(n, f"t{n - 1}", 0, "pool", "r", ["m"], 4, 1.0, 2.0) for n in (1, 2)]
    assert set(store.issue_leases(leases, [], (0, 2))) == {"t0", "t1"}
    assert store.expire_leases(["L2", "L9", "L2"]) == ["L2"] and store.expire_leases(["L2"]) == []
    assert [(le.lease_id, le.state) for le in store.load().leases] == [("L1", "active"), ("L2", "expired")]
    again = Lease(3, "t1", 0, "pool2", "r2", ["m"], 4, 3.0, 4.0)
    assert store.issue_leases([again], ["L2"], (1, 0)) == {"t1": TaskRecord("t1", 1, {}, None, None)}
    snap = store.load()
    assert snap.leases == [leases[0], again] and snap.cursor == (1, 0) and snap.next_lease_no == 4


def test_batches_are_delivered_requeued_acknowledged_and_dropped(store_factory, make_group):
    store = store_factory()
    groups = {gid: make_group(gid, [0.0, 1.0], version=i) for i, gid in enumerate(["g1", "g2", "g3"])}
    store.ingest(submissions(*groups.values()), keep)
    g1, g2, g3 = (("m", gid) for gid in groups)
    served = store.take_batch("b1", "m", 5, [g2, g1], [], [])
    assert [t.id for t in served] == ["g2-0", "g2-1", "g1-0", "g1-1"]
    for got, sent in zip(served, groups["g2"] + groups["g1"]):
        assert got.header() == sent.header() and (got.min_version, got.max_version) == (sent.min_version, sent.max_version)
        for name in ("tokens", "logprobs", "loss_mask", "versions"):
            assert np.array_equal(getattr(got, name), getattr(sent, name))
    assert store.batch_states("m", ["b1", "nope"]) == {"b1": "delivered"} and store.batch_states("other", ["b1"]) == {}
    store.close()
    store = store_factory()  # an unacknowledged batch survives a restart
    snap = store.load()
    assert [(d.batch_id, keys(d.groups)) for d in snap.deliveries] == [("b1", [g1, g2])]
    assert isinstance(snap.deliveries[0], Delivery) and keys(snap.fresh) == [g3]

    store.requeue_batches(["b1"])
    assert store.batch_states("m", ["b1"]) == {"b1": "requeued"} and keys(store.load().fresh) == [g1, g2, g3]
    store.take_batch("b2", "m", 6, [g1], [], [(g3, "stale")])
    store.ack_batches(["b2", "b2", "unknown"], [])
    store.requeue_batches(["b2"])  # settled already: left alone
    snap = store.load()
    assert keys(snap.replay) == [g1] and keys(snap.fresh) == [g2] and snap.deliveries == []
    assert store.batch_states("m", ["b1", "b2"]) == {"b1": "requeued", "b2": "acked"}

    served = store.take_batch("b3", "m", 7, [g2], [g1], [])
    assert [t.id for t in served] == ["g1-0", "g1-1", "g2-0", "g2-1"]  # replay first
    store.ack_batches(["b3"], [(g1, "retired")])
    assert keys(store.load().replay) == [g2]
    with pytest.raises(StoreConflict):  # retired: its token arrays are gone
        store.take_batch("b4", "m", 8, [], [g1], [])
    store.drop_groups([(g2, "retired")])
    snap = store.load()
    assert snap.fresh == snap.replay == snap.deliveries == []
    assert [(s.group_id, s.state) for s in snap.history] == [("g1", "retired"), ("g2", "retired"), ("g3", "stale")]
    [late] = store.ingest(submissions(groups["g3"]), keep)  # a dropped group's ids are still known
    assert (late.accepted, late.duplicates) == (0, 2)
