"""One soak, phase by phase: start the mesh, watch it warm up, inject the faults, wait for it to settle,
audit the history, and stop everything whatever happened.

The phases, in seconds since the soak began (`t`): start-up until every pool serves a published
version and the trainer has made steps (at most `START_TIMEOUT_S`); `WARMUP_S` of quiet (the trainer's
normal wait is measured there); the fault phase (`minutes`, soak_faults.py); the quiet tail, until
every pool serves the head of the moment the last fault was healed (at most the convergence bound)
and `TAIL_S` more; then the pools and the trainer are stopped cleanly (so the trainer's last
acknowledgements reach the broker) and the audit reads the ledgers, the database and the pools'
directories. Throughout, a watchdog restarts any service that exits when no fault killed it, and
records that as a violation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import soak_audit
from soak_checks import CONVERGE_BOUND_S, Invariants
from soak_faults import FaultLog, Injector
from soak_mesh import MAX_STALENESS, SoakMesh
from soak_net import SoakNet
from soak_observe import Observer
from soak_report import context_lines, plot, result
from soak_schedule import PlannedFault

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
WARMUP_S = 30.0
TAIL_S = 20.0
WATCHDOG_S = 2.0


@dataclass
class SoakSettings:
    minutes: float
    seed: int
    run_dir: Path
    vllm: bool = False


class Soak:
    def __init__(self, settings: SoakSettings, net: SoakNet, schedule: list[PlannedFault]) -> None:
        self.settings, self.schedule = settings, schedule
        self.mesh = SoakMesh(settings.run_dir, net, vllm=settings.vllm)
        self.t0 = time.monotonic()
        self.wall_t0 = time.time()
        self.checks = Invariants(settings.seed, MAX_STALENESS)
        self.faults = FaultLog(settings.run_dir / "faults.jsonl", self.t0)
        self.injector = Injector(self.mesh, self.faults)
        self.observer = Observer(self.mesh, self.checks, self.t0)
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> dict[str, Any]:
        mesh, stop = self.mesh, asyncio.Event()
        watch = dog = None
        converged: dict[str, float | None] = {}
        leaks: dict[str, dict] = {}
        try:
            await asyncio.to_thread(mesh.prepare)
            mesh.start()
            watch = asyncio.create_task(self.observer.run(stop))
            dog = asyncio.create_task(self._watchdog(stop))
            await self._until_ready()
            self.marks["ready"] = self.now()
            await asyncio.sleep(WARMUP_S)
            self.marks["faults_start"] = self.now()
            await self.injector.run(self.schedule, self.t0 + self.marks["faults_start"])
            self.marks["last_heal"] = self.now()
            await self._settle()
            self.marks["end"] = self.now()
            stop.set()
            await asyncio.gather(watch, dog)
            converged, leaks = await self._audit()
        finally:
            stop.set()
            for task in (watch, dog):
                if task is not None and not task.done():
                    task.cancel()
            self.injector.release()
            await mesh.stop()
            mesh.close()
        return self._result(converged, leaks)

    async def _until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            pools = self.observer.readings.pools
            serving = [p for p in self.mesh.pools if any(v is not None for _, v in pools.get(p, []))]
            if len(serving) == len(self.mesh.pools) and len(self.checks.records) >= 3:
                return
            await asyncio.sleep(1.0)
        raise RuntimeError(f"the mesh did not come up within {START_TIMEOUT_S:.0f} s; logs in "
                           f"{self.mesh.run_dir / 'logs'}")

    async def _settle(self) -> None:
        """Wait until every pool serves the head of the last heal (or the bound passes), then `TAIL_S`."""
        readings = self.observer.readings
        head = readings.head_at(self.marks["last_heal"])
        deadline = time.monotonic() + CONVERGE_BOUND_S
        while time.monotonic() < deadline:
            latest = {p: next((v for _, v in reversed(pts) if v is not None), None) for p, pts in readings.pools.items()}
            if head is not None and len(latest) == len(self.mesh.pools) and \
                    all(v is not None and v >= head for v in latest.values()):
                break
            await asyncio.sleep(1.0)
        self.marks["settled"] = self.now()
        await asyncio.sleep(TAIL_S)

    async def _watchdog(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for svc in self.mesh.all_services():
                if svc.running() or svc.name in self.injector.down or svc.proc is None:
                    continue
                self.checks.service_exited(self.now(), svc.name, svc.returncode(), svc.tail(1500))
                self.faults.write("crash", service=svc.name, code=svc.returncode())
                await asyncio.to_thread(self.mesh.restart, svc)
            try:
                await asyncio.wait_for(stop.wait(), WATCHDOG_S)
            except asyncio.TimeoutError:
                pass

    async def _audit(self) -> tuple[dict[str, float | None], dict[str, dict]]:
        mesh, checks, readings = self.mesh, self.checks, self.observer.readings
        t = self.now()
        converged = checks.convergence(t, self.marks["last_heal"], readings.head_at(self.marks["last_heal"]),
                                       readings.pools, self.marks["end"])
        checks.recoveries(t, self.faults.entries, readings.pools, readings.head_at, self.marks["last_heal"])
        checks.trainer_wait(t, (self.marks["ready"], self.marks["faults_start"]), (self.marks["settled"], self.marks["end"]))
        await mesh.services.stop([s for s in mesh.all_services() if s.kind in ("pool", "trainer")], grace_s=30.0)
        self.observer.read_steps()  # the records of the trainer's last steps
        await self.observer.listings_now()  # and the versions it published since the last listing
        assert mesh.pg is not None
        stored, batches = await asyncio.to_thread(soak_audit.database, mesh.pg.primary_dsn)
        checks.trajectories(t, await asyncio.to_thread(soak_audit.ledgers, mesh), stored)
        checks.staleness(t, batches)
        checks.pool_dirs(t, await asyncio.to_thread(soak_audit.pool_dirs, mesh))
        leaks = checks.leaks(t, soak_audit.lives(readings))
        return converged, leaks

    def _result(self, converged: dict[str, float | None], leaks: dict[str, dict]) -> dict[str, Any]:
        s, mesh, readings = self.settings, self.mesh, self.observer.readings
        logs = {svc.name: svc.log_path for svc in mesh.all_services()}
        for v in self.checks.violations:
            v.context = context_lines(v, self.faults.entries, logs, self.wall_t0)
        (s.run_dir / "readings.json").write_text(json.dumps({
            "pools": readings.pools, "heads": readings.heads, "disk": readings.disk,
            "procs": {name: [asdict(x) for x in samples] for name, samples in readings.procs.items()}}))
        drawn = plot(s.run_dir / "versions.png", readings.pools, readings.heads, self.faults.entries,
                     f"soak seed {s.seed}: versions served per pool, faults shaded")
        extra = {"run_dir": str(s.run_dir), "fault_log": str(self.faults.path), "plot": str(drawn) if drawn else None,
                 "phases_s": {k: round(v, 1) for k, v in self.marks.items()},
                 "head": readings.heads[-1][1] if readings.heads else None,
                 "trainer_steps": len(self.checks.records), "cpu_s": soak_audit.cpu_seconds(readings),
                 "planned_faults": len(self.schedule), "vllm_pool": s.vllm,
                 "date": time.strftime("%Y-%m-%d", time.localtime(self.wall_t0))}
        return result(seed=s.seed, minutes=s.minutes, checks=self.checks, faults=self.faults.entries, leaks=leaks,
                      converged=converged, extra=extra)
