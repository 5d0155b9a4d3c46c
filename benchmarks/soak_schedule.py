"""The soak's fault schedule: which fault hits what, when and for how long, drawn from one seed.

`make_schedule(seed, minutes)` is a pure function of its arguments: the same seed gives the same list of
`PlannedFault`s, so a violation found in one run is replayed by running the soak with its seed. Faults
arrive `GAP_S` apart on average; their kinds come in shuffled rounds of every kind, so a short run
meets each kind early and a long one meets them all evenly. Each fault holds the resources it touches
(a service, a link, a store, PostgreSQL) for its duration plus the time its target takes to come back
(`recovery_s`); a fault is placed only where nothing it holds is held, and at most `MAX_CONCURRENT`
run at once, so faults overlap (a relay restarting while PostgreSQL fails over while a pool applies
a version) without one fault undoing another.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

GAP_S = (6.0, 22.0)
"""Seconds from one fault's planned start to the next: uniform in this range (mean 14 s)."""
MAX_CONCURRENT = 3

GATEWAYS = ("gateway-us", "gateway-eu", "gateway-ap")
POOLS = ("pool-us-1", "pool-eu-1", "pool-eu-2", "pool-ap-1")
BROKERS = ("broker:active", "broker:standby")
"""A broker fault names a role; which broker holds it is looked up when the fault fires."""
TRAINER = ("trainer",)
PROCESSES = GATEWAYS + POOLS + BROKERS + TRAINER
LINKS = ("core-eu", "eu-ap", "core-ap")
REGIONS = ("us", "eu", "ap")

KINDS = ("kill", "stop", "pg_failover", "link_cut", "link_trickle", "link_loss", "disk_full", "corrupt_piece",
         "malicious_relay", "clock_jump")
WEIGHTS = {"kill": 2, "stop": 2}
"""Rounds hold each kind this many times (default once): processes die more often than disks fill."""
RECOVERY_S = {"kill": 25.0, "stop": 5.0, "pg_failover": 20.0, "malicious_relay": 25.0}
"""Time a fault's target needs after it is healed, kept free of other faults on it."""


@dataclass
class PlannedFault:
    index: int
    at_s: float
    """Seconds after the fault phase starts."""
    kind: str
    target: str
    duration_s: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def holds(self) -> tuple[str, ...]:
        """The resources no other fault may touch while this one runs."""
        if self.kind in ("kill", "stop", "clock_jump"):
            return (self.target,)
        if self.kind == "pg_failover":
            return ("postgres",)
        if self.kind.startswith("link_"):
            return (self.target,)
        if self.kind in ("disk_full", "corrupt_piece"):
            return (f"store:{self.target}",)
        return (f"gateway-{self.target}", f"store:{self.target}")  # malicious_relay

    @property
    def busy_s(self) -> float:
        return self.duration_s + RECOVERY_S.get(self.kind, 2.0)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"#{self.index} {self.kind} {self.target} for {self.duration_s:.1f} s {extra}".rstrip()

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _draw(kind: str, rng: random.Random, processes: tuple[str, ...]) -> tuple[str, float, dict[str, Any]]:
    """Target, duration and parameters of one fault of `kind`."""
    if kind == "kill":
        return rng.choice(processes), round(rng.uniform(0.5, 8.0), 1), {}
    if kind == "stop":
        return rng.choice(processes), round(rng.uniform(2.0, 15.0), 1), {}
    if kind == "pg_failover":
        return "postgres", 0.0, {}
    if kind == "link_cut":
        return rng.choice(LINKS), round(rng.uniform(3.0, 20.0), 1), {}
    if kind == "link_trickle":
        return rng.choice(LINKS), round(rng.uniform(5.0, 30.0), 1), {"mbit": round(rng.uniform(0.05, 0.5), 2)}
    if kind == "link_loss":
        return rng.choice(LINKS), round(rng.uniform(5.0, 30.0), 1), {"probability": round(rng.uniform(0.02, 0.3), 3)}
    if kind == "disk_full":
        return rng.choice(REGIONS), round(rng.uniform(5.0, 30.0), 1), {}
    if kind == "corrupt_piece":
        return rng.choice(REGIONS), 0.0, {"pick": rng.randrange(1 << 30)}
    if kind == "malicious_relay":
        return "eu", round(rng.uniform(15.0, 40.0), 1), {"mode": rng.choice(("tamper", "rollback"))}
    if kind == "clock_jump":
        process = rng.choice(processes)
        seconds = rng.choice((-1, 1, 1)) * round(rng.uniform(20.0, 150.0 if rng.random() < 0.5 else 900.0), 1)
        return process, round(rng.uniform(5.0, 60.0), 1), {"seconds": max(seconds, -150.0)}
    raise ValueError(f"unknown fault kind {kind!r}")


def make_schedule(seed: int, minutes: float, kinds: tuple[str, ...] = KINDS,
                  extra_processes: tuple[str, ...] = ()) -> list[PlannedFault]:
    """The faults of a fault phase of `minutes`, in start order (see the module docstring);
    `extra_processes` (a vLLM pool) join the processes a fault may hit."""
    rng = random.Random(seed)
    processes = PROCESSES + tuple(extra_processes)
    end_s = minutes * 60.0
    busy: dict[str, float] = {}
    running: list[float] = []  # end times of placed faults
    rounds: list[str] = []
    planned: list[PlannedFault] = []
    t = rng.uniform(*GAP_S) / 2
    while t < end_s:
        if not rounds:
            rounds = [k for k in kinds for _ in range(WEIGHTS.get(k, 1))]
            rng.shuffle(rounds)
        kind = rounds[0]
        for _ in range(20):  # a target that is free now, if the kind has one
            target, duration, params = _draw(kind, rng, processes)
            fault = PlannedFault(len(planned), round(t, 1), kind, target, duration, params)
            if all(busy.get(r, 0.0) <= t for r in fault.holds):
                break
        else:
            fault = None
        running = [end for end in running if end > t]
        if fault is not None and len(running) < MAX_CONCURRENT and t + fault.duration_s < end_s:
            rounds.pop(0)
            planned.append(fault)
            for r in fault.holds:
                busy[r] = t + fault.busy_s
            running.append(t + fault.duration_s)
        t += rng.uniform(*GAP_S)
    return planned


def count_kinds(faults: list[PlannedFault]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for f in faults:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return counts
