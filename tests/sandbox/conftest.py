"""Fixtures of the sandbox tests: a bwrap sandbox with short limits, and a way to run executions."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Callable, Sequence

import pytest

from deltamesh.mesh.sandbox import ExecutionResult, Sandbox, SandboxConfig

SETUP = Path(__file__).resolve().parents[2] / "benchmarks" / "setup_sandbox.sh"
# Short limits keep hostile programs cheap on a 2-core machine; the CPU limit is above the per-test
# wall clock so that a busy loop is a timeout, not a CPU kill (test_limits sets its own for that).
FAST = SandboxConfig(test_timeout_s=1.0, timeout_s=10.0, cpu_s=3, memory_bytes=256 << 20, processes=12)


@pytest.fixture(scope="session")
def bwrap_ok() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail(f"bubblewrap is not installed: run {SETUP}")


def run_all(sandbox: Sandbox, jobs: Sequence[tuple[str, Sequence[str]]]) -> list[ExecutionResult]:
    """Run the (program, tests) jobs concurrently on one sandbox, in one event loop."""

    async def go() -> list[ExecutionResult]:
        return list(await asyncio.gather(*(sandbox.run(program, tests) for program, tests in jobs)))

    return asyncio.run(go())


@pytest.fixture
def run_jobs() -> Callable[[Sandbox, Sequence[tuple[str, Sequence[str]]]], list[ExecutionResult]]:
    return run_all


@pytest.fixture
def fast_config() -> SandboxConfig:
    return FAST


@pytest.fixture
def sandbox(bwrap_ok) -> Sandbox:
    return Sandbox(FAST)
