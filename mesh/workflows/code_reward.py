"""From a model's completion to a program, and from the sandbox's per-test outcomes to a reward.

A completion continues the problem's prompt (the HumanEval convention) and is cut at the first line
that leaves the function (HumanEval's stop sequences: a top-level `def`, `class`, `if`, `print` or
comment). A completion holding a fenced ```python block uses a block instead: the first one that
defines the entry point, after what the prompt holds before the entry point's `def` (its imports and
helpers), else the first block after the prompt. The reward of a program is 1.0 when every hidden
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
    blocks = [m.group(1) for m in _FENCE.finditer(completion)]
    if blocks:
        defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.M)
        whole = next((b for b in blocks if defines.search(b)), None)
        if whole is not None:
            return _preamble(prompt, entry_point) + whole
        return prompt + blocks[0]
    body = completion
    for stop in STOP_SEQUENCES:
        cut = body.find(stop)
        if cut >= 0:
            body = body[:cut]
    return prompt + body + "\n"


def _preamble(prompt: str, entry_point: str) -> str:
    """What the prompt holds before the entry point's `def` (imports, helper functions), to run before a
    function written out whole: a model that rewrites `def f(xs: List[int])` seldom repeats the import."""
    found = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.M)
    return prompt[:found.start()] if found else ""


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
