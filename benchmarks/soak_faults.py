"""Injecting the soak's faults into the running mesh, each undone after its time, all of it logged.

`Injector.run` starts each planned fault (soak_schedule.py) at its time. A fault first takes the
resources it touches (a service, a link, a store, PostgreSQL) so that two never act on one target at
once (one that is late waits, and the log says so), then does its harm, waits its duration and undoes
it. Every step is one line of the fault log (JSON lines, `FaultLog`): what was planned, when it was
injected and healed, and anything it met (a late start, a failure to inject). The kinds:

- kill: SIGKILL of a service's process group, then the same command again after `duration_s`;
- stop: SIGSTOP of it, SIGCONT after `duration_s` (a frozen peer);
- pg_failover: PostgreSQL's primary crashed, its synchronous standby promoted, a new standby built;
- link_cut / link_loss / link_trickle: the emulator's link dropped, lossy, or slowed to a trickle;
- disk_full: the gateway's store filesystem filled but for a few KiB;
- corrupt_piece: one byte flipped in a piece file of the gateway's store (one of the newest versions);
- malicious_relay: the eu relay replaced by soak_hostile.py at its address (tamper or rollback mode);
- clock_jump: the wall clock of one service moved by `seconds` (soak_clock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from soak_mesh import GATEWAY_PORT, HIDDEN_PORT, MODEL, SoakMesh
from soak_schedule import PlannedFault

from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.demo.processes import Service

log = logging.getLogger(__name__)

HOSTILE = Path(__file__).resolve().with_name("soak_hostile.py")
FILLER = ".soak-filler"
PIECE = re.compile(r"/models/[^/]+/([0-9]+)/(delta|full)/pieces/([0-9]+)$")


class FaultLog:
    """The fault log: one JSON object a line, with `t` in seconds since the soak began."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0 = path, t0
        self.entries: list[dict[str, Any]] = []

    def write(self, event: str, fault: PlannedFault | None = None, **extra: Any) -> dict[str, Any]:
        entry = {"t": round(time.monotonic() - self.t0, 2), "event": event}
        if fault is not None:
            entry.update(index=fault.index, kind=fault.kind, target=fault.target)
        entry.update(extra)
        self.entries.append(entry)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        log.info("fault %s", " ".join(f"{k}={v}" for k, v in entry.items()))
        return entry

    def injected(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["event"] == "inject"]


