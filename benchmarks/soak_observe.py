"""Watching the soak's mesh: what each service says and what each process uses, sampled all run long.

`Observer.run` polls, each at its own period: every pool's status (the version its engine serves, the
version its directory holds, its serve checks), the origin's head, every gateway's version listing
(each version's weights hash), the brokers' roles, the trainer's new step records, and, from /proc,
the open fds, threads, RSS and CPU time of every long-lived process (each service, PostgreSQL's two
servers), and the disk used by every store (each gateway's, each pool's directory, the trainer's
checkpoints, PostgreSQL's data). Each reading is handed to `Invariants` (soak_checks.py) as it comes,
so a violation is seen when it happens, and kept for the report. A peer that does not answer is
recorded as unreachable for that round: under faults, that is expected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soak_checks import Invariants
from soak_faults import FILLER
from soak_mesh import MODEL, REGIONS, SoakMesh

from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError, bearer, client_session, request_json

log = logging.getLogger(__name__)

POOL_S, HEAD_S, LISTING_S, BROKER_S, PROC_S, DISK_S = 1.0, 1.0, 3.0, 2.0, 5.0, 10.0
MIB = 1024 * 1024


@dataclass
class ProcSample:
    t: float
    pid: int
    fds: int
    """Open fds but the established TCP connections: what a leak of files, pipes or dead sockets grows."""
    threads: int
    rss_mib: float
    cpu_s: float
    connections: int = 0
    """Established TCP connections: callers' keep-alive sockets follow the traffic (a failover moves them
    all to the new active broker), so they are reported beside the fds, not judged with them."""


@dataclass
class Readings:
    """Everything sampled, for the checks at the end and the report."""

    pools: dict[str, list[tuple[float, int | None]]] = field(default_factory=dict)
    """Pool -> (t, version its engine serves) at each reading (None: no published version yet)."""
    heads: list[tuple[float, int]] = field(default_factory=list)
    """(t, the origin's head): the newest version the trainer has published."""
    procs: dict[str, list[ProcSample]] = field(default_factory=dict)
    disk: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Store -> (t, MiB used)."""
    roles: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def head_at(self, t: float) -> int | None:
        seen = [h for at, h in self.heads if at <= t]
        return max(seen) if seen else None


class Observer:
    def __init__(self, mesh: SoakMesh, checks: Invariants, t0: float) -> None:
        self.mesh, self.checks, self.t0 = mesh, checks, t0
        self.readings = Readings()
        self._steps_offset = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def admin_session(self):
        assert self.mesh.creds is not None
        return client_session(timeout_s=5.0, tls=self.mesh.creds.client_tls(), headers=bearer(self.mesh.token("admin")))

    async def listings_now(self) -> None:
        """One more reading of every gateway's listing (at the end: the versions published since the last)."""
        async with self.admin_session() as session:
            await self._listings(session)

    async def run(self, stop: asyncio.Event) -> None:
        plain = client_session(timeout_s=3.0)
        async with self.admin_session() as secure, plain as pools:
            loops = [self._every(POOL_S, stop, lambda: self._pools(pools)),
                     self._every(HEAD_S, stop, lambda: self._head(secure)),
                     self._every(LISTING_S, stop, lambda: self._listings(secure)),
                     self._every(BROKER_S, stop, lambda: self._brokers(secure)),
                     self._every(POOL_S, stop, self.read_steps),
                     self._every(PROC_S, stop, self._procs),
                     self._every(DISK_S, stop, self._disk)]
            await asyncio.gather(*loops)

    async def _every(self, period_s: float, stop: asyncio.Event, poll) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = poll()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - a broken reading must not end the watch
                log.exception("soak observer: reading failed")
            try:
                await asyncio.wait_for(stop.wait(), max(0.05, period_s - (time.monotonic() - started)))
            except asyncio.TimeoutError:
                pass

    # -- the services ----------------------------------------------------------------------------
    async def _pools(self, session) -> None:
        async def one(name: str) -> None:
            svc = self.mesh.pools[name]
            t = self.now()
            try:
                status = await request_json(session, "GET", svc.url + "/v1/status", timeout_s=2.0)
            except HttpError:
                return
            entry = (status.get("models") or {}).get(MODEL) or {}
            self.readings.pools.setdefault(name, []).append((t, entry.get("engine_version")))
            self.checks.pool_status(t, name, svc.pid, entry)

        await asyncio.gather(*(one(name) for name in self.mesh.pools))

    async def _head(self, session) -> None:
        try:
            head = await GatewayClient(self.mesh.gateway_url("us"), session).head(MODEL)
        except HttpError:
            return
        if head is not None:
            self.readings.heads.append((self.now(), head))

    async def _listings(self, session) -> None:
        for r in REGIONS:
            if r.name in self.mesh.hidden:
                continue  # its address is the stand-in's, which lies by design
            try:
                listing = await GatewayClient(self.mesh.gateway_url(r.name), session).versions(MODEL)
            except HttpError:
                continue
            self.checks.gateway_listing(self.now(), r.name, listing.get("versions") or [])

    async def _brokers(self, session) -> None:
        roles = {}
        for b in self.mesh.brokers:
            try:
                roles[b.name] = (await request_json(session, "GET", b.url + "/healthz", timeout_s=2.0)).get("role", "")
            except HttpError:
                roles[b.name] = "down"
        self.readings.roles.append((self.now(), roles))
        self.checks.broker_roles(self.now(), roles)

    def read_steps(self) -> None:
        try:
            with open(self.mesh.steps_file, "rb") as f:
                f.seek(self._steps_offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next round
        self._steps_offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self.checks.trainer_record(self.now(), json.loads(line))

    # -- resources ------------------------------------------------------------------------------
    def long_lived(self) -> dict[str, int]:
        """Name -> pid of every long-lived process now."""
        found = {s.name: s.pid for s in self.mesh.all_services() if s.running() and s.pid is not None}
        if self.mesh.pg is not None:
            for role, cluster in (("postgres-primary", self.mesh.pg.primary), ("postgres-standby", self.mesh.pg.standby)):
                pid = postmaster_pid(cluster.data) if cluster is not None else None
                if pid is not None:
                    found[role] = pid
        return found

    def _procs(self) -> None:
        t = self.now()
        for name, pid in self.long_lived().items():
            sample = proc_sample(t, pid)
            if sample is not None:
                self.readings.procs.setdefault(name, []).append(sample)

    def _disk(self) -> None:
        t = self.now()
        mesh = self.mesh
        stores: dict[str, Path] = {f"store-{r.name}": mesh.store(r.name) for r in REGIONS}
        stores.update({f"pool-{p}": mesh.pool_dir(p) for p in mesh.pools})
        stores["trainer-checkpoints"] = mesh.run_dir / "trainer" / "checkpoints"
        for name, path in stores.items():
            self.readings.disk.setdefault(name, []).append((t, du_bytes(path) / MIB))
        if mesh.pg is not None:
            used = sum(du_bytes(d) for d in mesh.pg.data_dirs())
            self.readings.disk.setdefault("postgres", []).append((t, used / MIB))


def postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def established_inodes(pid: int) -> set[str]:
    """Socket inodes of the established TCP connections in `pid`'s network namespace."""
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "01":  # TCP_ESTABLISHED
                found.add(fields[9])
    return found


def proc_sample(t: float, pid: int) -> ProcSample | None:
    """Open fds (established connections apart), threads, RSS and CPU seconds of `pid` from /proc (None if
    it is gone)."""
    try:
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue  # closed meanwhile
        established = established_inodes(pid)
        connections = sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in established)
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    fields: dict[str, Any] = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat[11]) + int(stat[12])) / ticks  # utime + stime
    return ProcSample(t, pid, len(links) - connections, int(fields["Threads"].strip()), rss_kib / 1024, cpu,
                      connections)


def du_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk (0 if it does not exist), less a full-disk fault's filler."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            if name == FILLER:
                continue
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
