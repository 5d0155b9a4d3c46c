"""A new pool's memory against an upstream whose answers never end, at every stage of its first download.

A real `deltamesh pool sync --once` process, cold (empty directory, its model named, so it starts on
parts of the newest full before it knows the version; for the pieces' run it names no model, so it
fetches pieces, the first ones asked for with the manifest), follows the hostile proxy of hostile.py in
front of a real gateway holding a ~10 MB model. In each run one stage's answers go on for ever after
their honest bytes: the parts, the pieces, the manifest, or every control-plane answer (head, plan,
statement, registration, health). However the run ends, the pool's peak RSS (VmHWM) stays within
256 MB of the peak of the same sync against the honest gateway, which holds the interpreter, the
libraries and the model once: the hostile bytes cost no more than that bound, and the run ends
within its give-up time. Parts and pieces that end in filler are still taken whole from their honest
bytes (the read stops where the signed manifest says), so those runs complete.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import deltamesh_test_hostile as hostile  # a helper module of this folder, loaded by its conftest.py
import pytest
import torch

from deltamesh.delta import dir_manifest, read_weights
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow

MODEL = "m"
MiB = 1024 * 1024
BOUND = 256 * MiB
DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


def model_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(2560, 2048, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(2048, dtype=torch.bfloat16)}


def peak_rss(pid: int) -> int | None:
    """VmHWM of `pid` in bytes (its peak resident set so far); None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def sync_once(kit, pool_dir: Path, url: str, limit: int | None = None, *,
                    parts: bool = True) -> tuple[int | None, int, str, float]:
    """(exit code, peak RSS, stderr, seconds) of `pool sync --once` into `pool_dir` from `url`; killed
    early (exit code None) once its peak passes `limit`. With `parts`, the model is named, so the cold
    pool starts on parts; without, it asks the gateway for its model and fetches pieces (the first
    ones asked for with the manifest)."""
    named = ["--model", MODEL] if parts else []
    proc = await asyncio.create_subprocess_exec(
        DELTAMESH, "pool", "sync", "--once", "--gateway", url, "--name", "p", "--dir", str(pool_dir), *named,
        "--trusted-key", str(kit.key.public), "--connections", "4", "--stall-timeout-s", "2",
        "--give-up-s", "6", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "DELTAMESH_TOKEN": "t"})
    errors = asyncio.ensure_future(proc.stderr.read())
    peak, t0 = 0, time.monotonic()
    while proc.returncode is None and time.monotonic() - t0 < 120:
        peak = max(peak, peak_rss(proc.pid) or 0)
        if limit is not None and peak > limit:
            proc.kill()
            await proc.wait()
            return None, peak, (await errors).decode(errors="replace"), time.monotonic() - t0
        try:
            await asyncio.wait_for(proc.wait(), 0.02)
        except TimeoutError:
            pass
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    return proc.returncode, peak, (await errors).decode(errors="replace"), time.monotonic() - t0


def test_an_endless_answer_at_any_stage_costs_a_new_pool_no_more_than_the_bound(kit, tmp_path):
    weights = model_weights()
    model_bytes = sum(w.numel() * w.element_size() for w in weights.values())

    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "gw")) as url:
            async with Publisher(url, kit.key.key, MODEL) as publisher:
                await publisher.publish(weights)
            code, honest, err, _ = await sync_once(kit, tmp_path / "honest", url)
            assert code == 0, err
            runs = {}
            for stage in hostile.ENDLESS:
                mode = hostile.Mode(endless=frozenset({stage}))
                async with hostile.Hostile(url, mode).serving() as proxy:
                    runs[stage] = (*await sync_once(kit, tmp_path / stage, proxy.url, honest + BOUND,
                                                    parts=stage != "pieces"), mode.endless_sent)
            return honest, runs

    honest, runs = asyncio.run(main())
    assert honest < 4 * model_bytes + 512 * MiB  # the interpreter, torch and the model: a sanity check
    for stage, (code, peak, err, took, sent) in runs.items():
        assert code is not None, f"{stage}: peak RSS passed {(honest + BOUND) / MiB:.0f} MB ({peak / MiB:.0f} MB)"
        assert peak <= honest + BOUND, (stage, peak, honest)
        assert sent > 0, f"{stage}: the proxy never sent filler"
        assert took < 60, (stage, took)
        assert "Traceback" not in err, err
    for stage in ("parts", "pieces"):  # their honest bytes are all a pool needs; the filler is never read
        code, *_ = runs[stage]
        assert code == 0, (stage, runs[stage][2][-2000:])
        assert kit.same_bits(read_weights(tmp_path / stage), weights)
    assert dir_manifest(tmp_path / "control") is None and dir_manifest(tmp_path / "manifest") is None
