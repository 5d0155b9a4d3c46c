"""Pre-rollout curators: decide, before a prompt is leased again, whether it is worth sampling.

A curator sees every completed group (`observe`) and answers `admit(task_id)` when the task cursor
reaches a prompt in a new epoch; a prompt it declines is skipped for that epoch. `accept_all` admits
everything. `filter_solved` skips prompts whose recent groups were solved by every sample.
`greso` (GRESO, "Act Only When It Pays") skips, with a learned probability, prompts whose recent
groups all had the same reward: a prompt seen z times in a row with zero reward variance is sampled
with probability p^z, where p is kept per kind (all solved / all failed) and nudged each observation
so that the share of zero-variance groups of that kind tends to the configured target.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from typing import Callable, Mapping, Protocol

from deltamesh.mesh.broker.config import CuratorConfig
from deltamesh.mesh.broker.policies import resolve
from deltamesh.mesh.broker.store_interface import GroupSummary

GRESO_WINDOW = 256  # observations the zero-variance share is measured over


class Curator(Protocol):
    def admit(self, task_id: str) -> bool: ...

    def observe(self, group: GroupSummary) -> None: ...


class AcceptAll:
    def __init__(self, config: CuratorConfig):
        pass

    def admit(self, task_id: str) -> bool:
        return True

    def observe(self, group: GroupSummary) -> None:
        pass


class FilterSolved:
    """Skip a prompt while each of its last `history` groups had every sample solved."""

    def __init__(self, config: CuratorConfig):
        self.solved_reward = config.solved_reward
        self.recent: defaultdict[str, deque[bool]] = defaultdict(lambda: deque(maxlen=config.history))

    def admit(self, task_id: str) -> bool:
        recent = self.recent.get(task_id)
        return not recent or not all(recent)

    def observe(self, group: GroupSummary) -> None:
        self.recent[group.task_id].append(group.reward_min >= self.solved_reward)


class Greso:
    """Probabilistic skipping of prompts with a run of zero-variance groups, with adaptive probability."""

    def __init__(self, config: CuratorConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.explore = {"easy": config.greso_start, "hard": config.greso_start}
        self.streak: dict[str, tuple[int, str]] = {}  # task -> (zero-variance groups in a row, kind)
        self.window: deque[str] = deque(maxlen=GRESO_WINDOW)  # kind of each observation, or "" if it varied
        self.counts: Counter[str] = Counter()  # of the kinds in `window`

    def admit(self, task_id: str) -> bool:
        run, kind = self.streak.get(task_id, (0, ""))
        return run == 0 or self.rng.random() < self.explore[kind] ** run

    def observe(self, group: GroupSummary) -> None:
        seen = ""
        if group.reward_max > group.reward_min:
            self.streak.pop(group.task_id, None)
        else:
            seen = "easy" if group.reward_min >= self.config.solved_reward else "hard"
            run, _ = self.streak.get(group.task_id, (0, seen))
            self.streak[group.task_id] = (run + 1, seen)
        if len(self.window) == self.window.maxlen:
            self.counts[self.window[0]] -= 1
        self.window.append(seen)
        self.counts[seen] += 1
        for kind in self.explore:
            share = self.counts[kind] / len(self.window)
            step = -self.config.greso_step if share > self.config.greso_target else self.config.greso_step
            self.explore[kind] = min(1.0, max(self.config.greso_min, self.explore[kind] + step))


CURATORS: Mapping[str, Callable[[CuratorConfig], Curator]] = {
    "accept_all": AcceptAll, "filter_solved": FilterSolved, "greso": Greso,
}


def make_curator(config: CuratorConfig) -> Curator:
    return resolve(CURATORS, config.name, "curator")(config)