class Injector:
    def __init__(self, mesh: SoakMesh, faults: FaultLog) -> None:
        self.mesh, self.log = mesh, faults
        self._locks: dict[str, asyncio.Lock] = {}
        self._stopped: set[str] = set()  # services under SIGSTOP now
        self.down: set[str] = set()
        """Services killed by a fault and not yet started again: their exit is no finding."""
        self._hostile: subprocess.Popen | None = None

    async def run(self, schedule: list[PlannedFault], start: float) -> None:
        """Fire every fault of `schedule` at `start` (monotonic) + its time; return when all are healed."""
        tasks = []
        for fault in schedule:
            await asyncio.sleep(max(0.0, start + fault.at_s - time.monotonic()))
            tasks.append(asyncio.create_task(self._fire(fault), name=f"fault-{fault.index}"))
        await asyncio.gather(*tasks)

    def actions(self) -> dict[str, Callable[[PlannedFault], Awaitable[None]]]:
        """Each fault kind (soak_schedule.KINDS) -> what injects and heals it."""
        return {"kill": self._kill, "stop": self._stop, "clock_jump": self._clock_jump, "pg_failover": self._pg_failover,
                "link_cut": self._link_cut, "link_loss": self._link_loss, "link_trickle": self._link_trickle,
                "disk_full": self._disk_full, "corrupt_piece": self._corrupt_piece,
                "malicious_relay": self._malicious_relay}

    async def _fire(self, fault: PlannedFault) -> None:
        names = sorted(fault.holds)
        locks = [self._locks.setdefault(n, asyncio.Lock()) for n in names]
        asked = time.monotonic()
        for lock in locks:
            await lock.acquire()
        try:
            late = time.monotonic() - asked
            if late > 1.0:
                self.log.write("late", fault, waited_s=round(late, 1))
            try:
                await self.actions()[fault.kind](fault)
            except Exception as e:  # noqa: BLE001 - a fault that cannot be done is logged, the soak goes on
                log.exception("fault %s failed", fault.describe())
                self.log.write("failed", fault, error=f"{type(e).__name__}: {e}")
        finally:
            for lock in locks:
                lock.release()

    # -- processes -------------------------------------------------------------------------------
    async def service(self, target: str) -> Service:
        """The service a target names; `broker:active` / `broker:standby` by what the brokers say now."""
        if not target.startswith("broker:"):
            return next(s for s in self.mesh.all_services() if s.name == target)
        roles = await self.broker_roles()
        want = target.split(":")[1]
        chosen = [b for b in self.mesh.brokers if roles.get(b.name) == want]
        return chosen[0] if chosen else self.mesh.brokers[0 if want == "active" else 1]

    async def broker_roles(self) -> dict[str, str]:
        roles = {}
        async with client_session(timeout_s=3.0, tls=self.mesh.creds.client_tls()) as s:
            for b in self.mesh.brokers:
                try:
                    roles[b.name] = (await request_json(s, "GET", b.url + "/healthz")).get("role", "")
                except HttpError:
                    roles[b.name] = "down"
        return roles

    async def _kill(self, fault: PlannedFault) -> None:
        svc = await self.service(fault.target)
        await self._kill_now(svc)
        self.log.write("inject", fault, service=svc.name)
        await asyncio.sleep(fault.duration_s)
        await self._restart(svc)
        self.log.write("heal", fault, service=svc.name, pid=svc.pid)

    async def _restart(self, svc: Service) -> None:
        await asyncio.to_thread(self.mesh.restart, svc)
        self.down.discard(svc.name)

    async def _kill_now(self, svc: Service) -> None:
        self.down.add(svc.name)
        svc.signal_group(signal.SIGKILL)
        self._stopped.discard(svc.name)
        if svc.proc is not None:
            await asyncio.to_thread(svc.proc.wait, 30)

    async def _stop(self, fault: PlannedFault) -> None:
        svc = await self.service(fault.target)
        svc.signal_group(signal.SIGSTOP)
        self._stopped.add(svc.name)
        self.log.write("inject", fault, service=svc.name)
        await asyncio.sleep(fault.duration_s)
        svc.signal_group(signal.SIGCONT)
        self._stopped.discard(svc.name)
        self.log.write("heal", fault, service=svc.name)

    async def _clock_jump(self, fault: PlannedFault) -> None:
        svc = await self.service(fault.target)
        assert self.mesh.clock is not None
        self.mesh.clock.jump(svc.name, fault.params["seconds"])
        self.log.write("inject", fault, service=svc.name, seconds=fault.params["seconds"])
        await asyncio.sleep(fault.duration_s)
        self.mesh.clock.reset(svc.name)
        self.log.write("heal", fault, service=svc.name)

    # -- PostgreSQL, links, disks ----------------------------------------------------------------
    async def _pg_failover(self, fault: PlannedFault) -> None:
        assert self.mesh.pg is not None
        old = self.mesh.pg.primary.port
        self.log.write("inject", fault, primary_port=old)
        started = time.monotonic()
        await asyncio.to_thread(self.mesh.pg.fail_over)
        self.log.write("heal", fault, primary_port=self.mesh.pg.primary.port,
                       took_s=round(time.monotonic() - started, 1))

    async def _link_cut(self, fault: PlannedFault) -> None:
        await self._link(fault, lambda: self.mesh.net.cut(fault.target), lambda: self.mesh.net.heal_drops(fault.target))

    async def _link_loss(self, fault: PlannedFault) -> None:
        p = fault.params["probability"]
        await self._link(fault, lambda: self.mesh.net.lose(fault.target, p),
                         lambda: self.mesh.net.heal_drops(fault.target))

    async def _link_trickle(self, fault: PlannedFault) -> None:
        mbit = fault.params["mbit"]
        await self._link(fault, lambda: self.mesh.net.trickle(fault.target, mbit),
                         lambda: self.mesh.net.restore_rate(fault.target))

    async def _link(self, fault: PlannedFault, harm, undo) -> None:
        await asyncio.to_thread(harm)
        self.log.write("inject", fault, **fault.params)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            await asyncio.to_thread(undo)
        self.log.write("heal", fault)

    async def _disk_full(self, fault: PlannedFault) -> None:
        filler = self.mesh.store(fault.target) / FILLER
        free = await asyncio.to_thread(fill, filler)
        self.log.write("inject", fault, filled_bytes=free)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            filler.unlink(missing_ok=True)
        self.log.write("heal", fault)

    async def _corrupt_piece(self, fault: PlannedFault) -> None:
        pieces = newest_pieces(self.mesh.store(fault.target))
        if not pieces:
            self.log.write("skip", fault, reason="no piece stored")
            return
        path = pieces[fault.params["pick"] % len(pieces)]
        await asyncio.to_thread(flip_byte, path)
        self.log.write("inject", fault, piece=str(path.relative_to(self.mesh.store(fault.target))))
        self.log.write("heal", fault)  # nothing to undo: the gateway must notice on its own

    # -- a malicious relay -----------------------------------------------------------------------
    async def _malicious_relay(self, fault: PlannedFault) -> None:
        region, mesh = fault.target, self.mesh
        real = mesh.gateways[region]
        await self._kill_now(real)
        mesh.hide_gateway(region)
        await self._restart(real)
        self._hostile = await asyncio.to_thread(self._start_hostile, region, fault.params["mode"])
        self.log.write("inject", fault, mode=fault.params["mode"], pid=self._hostile.pid)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            await asyncio.to_thread(self.end_hostile)
            await self._kill_now(real)
            mesh.unhide_gateway(region)
            await self._restart(real)
        self.log.write("heal", fault)

    def _start_hostile(self, region: str, mode: str) -> subprocess.Popen:
        mesh = self.mesh
        assert mesh.creds is not None
        host = mesh.host_of_region(region)
        cert = mesh.creds.certs[f"gateway-{region}"]
        token = mesh.run_dir / "pki" / f"hostile-{region}.token"
        token.write_text(mesh.token(f"gateway/{region}") + "\n")
        token.chmod(0o600)
        out = open(mesh.run_dir / "logs" / f"hostile-{region}.log", "ab")
        argv = [*mesh.net.netns_prefix(host), sys.executable, str(HOSTILE), "--mode", mode,
                "--listen", f"{mesh.net.ip(host)}:{GATEWAY_PORT}", "--cert", str(cert.cert), "--key", str(cert.key),
                "--honest", f"http://127.0.0.1:{HIDDEN_PORT}", "--token-file", str(token), "--model", MODEL]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        deadline = time.monotonic() + 90
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([proc.stdout], [], [], left)[0]:
                break
            line = proc.stdout.readline()
            if line.strip() == b"ready":
                return proc
            if not line:
                break
        self._hostile = proc
        self.end_hostile()
        raise RuntimeError(f"the malicious relay did not start; see logs/hostile-{region}.log")

    def end_hostile(self) -> None:
        proc, self._hostile = self._hostile, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()

    def release(self) -> None:
        """Undo what a fault cut short by an early end left behind: frozen processes, a stand-in relay."""
        for svc in self.mesh.all_services():
            if svc.name in self._stopped:
                svc.signal_group(signal.SIGCONT)
        self._stopped.clear()
        self.end_hostile()


