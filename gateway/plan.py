"""Transfer plans: which stored versions move a pool from the version it holds to a target version.

A plan is either a chain of deltas from the pool's version, or a full snapshot followed by the
deltas after it, whichever carries fewer bytes. A full route is the only choice on a first pull
(no version held) or when the delta chain is broken (a delta is missing from the store), and it is
forced for a periodic full sync: when the pool would otherwise have applied `full_every` deltas in a
row since its last full snapshot. Plans are pure data computed from what can be served (`PlanStep`s:
a gateway's own manifests, and on a relay also what its upstreams can serve it, see
`deltamesh.gateway.server.relay`); the server serves them as JSON and the puller executes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from deltamesh.delta.manifest import Manifest


class NoPlanError(Exception):
    """No stored versions lead to the target (no full snapshot and no usable chain)."""


@dataclass(frozen=True)
class PlanStep:
    version: int
    kind: str
    base_version: int | None
    payload_bytes: int
    pieces: int

    def to_json(self) -> dict:
        return {"version": self.version, "kind": self.kind, "base_version": self.base_version,
                "payload_bytes": self.payload_bytes, "pieces": self.pieces}

    @classmethod
    def from_json(cls, d: dict) -> "PlanStep":
        return cls(int(d["version"]), str(d["kind"]), d["base_version"], int(d["payload_bytes"]), int(d["pieces"]))

    @classmethod
    def of(cls, m: Manifest) -> "PlanStep":
        return cls(m.version, m.kind, m.base_version, m.payload_bytes, len(m.pieces))

    @property
    def key(self) -> tuple[int, str]:
        return self.version, self.kind


@dataclass(frozen=True)
class Plan:
    model: str
    from_version: int | None
    to_version: int
    steps: tuple[PlanStep, ...]
    reason: str

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.steps)

    @property
    def is_full(self) -> bool:
        return bool(self.steps) and self.steps[0].kind == "full"

    def to_json(self) -> dict:
        return {"model": self.model, "from": self.from_version, "to": self.to_version, "reason": self.reason,
                "payload_bytes": self.payload_bytes, "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls(str(d["model"]), d["from"], int(d["to"]),
                   tuple(PlanStep.from_json(s) for s in d["steps"]), str(d["reason"]))


def make_plan(
    model: str,
    available: Iterable[PlanStep],
    from_version: int | None,
    to_version: int,
    *,
    since_full: int | None = None,
    full_every: int = 0,
) -> Plan:
    """The cheapest route from `from_version` (None: nothing held) to `to_version` over `available` steps.

    `since_full` is how many deltas the pool has applied since its last full snapshot; with
    `full_every` > 0, a chain that would reach `full_every` is replaced by a full route.
    """
    deltas: dict[int, PlanStep] = {}
    fulls: list[PlanStep] = []
    for m in available:
        if m.version > to_version:
            continue
        if m.kind == "delta":
            deltas[m.version] = m
        else:
            fulls.append(m)

    if from_version is not None and from_version >= to_version:
        return Plan(model, from_version, to_version, (), "up to date")

    full_route = None
    for full in fulls:
        tail = _chain(deltas, full.version, to_version)
        if tail is not None:
            route = [full, *tail]
            if full_route is None or _bytes(route) < _bytes(full_route):
                full_route = route

    chain = _chain(deltas, from_version, to_version) if from_version is not None else None
    if chain is not None:
        periodic = full_every > 0 and since_full is not None and since_full + len(chain) >= full_every
        if full_route is None or (not periodic and _bytes(chain) <= _bytes(full_route)):
            return _plan(model, from_version, to_version, chain, "delta chain")
        reason = "full: periodic full sync" if periodic else "full: smaller than the delta chain"
        return _plan(model, from_version, to_version, full_route, reason)
    if full_route is None:
        raise NoPlanError(f"{model}: no full snapshot or delta chain leads to version {to_version}")
    reason = "full: first pull" if from_version is None else "full: delta chain broken"
    return _plan(model, from_version, to_version, full_route, reason)


def _chain(deltas: dict[int, PlanStep], start: int, end: int) -> list[PlanStep] | None:
    """Deltas leading from `start` to `end` by following base versions back from `end`."""
    chain = []
    v = end
    while v > start:
        d = deltas.get(v)
        if d is None or d.base_version is None or d.base_version < start:
            return None
        chain.append(d)
        v = d.base_version
    chain.reverse()
    return chain


def _bytes(route: list[PlanStep]) -> int:
    return sum(m.payload_bytes for m in route)


def _plan(model: str, frm: int | None, to: int, route: list[PlanStep], reason: str) -> Plan:
    return Plan(model, frm, to, tuple(route), reason)
