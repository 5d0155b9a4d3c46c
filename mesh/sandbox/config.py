"""The sandbox's settings: how it isolates model-written code, its limits and how many run at once.

Every field is for the operator who configures a pool (its config file); none is ever taken from a
task, a model or a peer. The limits apply to each test's process; `processes` counts every process
of one execution. Worst-case memory is about workers x processes x memory_bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Literal

Isolation = Literal["bwrap", "rlimits"]
ISOLATIONS: tuple[str, ...] = ("bwrap", "rlimits")
NOBODY = 65534


@dataclass(frozen=True)
class SandboxConfig:
    """Limits per test process, per execution, and the isolation mode (see docs/SANDBOX.md)."""

    isolation: Isolation = "bwrap"
    """"bwrap": bubblewrap namespaces (user, PID, network, mount, IPC, UTS), only the Python runtime
    visible read-only plus a private tmpfs. "rlimits": a weaker mode for operators on a machine where
    bubblewrap cannot run and the code is not hostile (development, the benchmark's baseline): the same
    runner, rlimits and unprivileged uid, but no namespaces: the program sees the host's filesystem
    and network as that uid. Never chosen automatically: a sandbox without bwrap refuses to run."""
    workers: int = 2
    """Executions that run at once; more wait their turn."""
    timeout_s: float = 20.0
    """Wall clock of one execution, all its tests together; past it the whole sandbox is killed."""
    test_timeout_s: float = 3.0
    """Wall clock of one test; past it the test's process group is killed."""
    cpu_s: int = 3
    """CPU seconds of each process (RLIMIT_CPU)."""
    memory_bytes: int = 512 << 20
    """Address space of each process (RLIMIT_AS)."""
    file_size_bytes: int = 8 << 20
    """Largest file a process may write (RLIMIT_FSIZE); also bounds the captured output."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    processes: int = 16
    """Processes of one execution (RLIMIT_NPROC of the unprivileged uid in its own user namespace)."""
    scratch_bytes: int = 32 << 20
    """Size of the private tmpfs the program may write (bwrap only)."""
    output_bytes: int = 4096
    """Captured stdout+stderr kept per test (its tail)."""
    max_source_bytes: int = 1 << 20
    """Largest program plus tests accepted; a larger one is refused before anything runs."""
    bwrap: str = "bwrap"
    """The bubblewrap executable (a name looked up on PATH, or a path)."""
    python: str = "/usr/bin/python3"
    """The interpreter that runs the code: its runtime is bound read-only. It must be readable by
    `uid`, so not under a private home such as /root (the venv's pyenv interpreter is, here)."""
    uid: int = NOBODY
    """The unprivileged uid the sandbox runs as when the pool runs as root; a pool that is not root
    runs it as itself. Never 0: root's processes are not bound by RLIMIT_NPROC."""
    gid: int = NOBODY
    """The unprivileged group the sandbox runs as when the pool runs as root (with `uid`); never 0."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox.isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and f.name not in ("uid", "gid"):
                if value <= 0:
                    raise ValueError(f"sandbox.{f.name} must be > 0, got {value}")
        if self.test_timeout_s > self.timeout_s:
            raise ValueError("sandbox.test_timeout_s must not exceed sandbox.timeout_s")
        if self.processes < 2:
            raise ValueError("sandbox.processes must be >= 2 (the runner and one test)")
        if self.uid <= 0 or self.gid <= 0:
            raise ValueError("sandbox.uid and sandbox.gid must name an unprivileged user, not root")
        if not os.path.isabs(self.python):
            raise ValueError(f"sandbox.python must be an absolute path, got {self.python!r}")
