"""Outcomes per test, limits, the execution's wall clock, and concurrency bounded by the workers."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from deltamesh.mesh.sandbox import Outcome, Sandbox

ADD = "def add(a, b):\n    return a + b\n"


def test_a_passing_and_a_failing_program(sandbox, run_jobs):
    good, bad = run_jobs(sandbox, [(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]),
                                   (ADD.replace("a + b", "a - b"), ["assert add(1, 2) == 3", "assert add(1, 0) == 1"])])
    assert good.passed and good.pass_rate == 1.0
    assert [t.outcome for t in bad.tests] == [Outcome.FAILED, Outcome.PASSED]
    assert not bad.passed and bad.pass_rate == 0.5
    assert "AssertionError" in bad.tests[0].stderr and "<test>" in bad.tests[0].stderr
    assert sandbox.counts == {Outcome.PASSED: 3, Outcome.FAILED: 1}


def test_errors_are_reported_per_test_with_their_traceback(sandbox, run_jobs):
    syntax, raises, exits = run_jobs(sandbox, [("def f(:\n", ["pass"]), (ADD, ["add(1, 'x')", "print('out')"]),
                                              ("import sys\nsys.exit(0)\n", ["pass"])])
    assert syntax.tests[0].outcome is Outcome.ERROR and "SyntaxError" in syntax.tests[0].stderr
    assert [t.outcome for t in raises.tests] == [Outcome.ERROR, Outcome.PASSED]
    assert "TypeError" in raises.tests[0].stderr and raises.tests[1].stderr == "out\n"
    assert exits.tests[0].outcome is Outcome.ERROR and "SystemExit" in exits.tests[0].stderr


def test_cpu_open_files_and_file_size_limits(bwrap_ok, run_jobs, fast_config):
    sandbox = Sandbox(replace(fast_config, cpu_s=1, test_timeout_s=5.0, open_files=16, file_size_bytes=1 << 20))
    result, = run_jobs(sandbox, [("", ["while True:\n    pass",
                                       "files = [open('/dev/null') for _ in range(64)]",
                                       "open('big', 'wb').write(b'x' * (2 << 20))"])])
    assert [t.outcome for t in result.tests] == [Outcome.RESOURCE_LIMIT] * 3
    assert "SIGXCPU" in result.tests[0].stderr or "SIGKILL" in result.tests[0].stderr


def test_past_the_executions_wall_clock_the_rest_are_timeouts(bwrap_ok, run_jobs, fast_config):
    sandbox = Sandbox(replace(fast_config, timeout_s=1.5, test_timeout_s=1.0))
    started = time.monotonic()
    result, = run_jobs(sandbox, [("import time\n", ["pass", "time.sleep(0.8)", "time.sleep(0.8)", "pass"])])
    assert time.monotonic() - started < 5
    outcomes = [t.outcome for t in result.tests]
    assert outcomes[:2] == [Outcome.PASSED, Outcome.PASSED] and outcomes[3] is Outcome.TIMEOUT


def test_workers_bound_the_executions_that_run_at_once(bwrap_ok, run_jobs, fast_config):
    sandbox = Sandbox(replace(fast_config, workers=2))
    started = time.monotonic()
    results = run_jobs(sandbox, [("import time\n", ["time.sleep(0.4)"])] * 4)
    assert all(r.passed for r in results)
    assert time.monotonic() - started >= 0.8  # two rounds of two


def test_the_sandbox_runs_as_the_unprivileged_uid_on_the_host(sandbox):
    if os.geteuid() != 0:
        pytest.skip("only a root pool changes uid")

    async def go():
        run = asyncio.ensure_future(sandbox.run("import time\n", ["time.sleep(0.6)"]))
        await asyncio.sleep(0.3)
        uids = {}
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(os.getpid()):
                uids[fields["Name"].strip()] = fields["Uid"].split()
        assert (await run).passed
        return uids

    uids = asyncio.run(go())
    assert uids["bwrap"] == [str(sandbox.config.uid)] * 4  # real, effective, saved, filesystem
