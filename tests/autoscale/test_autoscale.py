"""The autoscaler: launchers with real (trivial) processes, the control loop's bounds and cooldown
against a real broker's balance report, and `deltamesh autoscale` as a process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.mesh.autoscale.config import AutoscaleConfig
from deltamesh.mesh.autoscale.launchers import CommandLauncher, LaunchError, LocalLauncher
from deltamesh.mesh.autoscale.loop import Autoscaler
from deltamesh.mesh.broker.config import BalanceConfig, BrokerConfig
from deltamesh.trainer.batch_client import BatchClient

DELTAMESH = [sys.executable, "-c", "import sys; from deltamesh.mesh.cli import main; sys.exit(main())"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_local_launcher_starts_and_stops_pool_processes(tmp_path):
    async def scenario():
        launcher = LocalLauncher(["sleep", "60"], stop_grace_s=5)
        stubborn = LocalLauncher(["sh", "-c", "trap '' TERM; sleep 60"], stop_grace_s=0.3)
        try:
            await launcher.scale_to(3)
            pids = [p.pid for p in launcher.processes]
            assert launcher.current() == 3 and all(alive(pid) for pid in pids)
            await launcher.scale_to(1)  # the newest go first
            assert launcher.current() == 1 and alive(pids[0]) and not alive(pids[1]) and not alive(pids[2])
            os.kill(pids[0], 9)  # a pool dies on its own: it no longer counts
            await asyncio.sleep(0.2)
            assert launcher.current() == 0
            await stubborn.scale_to(1)
            pid = stubborn.processes[0].pid
            await asyncio.sleep(0.2)  # let the shell install its trap
            start = time.monotonic()
            await stubborn.scale_to(0)  # SIGTERM is ignored: SIGKILL after the grace period
            assert not alive(pid) and 0.25 < time.monotonic() - start < 5
        finally:
            await launcher.close()
            await stubborn.close()
        assert launcher.current() == 0

    asyncio.run(scenario())


def test_command_launcher_runs_the_command_with_the_count(tmp_path):
    out = tmp_path / "counts"

    async def scenario():
        launcher = CommandLauncher(["sh", "-c", f"echo {{count}} >> {out}"], initial=2)
        assert launcher.current() == 2
        await launcher.scale_to(5)
        assert launcher.current() == 5 and out.read_text() == "5\n"
        failing = CommandLauncher(["sh", "-c", "exit 3"], initial=1)
        with pytest.raises(LaunchError, match="exited with code 3"):
            await failing.scale_to(4)
        assert failing.current() == 1
        slow = CommandLauncher(["sleep", "30"], initial=1, timeout_s=0.3)
        with pytest.raises(LaunchError, match="longer than"):
            await slow.scale_to(2)
        with pytest.raises(LaunchError, match="cannot run"):
            await CommandLauncher(["/nonexistent/scaler"]).scale_to(1)

    asyncio.run(scenario())


def test_autoscaler_acts_on_the_report_within_bounds_and_cooldown(serve_broker, make_group, tmp_path):
    out = tmp_path / "counts"
    config = AutoscaleConfig(launcher="command", command=["sh", "-c", f"echo {{count}} >> {out}"], initial_pools=2,
                             min_pools=1, max_pools=6, cooldown_s=60)
    now = [1000.0]

    async def scenario():
        async with serve_broker(BrokerConfig(models=["m"], balance=BalanceConfig(window_steps=1))) as (url, broker), \
                BatchClient(url, "m") as trainer, BrokerClient(url) as reader:
            launcher = CommandLauncher(config.command, initial=config.initial_pools)
            scaler = Autoscaler(config, launcher, reader.balance, clock=lambda: now[0])
            assert (await scaler.step()).reason == "balanced"  # no steps yet: hold
            await trainer.report_step(wait_s=5.0, step_s=10.0)  # w = 0.5: 2 pools -> ceil(2 / 0.5) = 4
            decision = await scaler.step()
            assert (decision.acted, decision.current, decision.wanted, decision.target_gpus) == (True, 2, 4, 4)
            assert (await scaler.step()).reason == "cooldown"
            now[0] += 61
            decision = await scaler.step()  # 4 -> 8 wanted, clamped to max_pools
            assert (decision.wanted, decision.target_gpus, launcher.current()) == (6, 8, 6)
            now[0] += 61
            async with BrokerClient(url, pool="p") as pool:
                await pool.submit([t for i in range(20) for t in make_group(f"g{i}", [1.0, 0.0, 1.0, 0.0, 1.0])])
            assert len(await trainer.next_batch(10, timeout_s=5)) == 10
            await trainer.report_step(wait_s=0.0, step_s=10.0)  # fed, 100 made for 10 used: ceil(6*0.1*1.1) = 1
            decision = await scaler.step()
            assert (decision.wanted, launcher.current()) == (1, 1)
        assert out.read_text().split() == ["4", "6", "1"]

    asyncio.run(scenario())


def test_autoscale_command_runs_as_a_process(serve_broker, tmp_path):
    out = tmp_path / "counts"
    cfg = tmp_path / "autoscale.toml"

    async def scenario():
        async with serve_broker(BrokerConfig(models=["m"])) as (url, broker), BatchClient(url, "m") as trainer:
            await trainer.report_step(wait_s=9.0, step_s=10.0)  # w = 0.9: 1 pool -> 10, clamped to 3
            cfg.write_text(f'[autoscale]\nbroker = "{url}"\nlauncher = "command"\n'
                           f'command = ["sh", "-c", "echo {{count}} >> {out}"]\ninitial_pools = 1\nmax_pools = 3\n')
            proc = subprocess.Popen([*DELTAMESH, "autoscale", "--config", str(cfg), "--interval-s", "0.2"])
            try:
                for _ in range(100):
                    if out.exists():
                        break
                    await asyncio.sleep(0.1)
            finally:
                proc.terminate()
                await asyncio.to_thread(proc.wait, 30)
            assert proc.returncode == 143  # stopped cleanly by SIGTERM (docs/CLI.md)

    asyncio.run(scenario())
    assert out.read_text().split() == ["3"]
