"""What an execution returns: one outcome per test, with the tail of what the test wrote."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    """The test's assertion failed."""
    ERROR = "error"
    """The program or test raised, exited early, or killed the runner."""
    TIMEOUT = "timeout"
    """Past the test's or the execution's wall clock."""
    RESOURCE_LIMIT = "resource_limit"
    """CPU seconds, memory, file size, open files, processes or scratch space ran out."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run (bwrap failed to start, the interpreter is unreachable): a
    fault of the pool's setup, never an outcome of the program."""


class SandboxUnavailable(SandboxError):
    """Bubblewrap is missing and no weaker isolation was configured: model-written code is refused."""


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest class, whatever its name

    index: int
    outcome: Outcome
    stderr: str = ""
    """The tail of the test's stdout and stderr (at most the configured output_bytes), and why it was
    stopped where the runner stopped it."""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome is Outcome.PASSED


@dataclass(frozen=True)
class ExecutionResult:
    """The results of one program against its tests, in the order of the tests."""

    tests: tuple[TestResult, ...]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """Every test passed (and there was at least one)."""
        return bool(self.tests) and all(t.passed for t in self.tests)

    @property
    def pass_rate(self) -> float:
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0

    def counts(self) -> Counter[Outcome]:
        return Counter(t.outcome for t in self.tests)
