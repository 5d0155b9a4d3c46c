"""A pool's own checks of what its gateways offer: no rollback, no equivocation, no freeze.

A trainer's signature proves that it made a manifest, not that the manifest is the newest one, nor
the only one under its version number: an old signed version still verifies. TUF's checklist names
what a hostile or broken relay can still do with signed data alone, and a pool checks each itself,
whatever a gateway's plan says. `VersionGuard` keeps the weights hash of every version the pool has
verified (the one its directory holds, each one it moved to, each one a signed head statement named)
and refuses a plan that leads below the held version (rollback) and a target manifest whose weights
hash differs from the one verified for its version (equivocation, or mix-and-match); re-taking the held
version with the same hash stays allowed (a repair). `FreezeWatch` remembers when the pool first
learned of each newer version (another gateway's head, a signed statement, what it holds) and names
the version a gateway's head has stayed below for longer than `stale_after_s` (freeze). `GatewayBook`
is each gateway's standing (ok, stale, refused) as status reports it, and the penalty that makes the
next round go to another gateway. All of it is pure bookkeeping: `deltamesh.mesh.pool.weight_sync` asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from deltamesh.delta import CorruptError, Manifest
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import Plan

REASONS = ("rollback", "equivocation", "statement", "stale")
"""Why a gateway's offer was refused: an older version, another weights hash for a verified version, a
head statement that does not verify (forged, another model), or a gateway behind what is known."""
KEEP_VERSIONS = 256
"""Most (version -> weights hash) entries remembered; the held version is never dropped."""
REFUSED_FOR_S = 300.0
"""How long a gateway that offered something refused is asked only after every other."""
STALE_FOR_S = 30.0
"""How long a stale gateway is asked only after every other (its head is still watched meanwhile)."""


class Rejected(CorruptError):
    """Something a gateway offered that the pool will not take, though it may be validly signed;
    `reason` is one of REASONS. A CorruptError, so a fetcher that meets it in a manifest turns to
    another source, as for any manifest it cannot accept."""

    def __init__(self, reason: str, offered: str) -> None:
        super().__init__(f"{reason}: {offered}")
        self.reason = reason
        self.offered = offered


@dataclass(frozen=True)
class Refusal:
    """One refusal, as logged, counted and reported: why, which gateway, what it offered."""

    reason: str
    gateway: str
    offered: str

    def __str__(self) -> str:
        return f"refused {self.reason} from gateway {self.gateway}: {self.offered}"


class VersionGuard:
    """The weights hash of each version the pool has verified, and the checks made against them."""

    def __init__(self, keep: int = KEEP_VERSIONS) -> None:
        self.keep = keep
        self.held: int | None = None
        self._known: dict[int, str] = {}

    def known(self, version: int) -> str | None:
        return self._known.get(version)

    def hold(self, version: int, weights_hash: str) -> None:
        """The pool now holds `version` with these (verified) weights."""
        self.held = version
        self.know(version, weights_hash)

    def know(self, version: int, weights_hash: str) -> None:
        """Remember a verified (version, weights hash); raises Rejected if another hash was verified before."""
        self.check_hash(version, weights_hash, f"v{version} with weights hash {weights_hash}")
        self._known[version] = weights_hash
        if len(self._known) > self.keep:
            for old in sorted(v for v in self._known if v != self.held)[:len(self._known) - self.keep]:
                del self._known[old]

    def check_hash(self, version: int, weights_hash: str, offered: str) -> None:
        known = self._known.get(version)
        if known is not None and known != weights_hash:
            raise Rejected("equivocation", f"{offered}, where v{version} was verified as {known}")

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan that would leave the pool on an older version than it holds."""
        if self.held is None or not plan.steps:
            return
        target = plan.steps[-1].version
        if target < self.held or plan.to_version < self.held:
            route = ", ".join(f"v{s.version} {s.kind}" for s in plan.steps)
            raise Rejected("rollback", f"a plan to v{plan.to_version} ({route}) while the pool holds v{self.held}")

    def check_manifest(self, m: Manifest) -> None:
        """Refuse a signed manifest whose weights hash differs from the one verified for its version (the
        final step of a plan: the weights the pool moves to; a step on the way is checked by its result)."""
        self.check_hash(m.version, m.weights_hash, f"{m.model_id} v{m.version} {m.kind} with weights hash "
                                                   f"{m.weights_hash}")


