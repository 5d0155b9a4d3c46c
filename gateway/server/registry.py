"""The pool registry of a gateway: which rollout pools are in its region, what they hold, and who is down.

Pools register (each with its own token, under its own name: the routes bind that) and then
heartbeat with the version they hold and the state of their transfer; a pool that leaves
deregisters. Every field a peer sends is checked against a bound here (names and model ids by
pattern, numbers by range, strings by length), so a registration cannot grow the gateway's memory or
its metrics without limit. The registry is in memory: pools re-register after a gateway restart (the
pool agent does so when a heartbeat answers 404). Staleness is counted in versions behind the
gateway's head for the pool's model; a pool that has not heartbeaten for the timeout is down, and one
that stays silent for `expire_s` (it vanished without deregistering: killed, its host gone) is
forgotten, so that the registry and the per-pool metrics do not keep the dead for ever.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from deltamesh.delta.manifest import MODEL_ID_RE

POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRANSFER_STATES = ("idle", "planning", "fetching", "applying", "error")
MAX_GPUS = 4096
MAX_LABEL = 64
"""Longest engine or tier label."""
MAX_ENDPOINT = 300
MAX_TRANSFER_JSON = 4096
"""Largest heartbeat `transfer` object, as JSON: progress figures, not a payload."""
MAX_VERSION = 2**53

log = logging.getLogger(__name__)


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
    probe: bool = False
    """Whether the gateway may probe `endpoint`: only one an authenticated pool gave it."""


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


def _label(body: dict, name: str, default: str, limit: int = MAX_LABEL) -> str:
    value = _field(body, name, str, default)
    if len(value) > limit or not value.isprintable():
        raise RegistryError(f"{name} must be printable and at most {limit} characters")
    return value


def _version(body: dict) -> int | None:
    version = _field(body, "version", int, None)
    if version is not None and not 0 <= version < MAX_VERSION:
        raise RegistryError(f"version must be >= 0 and < 2**53, or null; got {version}")
    return version


def _endpoint(body: dict) -> str:
    endpoint = _label(body, "endpoint", "", MAX_ENDPOINT)
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise RegistryError("endpoint must be an http(s) URL or empty")
    return endpoint


class PoolRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.time, *,
                 expire_s: float = 0.0):
        """`expire_s`: forget a pool silent for this long (0: keep it, shown down, until it deregisters)."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.expire_s = expire_s
        self._clock = clock
        self._pools: dict[str, PoolRecord] = {}

    def _expire(self) -> None:
        """Forget the pools silent for `expire_s`, each with one line (checked whenever pools are listed:
        nothing runs in the background for it)."""
        if not self.expire_s:
            return
        now = self._clock()
        for name, record in list(self._pools.items()):
            if now - record.last_seen > self.expire_s:
                del self._pools[name]
                log.info("pool %s: forgotten, no heartbeat for %.0f s (it left without deregistering)", name,
                         now - record.last_seen)

    def register(self, body: Any, *, probe: bool = False) -> PoolRecord:
        """Add or replace a pool from its registration body; `probe`: its endpoint may be probed."""
        if not isinstance(body, dict):
            raise RegistryError("body must be a JSON object")
        name = _field(body, "name", str)
        if not POOL_NAME_RE.match(name):
            raise RegistryError(f"pool name {name[:80]!r} must match {POOL_NAME_RE.pattern}")
        model = _field(body, "model", str, "")
        if model and not MODEL_ID_RE.match(model):
            raise RegistryError(f"model {model[:80]!r} must match {MODEL_ID_RE.pattern}")
        gpus = _field(body, "gpus", int, 0)
        if not 0 <= gpus <= MAX_GPUS:
            raise RegistryError(f"gpus must be in 0..{MAX_GPUS}")
        now = self._clock()
        record = PoolRecord(
            name=name,
            model=model,
            gpus=gpus,
            engine=_label(body, "engine", "none"),
            tier=_label(body, "tier", ""),
            endpoint=_endpoint(body),
            registered_at=now,
            last_seen=now,
            version=_version(body),
            probe=probe,
        )
        self._pools[name] = record
        return record

    def deregister(self, name: str) -> bool:
        """Forget a pool; False if it was not registered."""
        return self._pools.pop(name, None) is not None

    def get(self, name: str) -> PoolRecord | None:
        return self._pools.get(name)

    def heartbeat(self, name: str, body: Any) -> PoolRecord | None:
        """Record a heartbeat; None if the pool is not registered (it should register again)."""
        record = self._pools.get(name)
        if record is None:
            return None
        if not isinstance(body, dict):
            raise RegistryError("body must be a JSON object")
        version = _version(body)
        state = _field(body, "state", str, "idle")
        if state not in TRANSFER_STATES:
            raise RegistryError(f"state {state[:40]!r} must be one of {list(TRANSFER_STATES)}")
        transfer = _field(body, "transfer", dict, {})
        if len(json.dumps(transfer)) > MAX_TRANSFER_JSON:
            raise RegistryError(f"transfer must be at most {MAX_TRANSFER_JSON} bytes of JSON")
        record.version, record.state, record.transfer = version, state, transfer
        record.last_seen = self._clock()
        return record

    def is_up(self, record: PoolRecord) -> bool:
        return self._clock() - record.last_seen <= self.heartbeat_timeout_s

    def pools(self) -> list[PoolRecord]:
        self._expire()
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
