"""Launchers: how the autoscaler changes the number of rollout pools.

`LocalLauncher` runs each pool as a process on this machine from an argv template and stops the
newest ones first (SIGTERM to its process group, SIGKILL after a grace period). `CommandLauncher`
runs a configured command with the wanted count (`{count}`), e.g. `kubectl scale --replicas={count}`
or a Slurm/cloud script, and believes the count once the command exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Protocol, Sequence

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A launcher could not reach the requested count; the current count is unchanged."""


class Launcher(Protocol):
    def current(self) -> int:
        """Pools running (or, for an external system, last confirmed)."""
        ...

    async def scale_to(self, count: int) -> None: ...

    async def close(self) -> None: ...


class LocalLauncher:
    def __init__(self, command: Sequence[str], *, broker: str = "", stop_grace_s: float = 10.0):
        self.command = list(command)
        self.broker = broker
        self.stop_grace_s = stop_grace_s
        self.processes: list[asyncio.subprocess.Process] = []
        self._next_index = 0

    def current(self) -> int:
        exited = [p for p in self.processes if p.returncode is not None]
        for p in exited:
            log.warning("pool process %d exited with code %s", p.pid, p.returncode)
            self.processes.remove(p)
        return len(self.processes)

    async def scale_to(self, count: int) -> None:
        while self.current() < count:
            argv = [a.format(index=self._next_index, broker=self.broker) for a in self.command]
            self._next_index += 1
            try:
                proc = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
            except OSError as e:
                raise LaunchError(f"cannot start pool {argv}: {e}") from e
            log.info("started pool process %d: %s", proc.pid, " ".join(argv))
            self.processes.append(proc)
        while len(self.processes) > count:
            await self._stop(self.processes.pop())

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)  # its own session: reach the pool's children too
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(proc.wait(), self.stop_grace_s if sig == signal.SIGTERM else None)
                break
            except asyncio.TimeoutError:
                log.warning("pool process %d ignored SIGTERM for %.0f s; killing it", proc.pid, self.stop_grace_s)
        log.info("stopped pool process %d", proc.pid)

    async def close(self) -> None:
        await self.scale_to(0)


class CommandLauncher:
    def __init__(self, command: Sequence[str], *, initial: int = 0, timeout_s: float = 300.0):
        self.command = list(command)
        self.timeout_s = timeout_s
        self._count = initial

    def current(self) -> int:
        return self._count

    async def scale_to(self, count: int) -> None:
        argv = [a.format(count=count) for a in self.command]
        try:
            proc = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
        except OSError as e:
            raise LaunchError(f"cannot run {argv}: {e}") from e
        try:
            rc = await asyncio.wait_for(proc.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise LaunchError(f"{argv} took longer than {self.timeout_s} s; killed") from None
        if rc != 0:
            raise LaunchError(f"{argv} exited with code {rc}")
        log.info("scaled to %d pools with %s", count, " ".join(argv))
        self._count = count

    async def close(self) -> None:
        pass
