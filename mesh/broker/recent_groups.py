"""The trajectories of groups a store committed recently, kept in memory until a batch takes them.

A batch usually takes groups within seconds of their commit. Reading their payloads back from a
PostgreSQL server costs both sides what the commit did (the server detoasts and sends every payload,
the broker receives and unpacks it, on the same cores that take the next commits), so PostgresStore
keeps what it has just committed and reads back only what it does not hold: groups committed before
this broker started (a takeover), ones evicted to stay inside the byte budget, replays, and a batch
delivered again. An entry holds a group only when every one of its samples was committed by this
store object, so a hit is always the whole group, in the order its samples were stored.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.store_interface import GroupKey

DEFAULT_BUDGET_BYTES = 256 << 20
"""About 10,000 trajectories of 2,048 tokens: several batches of 256 waiting, on any broker host."""


def _nbytes(t: Trajectory) -> int:
    return t.tokens.nbytes + t.logprobs.nbytes + t.versions.nbytes + t.loss_mask.nbytes


class RecentGroups:
    """Groups by key, oldest first evicted past `budget_bytes`. Used from the store's thread only."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self._groups: OrderedDict[GroupKey, list[Trajectory]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._groups)

    def committed(self, key: GroupKey, samples: Sequence[Trajectory], *, new_group: bool) -> None:
        """`samples` of group `key` are committed; `new_group`: none of its samples was stored before."""
        held = self._groups.get(key)
        if held is None and not new_group:
            return  # its earlier samples are only in the database: a partial entry would be wrong
        if held is None:
            held = self._groups[key] = []
        held.extend(samples)
        self._bytes += sum(_nbytes(t) for t in samples)
        while self._bytes > self.budget_bytes and self._groups:
            self.discard([next(iter(self._groups))])

    def get(self, key: GroupKey) -> list[Trajectory] | None:
        """The group's samples, in the order they were stored; None when it is not held."""
        return self._groups.get(key)

    def discard(self, keys: Iterable[GroupKey]) -> None:
        for key in keys:
            samples = self._groups.pop(key, None)
            if samples is not None:
                self._bytes -= sum(_nbytes(t) for t in samples)

    def clear(self) -> None:
        self._groups.clear()
        self._bytes = 0
