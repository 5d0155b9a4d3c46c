"""Stopping, as an operator sees it (docs/CLI.md): Ctrl-C or SIGTERM logs one "stopping" line, a pool
deregisters from its gateway, and the process exits 130 (SIGINT) or 143 (SIGTERM), a gateway within
2 s; a pool that vanishes without deregistering is forgotten after `pool_expire_s`. Real `deltamesh
gateway` and `deltamesh pool sync` processes on loopback sockets."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from deltamesh.delta import dir_manifest
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.registry import PoolRegistry
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"


def _pool_names(kit, url: str) -> list[str]:
    return [p["name"] for p in kit.get_json(f"{url}/v1/pools")["pools"]]


def _published_gateway(kit, spawn_gateway, *extra: str):
    gw = spawn_gateway("origin", extra=list(extra))
    asyncio.run(Publisher(gw.url, kit.key.key, MODEL, piece_bytes=4096).publish(kit.tiny_weights()))
    return gw


def test_ctrl_c_stops_a_pool_cleanly_and_sigterm_a_gateway_within_2s(kit, spawn_gateway, spawn_pool):
    gw = _published_gateway(kit, spawn_gateway)
    pool = spawn_pool("p1", [gw.url], extra=["--model", MODEL])
    kit.wait_until(lambda: dir_manifest(pool.dir) is not None and _pool_names(kit, gw.url) == ["p1"], 30,
                   "the pool to sync and register")

    pool.proc.send_signal(signal.SIGINT)
    assert pool.proc.wait(15) == 130, pool.log_tail()
    log = pool.log_tail()
    assert "pool p1: stopping (SIGINT)" in log and "deregistered from" in log and "Traceback" not in log, log
    assert _pool_names(kit, gw.url) == [], "a stopped pool deregisters"

    started = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(10) == 143, gw.log_tail()
    assert time.monotonic() - started < 2.0, "a gateway stops within 2 s"
    assert "gateway origin: stopping (SIGTERM)" in gw.log_tail() and "Traceback" not in gw.log_tail()


def test_a_gateway_with_a_long_poll_waiting_still_stops_within_2s(kit, spawn_gateway, spawn_pool):
    gw = _published_gateway(kit, spawn_gateway)
    pool = spawn_pool("p1", [gw.url], extra=["--model", MODEL, "--poll-wait-s", "30"])
    kit.wait_until(lambda: dir_manifest(pool.dir) is not None, 30, "the pool to sync")
    time.sleep(0.5)  # the pool is now long-polling the gateway for the next head
    started = time.monotonic()
    gw.proc.send_signal(signal.SIGINT)
    assert gw.proc.wait(10) == 130, gw.log_tail()
    assert time.monotonic() - started < 2.0, gw.log_tail()


def test_a_pool_that_vanishes_is_forgotten_after_pool_expire_s(kit, spawn_gateway, spawn_pool):
    gw = _published_gateway(kit, spawn_gateway, "--pool-expire-s", "4")  # heartbeat timeout: 3 s
    pool = spawn_pool("p1", [gw.url], extra=["--model", MODEL])
    kit.wait_until(lambda: _pool_names(kit, gw.url) == ["p1"], 30, "the pool to register")
    pool.proc.kill()  # no chance to deregister
    pool.proc.wait(10)
    kit.wait_until(lambda: not kit.get_json(f"{gw.url}/v1/pools")["pools"][0]["up"], 10, "the pool to be down")
    kit.wait_until(lambda: _pool_names(kit, gw.url) == [], 10, "the pool to be forgotten")
    assert "pool p1: forgotten, no heartbeat for" in gw.log_tail()


def test_expiry_is_off_with_zero_and_never_below_the_heartbeat_timeout(tmp_path, trainer_key):
    now = [0.0]
    registry = PoolRegistry(3.0, lambda: now[0], expire_s=0)
    registry.register({"name": "p1"})
    now[0] = 10_000.0
    assert [r.name for r in registry.pools()] == ["p1"]  # listed down, never forgotten
    with pytest.raises(ValueError, match="pool_expire_s"):
        GatewayConfig(trusted_keys=[str(trainer_key.public)], anonymous=True, heartbeat_timeout_s=30,
                      pool_expire_s=10)
