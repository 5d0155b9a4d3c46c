"""From a model's completion to a program, and from the sandbox's per-test outcomes to a reward.

A completion continues the problem's prompt (the HumanEval convention) and is cut at the first line
that leaves the function (HumanEval's stop sequences: a top-level `def`, `class`, `if`, `print` or
comment). A completion holding a fenced ```python block uses that block instead: on its own when it
defines the entry point, else after the prompt. The reward of a program is 1.0 when every hidden
test passes and 0.0 otherwise (HumanEval's pass/fail), or the share of tests passed with
`partial_credit`. Errors, timeouts and resource limits are failures of the program like a failed
assert; faults of the sandbox itself (SandboxError) are not scored: they fail the episode.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

from deltamesh.mesh.sandbox import ExecutionResult, Outcome

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def program_from_completion(prompt: str, completion: str, entry_point: str) -> str:
    """The program a completion stands for (see the module docstring)."""
    fenced = _FENCE.search(completion)
    if fenced is not None:
        block = fenced.group(1)
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", block, re.M):
            return block
        return prompt + block
    body = completion
    for stop in STOP_SEQUENCES:
        cut = body.find(stop)
        if cut >= 0:
            body = body[:cut]
    return prompt + body + "\n"


def pass_reward(result: ExecutionResult, *, partial_credit: bool = False) -> float:
    """1.0 when every test passed (else 0.0), or the pass rate with `partial_credit`."""
    return result.pass_rate if partial_credit else (1.0 if result.passed else 0.0)


def outcome_counts(results: Iterable[ExecutionResult]) -> dict[str, int]:
    """Per-test outcomes over several executions, by outcome name (every outcome present, JSON-ready)."""
    counts: Counter[Outcome] = Counter()
    for r in results:
        counts.update(r.counts())
    return {o.value: counts[o] for o in Outcome}


def failure_report(result: ExecutionResult, tests: Sequence[str], max_chars: int) -> str:
    """The failing tests with their outcome and output tail, as feedback a model can read; at most
    `max_chars` (each test's output keeps its end, where the traceback's last line is)."""
    parts = []
    for t in result.tests:
        if not t.passed:
            output = t.stderr.strip()
            parts.append(f"{tests[t.index].strip()}\n-> {t.outcome.value}" + (f": {output[-300:]}" if output else ""))
    return "\n".join(parts)[:max_chars]
