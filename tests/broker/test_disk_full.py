"""Disk full: the broker's database on a small tmpfs that fills up. Submissions and batch requests get
503 (no acknowledgement, nothing half-written), and once space returns the broker carries on with
its data intact and without a restart."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deltamesh.broker_client import BrokerClient
from deltamesh.http import HttpError
from deltamesh.trainer.batch_client import BatchClient


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs, unmounted afterwards; skipped where mounting is not permitted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> Path:
    """Write zeros to `path` until the file system has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return path


@pytest.mark.slow
def test_disk_full_gives_503_and_recovers(broker_process, make_group, small_disk):
    broker = broker_process('[broker]\nmodels = ["m"]\n', db=small_disk / "broker.db")
    broker.start()

    async def scenario() -> None:
        # failover_s=0: the broker's 503 itself is under test, not the client's retries
        async with BrokerClient(broker.url, pool="p", failover_s=0) as pool, \
                BatchClient(broker.url, "m", failover_s=0) as trainer:
            before = make_group("before", [1.0, 0.0, 1.0, 0.0], tokens=2048)
            assert (await pool.submit(before)).accepted == 4
            filler = fill(small_disk / "filler")

            during = make_group("during", [0.0, 1.0, 0.0, 1.0], tokens=2048)
            with pytest.raises(HttpError) as refused:
                await pool.submit(during)
            assert refused.value.status == 503 and "full" in refused.value.reason
            with pytest.raises(HttpError) as refused:  # serving a batch needs a write too
                await trainer.next_batch(4, timeout_s=2)
            assert refused.value.status == 503
            status = broker.get("/v1/status")["models"]["m"]
            assert status["fresh_samples"] == 4  # the batch that could not be recorded was put back

            filler.unlink()
            assert (await pool.submit(during)).accepted == 4  # same broker process, no restart
            batch = await trainer.next_batch(8, timeout_s=5)
            assert batch.groups == ["before", "during"]
            assert all(np.array_equal(batch.tokens[i], t.tokens) for i, t in enumerate(before + during))

    asyncio.run(scenario())
    broker.stop()
    with sqlite3.connect(broker.db) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 8
        assert db.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == 1
