"""Scoring one version: every held-out problem answered `n` times through the workflow, avg@n.

The workflow's own episode generates and scores each answer, so an answer is read exactly as in
training (the same prompt, template and answer check); the trajectories it returns are counted and
dropped, never submitted anywhere. A sample is correct when the workflow says so (`metadata
["correct"]`, or for the code workflows a reward of 1: every hidden test passed). avg@n is the mean
correctness over all problems' samples; `by_level` splits it by the problems' `level` where they have
one (the arithmetic family's difficulty). An episode that fails counts its samples as wrong and is
reported in `failed`. All problems go to the engine at once (the pool's batcher merges them).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from deltamesh.data import Trajectory
from deltamesh.mesh.workflows import EpisodeContext, Task, Workflow

log = logging.getLogger(__name__)


@dataclass
class Score:
    accuracy: float
    """avg@n: correct samples / all samples."""
    correct: int
    samples: int
    problems: int
    failed: int = 0
    """Episodes that raised (their samples counted wrong)."""
    by_level: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def sample_correct(t: Trajectory) -> bool:
    if "correct" in t.metadata:
        return bool(t.metadata["correct"])
    return t.reward >= 1.0


async def score_tasks(workflow: Workflow, ctx: EpisodeContext, tasks: Sequence[Task]) -> Score:
    """Run every task's episode and count the correct samples of the scored model (its trajectories only)."""
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(workflow.run(t, ctx) for t in tasks), return_exceptions=True)
    correct = samples = failed = 0
    levels: dict[str, list[float]] = defaultdict(list)
    for task, outcome in zip(tasks, outcomes):
        if isinstance(outcome, BaseException):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            failed += 1
            log.warning("eval episode of %s failed: %s: %s", task.task_id, type(outcome).__name__, outcome)
            marks = [False] * task.n_samples
        else:
            marks = [sample_correct(t) for t in outcome][:task.n_samples]
            marks += [False] * (task.n_samples - len(marks))
        correct += sum(marks)
        samples += len(marks)
        if "level" in task.metadata:
            levels[str(task.metadata["level"])].append(statistics.fmean(marks))
    return Score(accuracy=correct / samples if samples else 0.0, correct=correct, samples=samples,
                 problems=len(tasks), failed=failed,
                 by_level={lv: statistics.fmean(v) for lv, v in sorted(levels.items())},
                 seconds=time.perf_counter() - started)
