"""When a pool may lease tasks: every engine serves a published version, none too far behind.

The newest version of a policy is the larger of the trainer's version (as the broker reports it: the
trainer may be ahead of what has reached this region; while it trains on batches it took, the version
those will make, `training_version`) and the head announced by the region's gateway. A pool whose
engine is more than `max_staleness` versions behind it stops leasing until its weight sync catches up;
episodes already running carry on. `lease_verdict` is the pure rule;
`LeaseGate` feeds it the live versions, reading the broker's at most every `refresh_s`, and at once
when the broker holds a lease back (`HeldBack`): the broker checks the served versions a lease request
carries against its own bound, so a status read a moment old never lets a stale lease through.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from deltamesh.http import HttpError
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.weights import PolicyWeights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    may_lease: bool
    reason: str = ""
    behind: dict[str, int] = field(default_factory=dict)
    """Versions each served policy is behind the newest known one."""


def lease_verdict(served: Mapping[str, int | None], newest: Mapping[str, int | None],
                  max_staleness: int | None) -> Verdict:
    """Whether to lease, given each policy's served version (None: none yet) and newest known version."""
    behind = {m: max(0, newest[m] - v) for m, v in served.items() if v is not None and newest.get(m) is not None}
    for model_id, version in served.items():
        if version is None:
            return Verdict(False, f"{model_id}: waiting for a published version", behind)
    if max_staleness is not None:
        for model_id, lag in behind.items():
            if lag > max_staleness:
                return Verdict(False, f"{model_id}: v{served[model_id]} is {lag} versions behind "
                                      f"v{newest[model_id]} (bound {max_staleness})", behind)
    return Verdict(True, "", behind)


class LeaseGate:
    """Applies `lease_verdict` to the pool's live engines and the broker's trainer versions."""

    def __init__(self, policies: Mapping[str, PolicyWeights], broker_status: Callable[[], Awaitable[dict[str, Any]]],
                 *, max_staleness: int | None, refresh_s: float = 1.0, metrics: PoolMetrics | None = None) -> None:
        self.policies = policies
        self.broker_status = broker_status
        self.max_staleness = max_staleness
        self.refresh_s = refresh_s
        self.metrics = metrics
        self.trainer_versions: dict[str, int] = {}
        self.last = Verdict(False, "not checked yet")
        self._read_at = float("-inf")

    async def check(self) -> Verdict:
        if self.max_staleness is not None and time.monotonic() - self._read_at >= self.refresh_s:
            await self._read_trainer_versions()
        served = {m: p.version if p.ready else None for m, p in self.policies.items()}
        newest = {m: _max(p.newest, self.trainer_versions.get(m)) for m, p in self.policies.items()}
        verdict = lease_verdict(served, newest, self.max_staleness)
        if verdict.may_lease != self.last.may_lease or (not verdict.may_lease and verdict.reason != self.last.reason):
            if verdict.may_lease:
                log.info("leasing (versions behind: %s)", verdict.behind)
            else:
                log.info("not leasing: %s", verdict.reason)
        self.last = verdict
        if self.metrics is not None:
            self.metrics.leasing.set(1 if verdict.may_lease else 0)
            for model_id, lag in verdict.behind.items():
                self.metrics.behind.labels(model_id).set(lag)
        return verdict

    def served(self) -> dict[str, int]:
        """The version each ready engine serves: what a lease request tells the broker it generates with."""
        return {m: p.version for m, p in self.policies.items() if p.ready and p.version is not None}

    def held_back(self, training_versions: Mapping[str, int]) -> None:
        """The broker leased nothing because an engine is beyond its staleness bound: take the training
        versions it named at once (not at the next status read), so the gate stays shut until they are
        served."""
        for model_id, version in training_versions.items():
            self.trainer_versions[model_id] = max(version, self.trainer_versions.get(model_id, version))

    async def _read_trainer_versions(self) -> None:
        self._read_at = time.monotonic()
        try:
            status = await self.broker_status()
            self.trainer_versions = {m: max(int(s["version"]), int(s.get("training_version", s["version"])))
                                     for m, s in status.get("models", {}).items()}
        except (HttpError, KeyError, TypeError, ValueError, AttributeError) as e:
            # Keep the last known versions: the gateway's head still bounds staleness meanwhile.
            log.warning("cannot read trainer versions from the broker: %s", e)


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)
