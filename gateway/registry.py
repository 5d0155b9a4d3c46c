"""The pool registry of a gateway: which rollout pools are in its region, what they hold, and who is down.

Pools register with a region token (bearer) and then heartbeat with the version they hold and the
state of their transfer. The registry is in memory: pools re-register after a gateway restart (the
pool agent does so when a heartbeat answers 404). Staleness is counted in versions behind the
gateway's head for the pool's model; a pool that has not heartbeaten for the timeout is down.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRANSFER_STATES = ("idle", "planning", "fetching", "applying", "error")


class RegistryError(ValueError):
    """A registration or heartbeat body that does not fit the schema."""


@dataclass
class PoolRecord:
    name: str
    model: str
    gpus: int
    engine: str
    tier: str
    endpoint: str
    registered_at: float
    last_seen: float
    version: int | None = None
    state: str = "idle"
    transfer: dict[str, Any] = field(default_factory=dict)


def _field(body: dict, name: str, kind: type, default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise RegistryError(f"missing field {name!r}")
    if value is None and default is None:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RegistryError(f"{name} must be an integer")
    if kind is not int and not isinstance(value, kind):
        raise RegistryError(f"{name} must be a {kind.__name__}")
    return value


class PoolRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.time):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._pools: dict[str, PoolRecord] = {}

    def register(self, body: Any) -> PoolRecord:
        if not isinstance(body, dict):
            raise RegistryError("body must be a JSON object")
        name = _field(body, "name", str)
        if not POOL_NAME_RE.match(name):
            raise RegistryError(f"pool name {name!r} must match {POOL_NAME_RE.pattern}")
        gpus = _field(body, "gpus", int, 0)
        if gpus < 0:
            raise RegistryError("gpus must be >= 0")
        now = self._clock()
        record = PoolRecord(
            name=name,
            model=_field(body, "model", str, ""),
            gpus=gpus,
            engine=_field(body, "engine", str, "none"),
            tier=_field(body, "tier", str, ""),
            endpoint=_field(body, "endpoint", str, ""),
            registered_at=now,
            last_seen=now,
            version=_field(body, "version", int, None),
        )
        self._pools[name] = record
        return record

    def heartbeat(self, name: str, body: Any) -> PoolRecord | None:
        """Record a heartbeat; None if the pool is not registered (it should register again)."""
        record = self._pools.get(name)
        if record is None:
            return None
        if not isinstance(body, dict):
            raise RegistryError("body must be a JSON object")
        version = _field(body, "version", int, None)
        state = _field(body, "state", str, "idle")
        if state not in TRANSFER_STATES:
            raise RegistryError(f"state {state!r} must be one of {list(TRANSFER_STATES)}")
        transfer = _field(body, "transfer", dict, {})
        record.version, record.state, record.transfer = version, state, transfer
        record.last_seen = self._clock()
        return record

    def is_up(self, record: PoolRecord) -> bool:
        return self._clock() - record.last_seen <= self.heartbeat_timeout_s

    def pools(self) -> list[PoolRecord]:
        return sorted(self._pools.values(), key=lambda r: r.name)

    def describe(self, heads: dict[str, int]) -> list[dict[str, Any]]:
        now = self._clock()
        out = []
        for r in self.pools():
            head = heads.get(r.model)
            stale = None if head is None or r.version is None else max(0, head - r.version)
            out.append({
                "name": r.name, "model": r.model, "gpus": r.gpus, "engine": r.engine, "tier": r.tier,
                "endpoint": r.endpoint, "version": r.version, "head": head, "versions_behind": stale,
                "state": r.state, "transfer": r.transfer, "up": self.is_up(r),
                "last_seen_s": round(now - r.last_seen, 3),
            })
        return out
