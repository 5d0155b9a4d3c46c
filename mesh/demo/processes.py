"""The demo's child processes: each service is a real `deltamesh ...` process with its own log file.

Every child runs in a session (process group) of its own, so stopping it reaches whatever it started
too; on Linux it also gets SIGTERM should the demo itself die without cleaning up. `ServiceSet.stop`
sends SIGTERM to each group, gives it a grace period, then SIGKILLs what is left; the demo calls it
on every way out (normal end, Ctrl-C, SIGTERM, an error). `free_port`, `log_tail` and `end_process`
serve the tests and benchmarks that run such processes too.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import aiohttp

from deltamesh.http import HttpError, request_json

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class ServiceError(RuntimeError):
    """A service exited unexpectedly or never became healthy; the message ends with its log's tail."""


def deltamesh_command() -> list[str]:
    """How to run the `deltamesh` CLI of this very installation."""
    script = Path(sys.executable).with_name("deltamesh")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from deltamesh.mesh.cli import main; sys.exit(main())"]


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (`ip_local_port_range`): a port
    the kernel hands out itself (`bind` to port 0) can be taken as the local port of any process's
    next outgoing connection before its owner binds it, one below the range never is."""
    low = _ephemeral_low()
    picker = random.SystemRandom()
    for _ in range(200):
        port = picker.randrange(max(1024, low // 3), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free loopback port below {low} in 200 tries")


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def log_tail(path: Path, chars: int = 3000) -> str:
    """The last `chars` characters of a process's log file, for an error message ("" if unreadable)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def end_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    """Send `sig` to a child that is still running, give it `grace_s` to exit, then SIGKILL it."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _die_with_parent() -> None:
    """In the child before exec: a new session, and SIGTERM when the demo process dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Service:
    name: str
    kind: str
    """broker, gateway, pool, trainer or console."""
    args: list[str]
    log_path: Path
    url: str = ""
    """Base URL of its HTTP server, if it has one."""
    health: str = "/healthz"
    proc: subprocess.Popen | None = None
    ports: list[int] = field(default_factory=list)
    threads: int = 1
    """CPU threads its math libraries may use."""
    prefix: list[str] = field(default_factory=list)
    """A command its `deltamesh` runs under (`ip netns exec NS`: inside a network namespace)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables it gets beyond `child_env`."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, chars: int = 3000) -> str:
        return log_tail(self.log_path, chars)

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def child_env(threads: int) -> dict[str, str]:
    """A child's environment: logs at INFO, unbuffered, and math threads kept to what it may use."""
    env = dict(os.environ)
    env.update(DELTAMESH_LOG=env.get("DELTAMESH_LOG", "INFO"), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


class ServiceSet:
    """The services of one demo run, started in order and stopped together."""

    def __init__(self) -> None:
        self.services: list[Service] = []
        self._command = deltamesh_command()

    def start(self, service: Service) -> Service:
        self._launch(service)
        self.services.append(service)
        log.info("started %s (pid %d): deltamesh %s", service.name, service.proc.pid, " ".join(service.args[:2]))
        return service

    def restart(self, service: Service) -> Service:
        """Start a service of this set again with the same command, once its process has exited (its
        log goes on in the same file)."""
        if service not in self.services:
            raise ValueError(f"{service.name} is not a service of this set")
        if service.running():
            raise ServiceError(f"{service.name} (pid {service.pid}) is still running")
        self._launch(service)
        log.info("restarted %s (pid %d)", service.name, service.proc.pid)
        return service

    def _launch(self, service: Service) -> None:
        service.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(service.log_path, "ab") as out:
            service.proc = subprocess.Popen([*service.prefix, *self._command, *service.args], stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**child_env(service.threads), **service.env},
                                            preexec_fn=_die_with_parent)

    def of_kind(self, kind: str) -> list[Service]:
        return [s for s in self.services if s.kind == kind]

    def check(self, allowed_to_end: Sequence[Service] = ()) -> None:
        """Raise ServiceError if a service other than `allowed_to_end` has exited."""
        for s in self.services:
            if s not in allowed_to_end and not s.running():
                raise ServiceError(f"{s.name} exited with code {s.returncode()}; its log {s.log_path} ends:\n"
                                   f"{s.tail()}")

    async def wait_healthy(self, session: aiohttp.ClientSession, services: Sequence[Service], timeout_s: float,
                           stop: asyncio.Event) -> bool:
        """Wait until every one of `services` answers its health URL; False if `stop` was set first."""
        deadline = time.monotonic() + timeout_s
        waiting = [s for s in services if s.url]
        while waiting:
            if stop.is_set():
                return False
            self.check()
            still = []
            for s in waiting:
                try:
                    await request_json(session, "GET", s.url + s.health, timeout_s=2.0)
                except HttpError:
                    still.append(s)
            waiting = still
            if waiting and time.monotonic() > deadline:
                names = ", ".join(s.name for s in waiting)
                raise ServiceError(f"{names} did not answer within {timeout_s:.0f} s; see {waiting[0].log_path}:\n"
                                   f"{waiting[0].tail()}")
            if waiting:
                await asyncio.sleep(0.25)
        return True

    async def stop(self, services: Sequence[Service] | None = None, grace_s: float = 15.0) -> None:
        """SIGTERM each service's process group, wait up to `grace_s`, then SIGKILL what is left."""
        group = list(self.services if services is None else services)
        for s in group:
            if s.running():
                s.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(s.running() for s in group) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for s in group:
            if s.running():
                log.warning("%s did not stop within %.0f s of SIGTERM: killing it", s.name, grace_s)
            # Also whatever the service started itself, even once the service has exited.
            s.signal_group(signal.SIGKILL)
            if s.proc is not None:
                try:
                    s.proc.wait(10)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) survived SIGKILL", s.name, s.proc.pid)
