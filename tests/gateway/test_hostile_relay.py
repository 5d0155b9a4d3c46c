"""A relay (and a pool) whose upstream is slow or hostile: the hostile proxy of hostile.py in front of a
real origin, and a real relay gateway in this process following it.

A version whose pieces the upstream tampers with fails with a bounded number of requests, is retried
with backoff, and never holds up the next version; once the upstream turns honest it arrives. A
trickling upstream with an honest alternate costs a relay about one stall timeout, and an upstream
whose control plane answers slowly is passed over for its alternate by relays and pools.
"""

from __future__ import annotations

import asyncio
import logging
import time

import deltamesh_test_hostile as hostile  # a helper module of this folder, loaded by its conftest.py
import pytest

from deltamesh.http import HttpError, client_session, request_json
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "m"
STALL = 1.0

pytestmark = pytest.mark.slow


async def _publish(kit, s, url: str, version: int, kind: str, **kw) -> None:
    m, raw, pieces = kit.version(MODEL, version, kind, **kw)
    await upload_version(s, url, m, raw, pieces)


async def _complete(s, url: str, version: int, kind: str) -> bool:
    try:
        listing = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/versions")
    except HttpError:
        return False
    return any(v["version"] == version and v["kind"] == kind and v["complete"] for v in listing["versions"])


async def _until(predicate, timeout: float, what: str) -> float:
    """Seconds until `predicate()` (a coroutine function) holds; AssertionError after `timeout`."""
    t0 = time.monotonic()
    while not await predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def test_a_tampered_version_is_retried_with_backoff_and_never_blocks_the_next(kit, tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session() as s:
            bad = hostile.Hostile(origin, hostile.Mode(flip=True, versions={1}))
            async with bad.serving():
                relay_config = kit.config(tmp_path / "r", upstreams=[bad.url], stall_timeout_s=STALL)
                async with kit.running_gateway(relay_config) as relay:
                    await _publish(kit, s, origin, 0, "full")
                    await _until(lambda: _complete(s, relay, 0, "full"), 10, "the relay to mirror v0")
                    await _publish(kit, s, origin, 1, "delta")

                    async def retrying() -> bool:
                        status = await request_json(s, "GET", f"{relay}/healthz")
                        failed = [r for r in status["relay"]["retrying"] if r["version"] == 1]
                        # one clear error: the piece, the upstream, what it did
                        return bool(failed) and "no source served it intact" in failed[0]["error"] \
                            and bad.url in failed[0]["error"] and "bad bytes" in failed[0]["error"]

                    await _until(retrying, 10, "the relay to report v1 as failed and waiting for a retry")
                    await _publish(kit, s, origin, 2, "delta")
                    took = await _until(lambda: _complete(s, relay, 2, "delta"), 10, "the relay to mirror v2")
                    assert took < 2 * STALL + 1.0, f"v2 took {took:.1f}s behind the stuck v1"
                    assert not await _complete(s, relay, 1, "delta")
                    control_before = bad.control_requests
                    await asyncio.sleep(2.0)  # v1 keeps failing meanwhile, with backoff
                    asked = [n for (v, _, _), n in bad.piece_requests.items() if v == 1]
                    assert asked and max(asked) <= 10, f"requests per piece of the tampered version: {asked}"
                    listed = bad.control_requests - control_before
                    assert listed <= 10, f"{listed} listings in 2 s while v1 waits for its retry"
                    bad.mode = hostile.Mode()  # the upstream turns honest: v1 arrives on a later retry
                    await _until(lambda: _complete(s, relay, 1, "delta"), 30, "the relay to mirror v1 at last")
                    status = await request_json(s, "GET", f"{relay}/healthz")
                    assert status["relay"]["retrying"] == []

    asyncio.run(main())
    assert "never retrieved" not in caplog.text


def test_a_relay_leaves_a_trickling_upstream_for_its_alternate_in_time(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session() as s:
            async with hostile.Hostile(origin, hostile.Mode(trickle_bps=2000)).serving() as bad:
                relay_config = kit.config(tmp_path / "r", upstreams=[bad.url, origin], stall_timeout_s=STALL)
                async with kit.running_gateway(relay_config) as relay:
                    await _publish(kit, s, origin, 0, "full", pieces=4, piece_size=64 * 1024)
                    took = await _until(lambda: _complete(s, relay, 0, "full"), 20, "the relay to mirror v0")
                    assert took < 2 * STALL + 1.5, f"took {took:.1f}s"

    asyncio.run(main())


def test_an_upstream_with_a_slow_control_plane_is_passed_over(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session() as s:
            async with hostile.Hostile(origin, hostile.Mode(control_delay_s=4 * STALL)).serving() as slow:
                relay_config = kit.config(tmp_path / "r", upstreams=[slow.url, origin], stall_timeout_s=STALL)
                async with kit.running_gateway(relay_config) as relay:
                    await _publish(kit, s, origin, 0, "full")
                    took = await _until(lambda: _complete(s, relay, 0, "full"), 20, "the relay to mirror v0")
                    assert took < 2 * STALL + 1.0, f"took {took:.1f}s"
                w = kit.tiny_weights()
                await Publisher(origin, kit.key.key, MODEL, piece_bytes=4096).publish(w)
                config = PoolSyncConfig(gateways=[slow.url, origin], token="region-token-1", name="p",
                                        dir=str(tmp_path / "pool"), trusted_keys=[str(kit.key.public)], model=MODEL,
                                        stall_timeout_s=STALL)
                took = await kit.timed_sync(config, w)
                assert took < 2 * STALL + 1.5, f"the pool took {took:.1f}s"

    asyncio.run(main())
