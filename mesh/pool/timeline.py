"""When each version reached each stage of its way into a pool: the pool's side of the latency budget.

Per policy, `VersionTimeline` keeps the wall-clock time (`time.time()` on the pool's host, so it can be
set beside the trainer's and the gateways' clocks; across hosts that assumes NTP) at which each of the
last `keep` versions reached each stage of a sync round (mesh/pool/weights.py):

- `head`: the round learned from a gateway that the version exists (its long poll answered);
- `fetched`: every piece of the version's plan step is in, signature and piece hashes checked;
- `verified`: the step is decoded (the pieces' contents checked against the manifest);
- `applied`: the engine holds it (updated in place, or loaded from the synced directory);
- `serving`: the engine serves it (or a newer version) and the check of what it serves passed: the
  pool would now lease rollouts on it;
- `persisted`: the synced directory holds it: after `serving` for an engine updated in place (the
  disk is not on the way to serving), before `applied` for an engine that loads from the directory.

A version brought in by a plan step of its own (each delta of a chain) gets its own times; a
version a full snapshot jumped over has none (it was never in the pool). A stage reached again
(a delta that failed and came again as a full snapshot) keeps the later time. The pool's status JSON
shows `describe()` as `models[model_id]["timeline"]`, and each stage's time since the previous
stage of the same version feeds the `deltamesh_pool_version_stage_seconds` histogram.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable

STAGES = ("head", "fetched", "verified", "applied", "serving", "persisted")
KEEP = 64


class VersionTimeline:
    """The stage times of a policy's last `keep` versions (see the module docstring)."""

    def __init__(self, keep: int = KEEP, *, on_stage: Callable[[str, float], None] | None = None) -> None:
        self.keep = keep
        self.on_stage = on_stage
        """Told (stage, seconds since the version's latest other stage) as each stage after its first is reached."""
        self._versions: OrderedDict[int, dict[str, float]] = OrderedDict()

    def mark(self, versions: int | Iterable[int], stage: str, at: float | None = None) -> None:
        """Note that `versions` reached `stage` now (or at wall time `at`)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        at = time.time() if at is None else at
        for version in [versions] if isinstance(versions, int) else versions:
            stages = self._versions.get(version)
            if stages is None:
                stages = self._versions[version] = {}
                while len(self._versions) > self.keep:
                    self._versions.popitem(last=False)  # versions arrive in order: the oldest goes
            before = [t for s, t in stages.items() if s != stage]
            stages[stage] = at
            if before and self.on_stage is not None:
                self.on_stage(stage, max(0.0, at - max(before)))

    def get(self, version: int) -> dict[str, float]:
        """The stages version `version` reached, with their times (empty if none is known)."""
        return dict(self._versions.get(version, {}))

    def describe(self) -> dict[str, dict[str, float]]:
        """version (as a string: a JSON key) -> {stage: wall time}, oldest first."""
        return {str(v): dict(stages) for v, stages in self._versions.items()}
