"""Running the demo: start the mesh, watch it train, check that every pool ends bit-exact, stop, report.

`run_demo` is what `deltamesh demo` runs. It lays out the run directory, starts every service as
its own process, and polls them every `poll_s`, redrawing the live view (or logging progress lines).
The trainers stop by themselves after `steps` steps; the demo then waits for every pool to serve
each trainer's final version, compares each pool's synced weights (version and weights hash) with
what the trainer published last, and stops everything: pools and trainers first (they drain), then
gateways and broker. Ctrl-C or SIGTERM at any point ends the run the same way, as does a service
that dies. The report is written in every case, with the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.live import Live

from deltamesh.http import bearer, client_session
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.launch import MeshPlan, prepare, start
from deltamesh.mesh.demo.monitor import Monitor
from deltamesh.mesh.demo.processes import ServiceError, ServiceSet
from deltamesh.mesh.demo.report import FinalCheck, build_report, write_report
from deltamesh.mesh.demo.state import MeshState
from deltamesh.mesh.demo.view import ProgressLines, render
from deltamesh.signals import sleep_or_stop

log = logging.getLogger(__name__)


@dataclass
class DemoResult:
    outcome: str
    """completed, interrupted or failed."""
    report: dict[str, Any]
    report_path: Path
    chart_path: Path | None

    @property
    def exit_code(self) -> int:
        if self.outcome == "interrupted":
            return 130
        return 0 if self.outcome == "completed" and self.report["summary"]["all_pools_bit_exact"] else 1


class Display:
    """The live view on a terminal, or progress lines in the log."""

    def __init__(self, console: Console, live: bool, config: DemoConfig, upload_link: str, run_dir: Path):
        self.console, self.config, self.upload_link, self.run_dir = console, config, upload_link, str(run_dir)
        self._live = Live(console=console, refresh_per_second=4, redirect_stderr=False) if live else None
        self._lines = ProgressLines()

    def __enter__(self) -> "Display":
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def update(self, state: MeshState) -> None:
        if self._live is not None:
            self._live.update(render(state, self.config, self.upload_link, self.run_dir))
        else:
            for line in self._lines.lines(state):
                log.info("%s", line)


@contextlib.contextmanager
def logging_to(run_dir: Path, quiet_terminal: bool) -> Iterator[None]:
    """Also log to run_dir/demo.log; with a live view on the terminal, log only there meanwhile."""
    root = logging.getLogger()
    handler = logging.FileHandler(run_dir / "demo.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s"))
    root.addHandler(handler)
    hidden = [h for h in root.handlers if quiet_terminal and type(h) is logging.StreamHandler]
    for h in hidden:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in hidden:
            root.addHandler(h)
        root.removeHandler(handler)
        handler.close()


def final_checks(plan: MeshPlan, state: MeshState) -> list[FinalCheck]:
    """Each pool's served version and synced directory against its trainer's last published version."""
    from deltamesh.delta import dir_manifest

    checks = []
    for name, reading in state.pools.items():
        for model_id, run in state.models.items():
            final = run.trainer_version
            held = dir_manifest(plan.pool_dir(name) / model_id)
            expected = run.versions[final].weights_hash if final in run.versions else ""
            checks.append(FinalCheck(name, model_id, reading.engine_version(model_id),
                                     None if held is None else held.version, "" if held is None else held.weights_hash,
                                     final, expected))
    return checks


def _eval_done(plan: MeshPlan, state: MeshState) -> bool:
    """The evaluator (if any) has scored the first policy's final version, or skipped it."""
    if plan.evaluator is None:
        return True
    final = state.models[plan.config.model_ids[0]].trainer_version
    return final is None or state.eval_at(final) is not None or final in state.eval_status.get("skipped", [])


def _pools_at_final(state: MeshState) -> bool:
    for model_id, run in state.models.items():
        final = run.trainer_version
        if final is None or final not in run.versions or not run.versions[final].weights_hash:
            return False
        for p in state.pools.values():
            # The engine swaps a version in before the synced directory is written: wait for both.
            entry = p.status.get("models", {}).get(model_id, {})
            if entry.get("engine_version") != final or entry.get("dir_version") != final:
                return False
    return True


