"""Runs model-written Python against its tests, isolated, many executions at once.

`await Sandbox(config).run(program, tests)` starts one sandbox process (see command.py) running the
runner (harness.py), hands it the job on stdin and reads one result line per test from its stdout.
At most `config.workers` executions run at once. Past `config.timeout_s` the whole process group is
killed (with bwrap, killing its outer process ends the PID namespace and everything in it); the tests
without a result are then timeouts. A runner that dies early (a program that killed it) leaves its
remaining tests as errors. Faults of the sandbox itself raise SandboxError.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import marshal
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from deltamesh.mesh.sandbox.command import ENV, bwrap_argv, probe_runtime, rlimits_argv
from deltamesh.mesh.sandbox.config import SandboxConfig
from deltamesh.mesh.sandbox.results import ExecutionResult, Outcome, SandboxError, SandboxUnavailable, TestResult

log = logging.getLogger(__name__)
HARNESS = Path(__file__).with_name("harness.py")
RUNNER_STDERR_BYTES = 4096


class Sandbox:
    """`await run(program, tests)` -> ExecutionResult; `counts` holds the outcomes served so far."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._bwrap: str | None = None
        if self.config.isolation == "bwrap":
            self._bwrap = shutil.which(self.config.bwrap)
            if self._bwrap is None:
                raise SandboxUnavailable(
                    f"bubblewrap ({self.config.bwrap!r}) is not installed: refusing to run model-written code. "
                    "Install the OS package `bubblewrap`, or set sandbox isolation to 'rlimits' to accept a "
                    "weaker sandbox without namespaces (the code then sees the host's files and network)")
        else:
            log.warning("sandbox isolation is 'rlimits': model-written code runs without namespaces and can "
                        "read whatever uid %d can read and reach the network", self.config.uid)
        self._runtime = probe_runtime(self.config.python)
        self._harness = HARNESS.read_text()
        self._slots = asyncio.Semaphore(self.config.workers)
        self._as_other_user = os.geteuid() == 0
        self.counts: Counter[Outcome] = Counter()

    async def run(self, program: str, tests: Sequence[str]) -> ExecutionResult:
        """Run `program` and then each test (Python source, typically asserts) in a fresh process."""
        size = len(program.encode()) + sum(len(t.encode()) for t in tests)
        if size > self.config.max_source_bytes:
            raise ValueError(f"program and tests are {size} bytes, over max_source_bytes "
                             f"{self.config.max_source_bytes}")
        if not tests:
            return ExecutionResult(())
        async with self._slots:
            result = await self._execute(program, list(tests))
        self.counts.update(result.counts())
        return result

    def _spawn_options(self, scratch: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {"env": ENV, "start_new_session": True, "cwd": scratch or "/"}
        if self._as_other_user:
            # setuid before exec (no preexec_fn): bwrap then makes its user namespace as this uid, whose
            # RLIMIT_NPROC binds, unlike root's.
            options.update(user=self.config.uid, group=self.config.gid, extra_groups=[])
        return options

    async def _execute(self, program: str, tests: list[str]) -> ExecutionResult:
        cfg = self.config
        # marshal, not JSON: the runner then needs no json import (~10 ms of every execution's start-up).
        job = marshal.dumps({
            "program": program, "tests": tests, "test_timeout_s": cfg.test_timeout_s, "output_bytes": cfg.output_bytes,
            "limits": {"cpu_s": cfg.cpu_s, "memory_bytes": cfg.memory_bytes, "file_size_bytes": cfg.file_size_bytes,
                       "open_files": cfg.open_files, "processes": cfg.processes},
        })
        scratch = None
        if self._bwrap:
            argv = bwrap_argv(self._bwrap, cfg, self._runtime, self._harness)
        else:
            argv = rlimits_argv(self._runtime, self._harness)
            scratch = tempfile.mkdtemp(prefix="deltamesh-sandbox-")
            if self._as_other_user:
                os.chown(scratch, cfg.uid, cfg.gid)
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            limit=8 * cfg.output_bytes + 4096, **self._spawn_options(scratch))
        stderr_task = asyncio.ensure_future(_read_capped(proc.stderr, RUNNER_STDERR_BYTES))
        lines: list[bytes] = []
        timed_out = False
        try:
            async with asyncio.timeout(cfg.timeout_s):
                await _feed(proc, job)
                while line := await proc.stdout.readline():
                    lines.append(line)
                await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            await proc.wait()
            runner_stderr = await stderr_task
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        if not lines or lines[0] != b"ready\n":
            if not timed_out:
                raise SandboxError(f"the sandbox did not start (exit {proc.returncode}): {runner_stderr.strip()}")
            lines = [b""]
        return ExecutionResult(_results(lines[1:], len(tests), timed_out, runner_stderr), time.monotonic() - start)


async def _feed(proc: asyncio.subprocess.Process, job: bytes) -> None:
    try:
        proc.stdin.write(job)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the runner is gone; its stderr says why


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> str:
    """Keep the first `cap` bytes and drain the rest, so that the writer never blocks on a full pipe."""
    kept = b""
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, cap - len(kept))]
    return kept.decode("utf-8", "replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parse(line: bytes) -> TestResult | None:
    """`result INDEX OUTCOME SECONDS BASE64` (harness.py); None for anything else."""
    try:
        tag, index, outcome, seconds, output = line.decode("ascii").rstrip("\n").split(" ")
        if tag != "result":
            return None
        return TestResult(int(index), Outcome(outcome), binascii.a2b_base64(output).decode("utf-8", "replace"),
                          float(seconds))
    except (ValueError, binascii.Error):
        return None


def _results(lines: list[bytes], n_tests: int, timed_out: bool, runner_stderr: str) -> tuple[TestResult, ...]:
    by_index = {r.index: r for r in map(_parse, lines) if r is not None}
    results = []
    for index in range(n_tests):
        result = by_index.get(index)
        if result is not None:
            results.append(result)
        elif timed_out:
            results.append(TestResult(index, Outcome.TIMEOUT, "the execution ran past its wall clock"))
        else:
            note = "the test runner ended before this test finished (did the program kill it?)"
            results.append(TestResult(index, Outcome.ERROR, f"{note}\n{runner_stderr[-1024:]}".strip()))
    return tuple(results)
