"""Data policies of the broker, each a small plug-in: post-rollout group filters, replay selectors, and
the batch planner that applies the staleness bounds, the replay fraction and complete-group assembly.

Filters and selectors are looked up by name in a registry; a name of the form "package.module:callable"
loads a plug-in from elsewhere. A filter sees a just-completed group's summary and says whether to
keep it. A selector orders the replay candidates by preference. The planner is a pure function over
group summaries, so every policy can be tested without a broker, and a batch never splits a group.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

from deltamesh.mesh.broker.store_interface import GroupSummary, GroupVerdict

T = TypeVar("T")

GroupFilter = Callable[[GroupSummary], bool]
"""True keeps the group for training."""

ReplaySelector = Callable[[Sequence[GroupSummary], random.Random], list[GroupSummary]]
"""Orders replay candidates (given oldest first) from most to least preferred."""


def keep_all(group: GroupSummary) -> bool:
    return True


def zero_adv(group: GroupSummary) -> bool:
    """Drop groups whose rewards are all equal: every sample's group-relative advantage would be zero."""
    return group.reward_max > group.reward_min


def select_latest(candidates: Sequence[GroupSummary], rng: random.Random) -> list[GroupSummary]:
    return list(reversed(candidates))


def select_uniform(candidates: Sequence[GroupSummary], rng: random.Random) -> list[GroupSummary]:
    return rng.sample(list(candidates), len(candidates))


def select_reward(candidates: Sequence[GroupSummary], rng: random.Random) -> list[GroupSummary]:
    """Highest mean reward first; among equals, the newest."""
    order = list(reversed(candidates))
    return sorted(order, key=lambda g: -g.reward_mean)  # sorted is stable: ties stay newest-first


GROUP_FILTERS: Mapping[str, GroupFilter] = {"keep_all": keep_all, "zero_adv": zero_adv}
REPLAY_SELECTORS: Mapping[str, ReplaySelector] = {"latest": select_latest, "uniform": select_uniform,
                                                  "reward": select_reward}


def resolve(registry: Mapping[str, T], name: str, kind: str) -> T:
    """A registered plug-in by name, or one loaded from "package.module:callable"."""
    if name in registry:
        return registry[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(registry)} (or use 'module:callable')")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {kind} {name!r}: {e}") from e


def filter_chain(names: Sequence[str]) -> GroupVerdict:
    """The post-rollout verdict: the name of the first filter that drops a group, or None to keep it."""
    filters = [(name, resolve(GROUP_FILTERS, name, "filter")) for name in names]

    def verdict(group: GroupSummary) -> str | None:
        for name, keep in filters:
            if not keep(group):
                return name
        return None

    return verdict


def fill(groups: Sequence[GroupSummary], budget: int) -> list[GroupSummary]:
    """Whole groups in the given order, skipping any that would overflow `budget` samples."""
    chosen, used = [], 0
    for g in groups:
        if used + g.size <= budget:
            chosen.append(g)
            used += g.size
            if used == budget:
                break
    return chosen


def by_staleness(groups: Sequence[GroupSummary], version: int,
                 max_staleness: int | None) -> tuple[list[GroupSummary], list[GroupSummary]]:
    """`groups` split, in order, into (usable, too stale) for a trainer at `version`: a group whose
    oldest sample is more than `max_staleness` versions behind it is too stale (None: no bound)."""
    usable: list[GroupSummary] = []
    stale: list[GroupSummary] = []
    for g in groups:
        too_old = max_staleness is not None and version - g.min_version > max_staleness
        (stale if too_old else usable).append(g)
    return usable, stale


@dataclass
class BatchPlan:
    """What one batch request should do: which groups to serve, drop as stale, or retire from replay."""

    ready: bool
    fresh: list[GroupSummary] = field(default_factory=list)
    replay: list[GroupSummary] = field(default_factory=list)
    stale: list[GroupSummary] = field(default_factory=list)
    retired: list[GroupSummary] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(g.size for g in self.fresh) + sum(g.size for g in self.replay)


@dataclass
class BatchPolicy:
    """The batch-time policies of one broker, from config."""

    max_staleness: int | None = None
    replay_fraction: float = 0.0
    replay_max_staleness: int | None = None
    selector: ReplaySelector = select_latest

    def plan(self, fresh: Sequence[GroupSummary], replay: Sequence[GroupSummary], *, size: int, version: int,
             rng: random.Random) -> BatchPlan:
        """Plan a batch of at most `size` samples for a trainer at `version`.

        Fresh groups (oldest first) more than `max_staleness` versions behind are dropped, as are
        replay groups beyond `replay_max_staleness`. round(replay_fraction * size) samples come from
        replay (whole groups, in the selector's order) when replay holds them; fresh groups fill the
        rest. The batch is ready once enough fresh samples wait to fill it (a group larger than the
        whole batch never fits and waits forever, so size batches in multiples of the group size).
        """
        plan = BatchPlan(ready=False)
        usable, plan.stale = by_staleness(fresh, version, self.max_staleness)
        candidates, plan.retired = by_staleness(replay, version, self.replay_max_staleness)
        quota = round(self.replay_fraction * size)
        if quota and candidates:
            plan.replay = fill(self.selector(candidates, rng), quota)
        need = size - sum(g.size for g in plan.replay)
        if sum(g.size for g in usable) >= need:
            plan.fresh = fill(usable, need)
            plan.ready = bool(plan.fresh)
        return plan