async def _watch(plan: MeshPlan, services: ServiceSet, monitor: Monitor, display: Display,
                 stop: asyncio.Event) -> str:
    """Poll until the trainers are done and every pool serves their final versions; the outcome."""
    cfg, state = plan.config, monitor.state
    started = time.monotonic()
    settle_deadline: float | None = None
    final_asked = False
    while not stop.is_set():
        services.check(allowed_to_end=list(plan.trainers.values()))
        for trainer in plan.trainers.values():
            code = trainer.returncode()
            if code is not None and code != 0:
                raise ServiceError(f"{trainer.name} exited with code {code}; its log {trainer.log_path} ends:\n"
                                   f"{trainer.tail()}")
        # Before the poll: a trainer seen done has written its last step, which this poll then reads.
        done = all(t.returncode() == 0 for t in plan.trainers.values())
        await monitor.poll()
        if not any(run.steps for run in state.models.values()):
            state.phase = "starting services (model load, first sync)"
            if time.monotonic() - started > cfg.start_timeout_s:
                raise ServiceError(f"no trainer step within {cfg.start_timeout_s:.0f} s; "
                                   f"logs in {plan.run_dir / 'logs'}")
        elif not done:
            state.phase = "training"
        else:
            state.phase = "trainers done: waiting for every pool to serve the final version"
            if settle_deadline is None:
                settle_deadline = time.monotonic() + cfg.settle_timeout_s
            final = state.models[cfg.model_ids[0]].trainer_version
            if plan.evaluator is not None and not final_asked and final is not None:
                final_asked = await monitor.request_eval(final)  # the last point of the eval curve
            if _pools_at_final(state) and not _eval_done(plan, state):
                state.phase = f"trainers done, pools on it: the evaluator scores v{final}"
            elif _pools_at_final(state):
                display.update(state)
                return "completed"
            if time.monotonic() > settle_deadline:
                if _pools_at_final(state):  # only the evaluator is late: the run's training is whole
                    state.notes.append(f"the evaluator had not scored the final version after "
                                       f"{cfg.settle_timeout_s:.0f} s")
                    display.update(state)
                    return "completed"
                state.notes.append(f"pools not all on the final version after {cfg.settle_timeout_s:.0f} s")
                display.update(state)
                return "failed"
        display.update(state)
        await sleep_or_stop(stop, cfg.poll_s)
    return "interrupted"


async def run_demo(config: DemoConfig, *, console: Console, live: bool) -> DemoResult:
    run_dir = config.run_path(time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with logging_to(run_dir, quiet_terminal=live):
        return await _run(config, run_dir, console, live)


async def _run(config: DemoConfig, run_dir: Path, console: Console, live: bool) -> DemoResult:
    log.info("demo run directory: %s", run_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    services = ServiceSet()
    outcome, error, checks = "failed", "", []
    plan: MeshPlan | None = None
    monitor: Monitor | None = None
    try:
        plan = await asyncio.to_thread(prepare, config, run_dir)
        # The monitor reads every service as an admin, verifying the servers against the run's CA.
        async with client_session(timeout_s=10.0, tls=plan.creds.client_tls() if plan.creds else None,
                                  headers=bearer(plan.token("admin")) if plan.creds else None) as session:
            monitor = Monitor(plan, session)
            start(plan, services)
            if plan.console is not None:
                console.print(f"web console of this mesh: [bold]{plan.console.url}/[/] (while the demo runs)")
            try:
                with Display(console, live, config, monitor.upload_link, run_dir) as display:
                    outcome = await _watch(plan, services, monitor, display, stop)
                if outcome != "interrupted":
                    checks = await asyncio.to_thread(final_checks, plan, monitor.state)
            except ServiceError as e:
                outcome, error = "failed", str(e)
                log.error("%s", e)
    finally:
        if outcome == "interrupted":
            log.info("interrupted: stopping every service")
        early = [s for s in services.services if s.kind in ("pool", "trainer", "eval")]
        await services.stop(early, grace_s=config.stop_grace_s)
        await services.stop(grace_s=config.stop_grace_s)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if monitor is not None:
        monitor.read_steps()
    state = monitor.state if monitor is not None else MeshState(config.model_ids)
    processes = [{"name": s.name, "pid": s.pid, "ports": s.ports, "returncode": s.returncode(),
                  "log": str(s.log_path)} for s in services.services]
    report = build_report(state, config, run_dir=run_dir, outcome=outcome, error=error, checks=checks,
                          processes=processes)
    json_path, chart_path = await asyncio.to_thread(write_report, run_dir, report)
    return DemoResult(outcome, report, json_path, chart_path)
