"""The held-out set an evaluator scores every version on, as workflow tasks.

`heldout_records` builds it from `[eval.heldout]`: the arithmetic family's held-out split (never in a
training set that `train_tasks` draws with the same `split_seed` and share), HumanEval for the code
workflows, or the in-repo code problems. `heldout_tasks` turns the records into `Task`s asking
`samples` answers each, and `set_digest` names the set (a digest of its problem ids), stored with every
result so that scores of different sets are never compared by mistake.
"""

from __future__ import annotations

import hashlib
from typing import Any

from deltamesh.mesh.eval.config import HeldoutConfig
from deltamesh.mesh.workflows import Task, arithmetic
from deltamesh.mesh.workflows.code_tasks import humaneval_problems, synthetic_problems


def heldout_records(config: HeldoutConfig) -> list[dict[str, Any]]:
    """The held-out problems as dataset records ({"id", "prompt", "metadata"})."""
    if config.family == "arithmetic":
        return arithmetic.heldout_tasks(config.problems, config.levels, split_seed=config.split_seed,
                                        heldout_percent=config.heldout_percent, wording=config.wording)
    problems = humaneval_problems() if config.family == "humaneval" else synthetic_problems()
    return [p.record() for p in problems[:config.problems]]


def heldout_tasks(records: list[dict[str, Any]], samples: int) -> list[Task]:
    """One task per record, asking `samples` answers (the n of avg@n)."""
    return [Task(task_id=r["id"], prompt=r["prompt"], group_id=f"eval/{r['id']}", metadata=dict(r["metadata"]),
                 n_samples=samples) for r in records]


def set_digest(records: list[dict[str, Any]]) -> str:
    """A short digest of the set's problem ids, in order."""
    return hashlib.blake2b("\n".join(r["id"] for r in records).encode(), digest_size=8).hexdigest()