class FreezeWatch:
    """When the pool first learned of each newer version, and which heads have stayed below one too long.

    Each round brings claims: what the pool holds, the version of a verified head statement, the heads
    of its gateways in good standing. Only claims that still stand count: a version no gateway claims
    any more (a liar that was dropped) is forgotten, so an unsigned boast cannot mark honest gateways
    stale for ever."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._seen: list[tuple[int, float]] = []
        """(version, when first claimed), versions increasing."""

    def update(self, claims: Iterable[int | None], now: float) -> None:
        newest = max((c for c in claims if c is not None), default=None)
        if newest is None:
            self._seen.clear()
            return
        self._seen = [(v, t) for v, t in self._seen if v <= newest]
        if not self._seen or newest > self._seen[-1][0]:
            self._seen.append((newest, now))
        overdue = [i for i, (_, t) in enumerate(self._seen) if now - t > self.stale_after_s]
        if overdue:  # below the newest overdue version, nothing more is learned from older ones
            del self._seen[:overdue[-1]]

    def behind(self, head: int | None, now: float) -> int | None:
        """The version `head` has stayed below for longer than the bound, or None (also when off)."""
        if not self.stale_after_s:
            return None
        for version, first in reversed(self._seen):
            if now - first > self.stale_after_s:
                return version if head is None or head < version else None
        return None


@dataclass
class Standing:
    """One gateway as the pool sees it."""

    url: str
    head: int | None = None
    state: str = "ok"
    """ok, stale (behind a version known elsewhere, or no fresh statement) or refused (offered something refused)."""
    reason: str = ""
    since: float = 0.0
    """When (wall clock) it entered this state."""
    until: float = 0.0
    """Monotonic time a refusal lapses (the gateway is trusted with rounds again)."""


@dataclass
class GatewayBook:
    """The standing of each gateway a pool follows, and refusals by reason."""

    sources: Sequence[Source]
    refusals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _standing: dict[str, Standing] = field(default_factory=dict)

    def standing(self, source: Source) -> Standing:
        s = self._standing.setdefault(source.url, Standing(source.url))
        if s.state == "refused" and time.monotonic() >= s.until:
            self._set(s, "ok", "")
        return s

    def saw_head(self, source: Source, head: int | None) -> None:
        self.standing(source).head = head

    def trusted(self, source: Source) -> bool:
        """Whether its unsigned word (its head) counts as a claim: not while a refusal of it stands."""
        return self.standing(source).state != "refused"

    def refused(self, source: Source, refusal: Refusal) -> None:
        s = self.standing(source)
        self.refusals[refusal.reason] += 1
        self._set(s, "refused", f"{refusal.reason}: {refusal.offered}")
        s.until = time.monotonic() + REFUSED_FOR_S
        source.bad_until = max(source.bad_until, s.until)

    def stale(self, source: Source, why: str) -> bool:
        """Flag `source` stale (and ask it last for a while); True if it was not stale already."""
        s = self.standing(source)
        source.bad_until = max(source.bad_until, time.monotonic() + STALE_FOR_S)
        if s.state != "ok":
            s.reason = why if s.state == "stale" else s.reason
            return False
        self.refusals["stale"] += 1
        self._set(s, "stale", why)
        return True

    def fresh(self, source: Source) -> bool:
        """`source` is no longer behind: clear a stale flag (and its penalty); True if it was stale."""
        s = self.standing(source)
        if s.state != "stale":
            return False
        self._set(s, "ok", "")
        source.bad_until = 0.0
        return True

    def newest_head(self) -> int | None:
        """The newest head the gateways in good standing (not refused) announced at their last answer."""
        return max((s.head for s in (self.standing(x) for x in self.sources)
                    if s.head is not None and s.state != "refused"), default=None)

    def describe(self) -> dict[str, dict]:
        out = {}
        for source in self.sources:
            s = self.standing(source)
            out[s.url] = {"head": s.head, "state": s.state, "reason": s.reason, "since": s.since or None}
        return out

    @staticmethod
    def _set(s: Standing, state: str, reason: str) -> None:
        s.state, s.reason, s.since = state, reason, time.time()
