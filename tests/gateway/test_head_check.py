"""The pool's bookkeeping of what gateways offer, without a network: rollback and equivocation checks,
the freeze bound, and each gateway's standing."""

from __future__ import annotations

import pytest

from deltamesh.delta import Manifest, TensorEntry
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import Plan, PlanStep
from deltamesh.mesh.pool.head_check import FreezeWatch, GatewayBook, Refusal, Rejected, VersionGuard

A, B = "a" * 32, "b" * 32


def _plan(*steps: tuple[int, str], to: int | None = None) -> Plan:
    route = tuple(PlanStep(v, k, None if k == "full" else v - 1, 10, 1) for v, k in steps)
    return Plan("m", 2, to if to is not None else route[-1].version, route, "test")


def _manifest(version: int, digest: str) -> Manifest:
    return Manifest(model_id="m", version=version, base_version=None, kind="full", codec="test",
                    tensors=(TensorEntry("w", "U8", (1,), digest),), pieces=())


def test_the_guard_refuses_a_rollback_and_another_hash_but_not_a_repair():
    guard = VersionGuard()
    held = _manifest(2, A)
    guard.hold(2, held.weights_hash)
    guard.check_plan(_plan((3, "delta")))
    guard.check_plan(_plan((0, "full"), (1, "delta"), (2, "delta"), (3, "delta")))  # a full route from below
    guard.check_plan(_plan((2, "full")))  # the held version again: a repair
    with pytest.raises(Rejected, match="rollback: a plan to v3 \\(v0 full\\) while the pool holds v2"):
        guard.check_plan(_plan((0, "full"), to=3))
    with pytest.raises(Rejected) as refused:
        guard.check_plan(_plan((1, "delta")))
    assert refused.value.reason == "rollback"
    guard.check_manifest(held)
    with pytest.raises(Rejected) as refused:
        guard.check_manifest(_manifest(2, B))
    assert refused.value.reason == "equivocation" and held.weights_hash in refused.value.offered
    guard.know(5, B)  # named by a verified statement: a manifest of v5 must carry it
    with pytest.raises(Rejected, match="equivocation"):
        guard.know(5, A)


def test_the_guard_forgets_old_versions_but_never_the_held_one():
    guard = VersionGuard(keep=3)
    guard.hold(0, A)
    for v in range(1, 10):
        guard.know(v, B)
    assert guard.known(0) == A and guard.known(9) == B and guard.known(1) is None


def test_a_gateway_is_stale_once_behind_a_known_version_for_longer_than_the_bound():
    watch = FreezeWatch(stale_after_s=10)
    watch.update([2, 2, 3], now=0.0)  # held v2; one gateway at 2, another at 3
    assert watch.behind(2, now=5.0) is None
    watch.update([2, 2, 3], now=11.0)
    assert watch.behind(2, now=11.0) == 3 and watch.behind(3, now=11.0) is None and watch.behind(None, 11.0) == 3
    watch.update([2, 2, 4], now=12.0)  # v4 is new: a gateway at 3 is behind v3's claim no more
    assert watch.behind(3, now=12.0) is None and watch.behind(2, now=12.0) == 3
    watch.update([2, 2], now=13.0)  # the gateway that claimed 3 and 4 no longer counts (a liar dropped)
    assert watch.behind(2, now=30.0) is None
    assert FreezeWatch(stale_after_s=0).behind(0, now=1e9) is None  # off


def test_the_book_keeps_each_gateway_s_standing():
    one, two = Source("http://one"), Source("http://two")
    book = GatewayBook([one, two])
    book.refused(one, Refusal("rollback", one.url, "v0"))
    assert not book.trusted(one) and one.bad_until > 0 and book.refusals["rollback"] == 1
    assert book.stale(two, "behind") and not book.stale(two, "still behind") and book.refusals["stale"] == 1
    assert book.describe()["http://two"]["reason"] == "still behind"
    assert book.fresh(two) and two.bad_until == 0.0 and book.describe()["http://two"]["state"] == "ok"
    assert book.describe()["http://one"]["state"] == "refused"
