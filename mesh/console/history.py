"""What the console remembers between two reads of the mesh: when each version reached each place, and
counters over the last minute.

`VersionHistory` keeps, per model, the newest `keep` versions and for each the wall-clock time it was
stored whole at each gateway (the gateways' `stored_at`; the origin's is when it was published) and
served by each pool (the pool's own timeline where it reports one, else when the console first saw the
pool on it). Gateways forget old versions and pools keep only their last few; the console keeps what
it saw. `describe` lays a version out as the hops it took (origin -> relay -> ... -> pool, from the
topology of the moment) with the slowest one named. `Rates` turns counters into per-minute rates over
a sliding minute. Times are the services' clocks (across hosts that assumes NTP).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

RATE_WINDOW_S = 60.0


class VersionHistory:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._models: dict[str, dict[int, dict[str, dict[str, float]]]] = {}

    def _version(self, model: str, version: int) -> dict[str, dict[str, float]] | None:
        versions = self._models.setdefault(model, {})
        entry = versions.get(version)
        if entry is None:
            if len(versions) >= self.keep and version < min(versions):
                return None  # older than everything kept: not worth a slot
            entry = versions[version] = {"gateways": {}, "pools": {}}
            while len(versions) > self.keep:
                del versions[min(versions)]
        return entry

    def stored(self, model: str, version: int, region: str, at: float) -> None:
        """Gateway `region` held `version` whole at `at` (the earliest time given wins)."""
        entry = self._version(model, version)
        if entry is not None:
            old = entry["gateways"].get(region)
            entry["gateways"][region] = at if old is None else min(old, at)

    def serving(self, model: str, version: int, pool: str, at: float, *, replace: bool = True) -> None:
        """Pool `pool` served `version` from `at`; `replace` False keeps a time already known."""
        entry = self._version(model, version)
        if entry is not None and (replace or pool not in entry["pools"]):
            entry["pools"][pool] = at

    def models(self) -> list[str]:
        return sorted(self._models)

    def describe(self, model: str, origin: str, parents: dict[str, str]) -> list[dict[str, Any]]:
        """Every kept version of `model`, newest first: when the `origin` gateway stored it (published),
        when each gateway and pool had it (seconds after publication), and its slowest hop. `parents`
        names each place's source: "gateway:REGION" or "pool:NAME" -> the place it takes versions from."""
        out = []
        versions = self._models.get(model, {})
        for version in sorted(versions, reverse=True):
            entry = versions[version]
            times = {f"gateway:{r}": t for r, t in entry["gateways"].items()}
            times.update({f"pool:{p}": t for p, t in entry["pools"].items()})
            published = times.get(f"gateway:{origin}")
            slowest = None
            for place, at in times.items():
                source = parents.get(place)
                if source is None or source not in times:
                    continue
                hop = at - times[source]
                if slowest is None or hop > slowest["seconds"]:
                    slowest = {"from": source, "to": place, "seconds": round(hop, 3)}
            after = {place: None if published is None else round(at - published, 3) for place, at in sorted(times.items())}
            out.append({"version": version, "published": published, "after_s": after, "slowest": slowest,
                        "everywhere_s": None if published is None or not after else max(
                            (v for v in after.values() if v is not None), default=None)})
        return out


class Rates:
    """Counters read now and then, as rates per minute over the last `window_s` seconds."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._points: dict[str, deque[tuple[float, float]]] = {}

    def add(self, key: str, value: float | None) -> None:
        if value is None:
            return
        now = self.clock()
        points = self._points.setdefault(key, deque())
        if points and value < points[-1][1]:
            points.clear()  # the counter restarted (its process did)
        points.append((now, value))
        while len(points) > 2 and points[1][0] <= now - self.window_s:
            points.popleft()

    def per_minute(self, key: str) -> float | None:
        points = self._points.get(key)
        if not points or len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        (t0, v0), (t1, v1) = points[0], points[-1]
        return (v1 - v0) / (t1 - t0) * 60.0

    def change(self, key: str) -> float | None:
        """How much the counter grew over the window (None before two readings)."""
        points = self._points.get(key)
        if not points or len(points) < 2:
            return None
        return points[-1][1] - points[0][1]
