"""Which kind of which version a relay mirrors before anyone asks for it.

A relay mirrors the deltas: the newest `keep_deltas` its upstream holds, since every pool and
downstream gateway that follows it applies each new version as a delta. It does not mirror the
full snapshot that comes with a periodic-full version: that would double those versions' bytes on
the link while no follower uses it. A full crosses the link only when something needs it:

* on demand (`Relay.demand`): a plan this relay hands out names it (a pool's first pull, a broken
  chain, a periodic full sync the pool's plan chose), or a pool or downstream gateway asks for its
  manifest or pieces;
* to keep an *anchor*, a full snapshot from which the deltas the relay keeps lead to the head, so
  first pulls can be planned from its own store. The relay fetches one only when it could not
  follow the model otherwise: when it holds no full of the model at all (its first sync), and when
  the newest version has no delta (published as a full alone, by a restarted trainer). It takes
  the newest full that chains to the head over the deltas it keeps.

The anchor is not renewed when retention drops the first delta after it. Renewing it would cost a
full snapshot per `keep_deltas` versions on every link (for a real model, several times what the
deltas cost: SmolLM2-135M's full is ~165 of its deltas) to insure only first pulls while every
upstream is unreachable. A first pull is served on demand instead, and a full fetched on demand
becomes the anchor; garbage collection always keeps the newest complete full.
"""

from __future__ import annotations

from typing import Iterable

from deltamesh.gateway.plan import NoPlanError, PlanStep, make_plan


def deltas_to_follow(upstream_held: Iterable[PlanStep], keep_deltas: int) -> list[PlanStep]:
    """The newest `keep_deltas` deltas the upstream holds: what a relay mirrors as it follows."""
    deltas = sorted((s for s in upstream_held if s.kind == "delta"), key=lambda s: s.version)
    return deltas[-keep_deltas:]


def anchor_to_fetch(model: str, local: Iterable[PlanStep], following: Iterable[PlanStep],
                    upstream_all: Iterable[PlanStep], keep_deltas: int) -> PlanStep | None:
    """The full a relay should fetch as its anchor (see the module's docstring), or None: when it
    needs none, or when no full the upstream can serve chains to the head.

    `local` is what the relay holds (complete or arriving), `following` the deltas it is about to
    mirror, `upstream_all` everything the upstream can serve it (what the upstream holds and what it
    can fetch itself).
    """
    local, following, upstream_all = list(local), list(following), list(upstream_all)
    everything = [*local, *following, *upstream_all]
    head = max((s.version for s in everything), default=None)
    if head is None:
        return None
    fulls_here = {s.version for s in local if s.kind == "full"}
    head_by_delta = any(s.kind == "delta" and s.version == head for s in everything)
    if fulls_here and (head_by_delta or head in fulls_here):
        return None
    deltas = {s.key: s for s in local if s.kind == "delta"}
    deltas.update((s.key, s) for s in following)
    kept = sorted(deltas.values(), key=lambda s: s.version)[-keep_deltas:]
    for full in sorted((s for s in upstream_all if s.kind == "full" and s.version not in fulls_here),
                       key=lambda s: -s.version):
        if _reaches(model, [full, *kept], head):
            return full
    return None


def _reaches(model: str, steps: list[PlanStep], head: int) -> bool:
    """Whether a first pull to `head` can be planned over `steps` alone."""
    try:
        make_plan(model, steps, None, head)
    except NoPlanError:
        return False
    return True
