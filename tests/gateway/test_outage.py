"""A pool whose gateway goes away: its retries back off exponentially with jitter up to a cap, and the
log shows the outage (one line when it starts, a reminder every few minutes, one when it ends), not
every try. `Outage` alone on a fake clock, then a real `deltamesh pool sync` against a real gateway
that is killed and started again on the same port and store, and one that accepts and never answers."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from deltamesh.delta import dir_manifest
from deltamesh.mesh.pool.retry_log import Outage
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]


def test_backoff_grows_with_jitter_to_its_cap_and_logs_once_per_change(caplog):
    now = [0.0]
    outage = Outage("pool p1: sync", base_s=1, cap_s=30, remind_s=300, clock=lambda: now[0], rng=random.Random(4))
    caplog.set_level(logging.INFO, logger="deltamesh.mesh.pool.retry_log")
    delays = []
    for _ in range(12):
        delays.append(outage.failed("no gateway answered"))
        now[0] += delays[-1]
    for i, d in enumerate(delays):  # base * 2^i, capped, times a factor in [0.5, 1.5)
        assert 0.5 * min(30, 2**i) <= d < 1.5 * min(30, 2**i)
    assert len(caplog.records) == 1 and "trying again with backoff" in caplog.records[0].message
    now[0] += 300
    outage.failed("no gateway answered")
    assert len(caplog.records) == 2 and "still failing after" in caplog.records[1].message
    outage.succeeded()
    outage.succeeded()
    assert len(caplog.records) == 3 and "working again after" in caplog.records[2].message
    assert outage.failed("again") < 1.5  # a new outage starts from the base


def _outage_lines(pool) -> list[str]:
    return [line for line in pool.log_tail(100_000).splitlines() if "deltamesh.mesh.pool.retry_log" in line]


def test_a_pool_whose_gateway_goes_away_logs_the_outage_not_each_try(kit, spawn_gateway, spawn_pool):
    gw = spawn_gateway("origin")
    port = int(gw.url.rsplit(":", 1)[1])
    publisher = Publisher(gw.url, kit.key.key, MODEL, piece_bytes=4096)
    w0 = kit.tiny_weights()
    asyncio.run(publisher.publish(w0))
    pool = spawn_pool("p1", [gw.url], extra=["--model", MODEL])
    kit.wait_until(lambda: dir_manifest(pool.dir) is not None, 30, "the pool to sync v0")

    gw.kill()  # SIGKILL: gone without a word
    time.sleep(8)  # ~8 tries at the old fixed 1 s pace, 4 heartbeats at 0.5 s... each once a line
    lines = _outage_lines(pool)
    assert len(lines) == 2, lines  # the sync's outage and the heartbeats', one line each
    assert any("sync:" in line and "with backoff" in line for line in lines), lines
    assert pool.proc.poll() is None

    again = spawn_gateway("origin", port=port, store=gw.store)
    asyncio.run(Publisher(again.url, kit.key.key, MODEL, piece_bytes=4096).publish(kit.next_step(w0, 1)))
    kit.wait_until(lambda: (dir_manifest(pool.dir).version == 1), 60, "the pool to take v1 once the gateway is back")
    kit.wait_until(lambda: any("sync: working again after" in line for line in _outage_lines(pool)), 10,
                   "the end of the outage to be logged")
    assert "Traceback" not in pool.log_tail(100_000)


def test_a_gateway_that_never_answers_ends_a_one_off_sync_after_the_stall_timeout(tmp_path, trainer_key):
    """A listener that accepts and stays silent: `pool sync --once` gives up after its stall timeout, with
    one error line and exit 3 (a URL that does not answer, docs/CLI.md)."""
    silent = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: [held.append(silent.accept()) for _ in range(20)], daemon=True).start()
    started = time.monotonic()
    done = subprocess.run([*DELTAMESH, "pool", "sync", "--once", "--gateway", f"http://127.0.0.1:{silent.getsockname()[1]}",
                           "--name", "p1", "--dir", str(tmp_path / "p1"), "--trusted-key",
                           str(trainer_key.public), "--model", MODEL, "--stall-timeout-s", "1"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "DELTAMESH_TOKEN": "t"})
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert time.monotonic() - started < 20
    assert len([line for line in done.stderr.splitlines() if " E " in line]) == 1, done.stderr
    silent.close()