def fill(path: Path) -> int:
    """Fill the filesystem holding `path` with one file, leaving a few KiB; the bytes taken."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize - 16 * 1024
    if free <= 0:
        return 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free)
    except OSError:
        pass  # what did fit stays: the point is a full disk
    finally:
        os.close(fd)
    return free


def _glob_settled(root: Path, pattern: str, tries: int = 5) -> list[Path]:
    """`root.glob(pattern)`, again if the store's retention removed a folder while it was walked."""
    for _ in range(tries - 1):
        try:
            return list(root.glob(pattern))
        except FileNotFoundError:
            continue
    return list(root.glob(pattern))


def newest_pieces(store: Path, versions: int = 6) -> list[Path]:
    """Piece files of the newest `versions` versions in a gateway's store, in a fixed order."""
    found: list[tuple[int, str, int, Path]] = []
    for path in _glob_settled(store, "models/*/*/*/pieces/*"):
        m = PIECE.search(path.as_posix())
        if m is not None:
            found.append((int(m.group(1)), m.group(2), int(m.group(3)), path))
    newest = sorted({v for v, _, _, _ in found})[-versions:]
    return [p for v, _, _, p in sorted(found) if v in newest]


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        if byte:
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x40]))


@contextlib.contextmanager
def injector_released(injector: Injector) -> Iterator[Injector]:
    try:
        yield injector
    finally:
        injector.release()
