"""Which version the evaluator scores next (mesh/eval/schedule.py), and its results store across restarts."""

from __future__ import annotations

from deltamesh.mesh.eval.schedule import Schedule
from deltamesh.mesh.eval.store import EvalResult, EvalStore


def test_version_0_then_every_kth_in_order_then_what_is_asked():
    s = Schedule(5)
    assert (s.next_after(None), s.next_after(0), s.next_after(3), s.next_after(5)) == (0, 5, 5, 10)
    s.finished(0)
    s.finished(5)
    assert s.next_after(None) == 10 and s.next_after(4) == 10
    assert s.request(7) and s.next_after(4) == 7 and s.next_after(7) == 10
    assert not s.request(5)  # scored already
    assert s.past_request(9) == 7 and s.past_request(6) is None
    assert s.waiting(12) == 2  # v7 (asked) and v10 are published and not scored


def test_without_every_only_version_0_and_requests_are_due():
    s = Schedule(0)
    assert s.next_after(None) == 0
    s.finished(0)
    assert s.next_after(None) is None and s.next_after(0) is None and not s.due(5)
    s.request(3)
    assert s.next_after(0) == 3 and s.due(3)


def test_results_survive_a_restart_and_a_version_is_stored_once(tmp_path):
    db = tmp_path / "eval.db"
    store = EvalStore(db)
    first = EvalResult("policy", 5, "h5", "set", 0.25, 4, 10, 10)
    assert store.add(first) and not store.add(EvalResult("policy", 5, "other", "set", 0.9, 4, 10, 36))
    store.add(EvalResult("policy", 0, "h0", "set", 0.1, 4, 10, 4))
    store.add(EvalResult("policy", 0, "h0", "another-set", 0.5, 4, 10, 20))
    store.close()
    again = EvalStore(db)
    assert [r.version for r in again.results("policy", "set")] == [0, 5]
    assert again.results("policy", "set")[1] == first and again.versions("policy", "set") == {0, 5}
    assert Schedule(5, again.versions("policy", "set")).next_after(None) == 10
    again.close()
