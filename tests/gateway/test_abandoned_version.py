"""A version whose upload was abandoned never holds a pool back from the versions after it.

A trainer killed while uploading a version restarts from its checkpoint and publishes the next version
as a delta on the newest version the gateway holds whole (trainer/stream_start.py, `start_stream`), so the
version it left announced never completes. Found by the chaos soak (benchmarks/soak.py, seed 3): every
pool that had planned its way through that version waited for its pieces for `give_up_s` (120 s), the
pools fell behind their staleness bound and stopped leasing, and the trainer starved for two minutes.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from deltamesh.delta import encode_delta, read_weights
from deltamesh.gateway_client import version_url
from deltamesh.http import client_session, request_bytes
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "tiny"
PIECE = 4096
STALL_S = 1.0


@pytest.mark.slow
def test_a_pool_leaves_an_abandoned_version_for_the_newer_head_within_a_few_stall_timeouts(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "gw", piece_wait_s=0.3)) as url, client_session() as s:
            w0 = kit.tiny_weights()
            w1 = kit.next_step(w0, 1)
            lost, w3 = kit.next_step(w1, 2), kit.next_step(w1, 3)
            publisher = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE)
            await publisher.publish(w0)
            await publisher.publish(w1)
            config = PoolSyncConfig(gateways=[url], token="region-token-1", name="p", dir=str(tmp_path / "pool"), model=MODEL,
                                    trusted_keys=[str(kit.key.public)], stall_timeout_s=STALL_S, give_up_s=60.0)
            async with WeightSync(config) as sync:
                assert await sync.sync_once() and sync.version == 1
                # v2 is announced (its manifest is in) and then its trainer dies: no piece ever comes.
                v2 = encode_delta(w1, lost, model_id=MODEL, version=2, base_version=1, key=kit.key.key,
                                  piece_bytes=PIECE)
                await request_bytes(s, "PUT", f"{version_url(url, MODEL, 2, 'delta')}/manifest", data=v2.manifest_bytes,
                                    headers={"Content-Type": "application/json"})
                syncing = asyncio.create_task(sync.sync_once())  # plans v1 -> v2 and waits for v2's pieces
                await asyncio.sleep(4 * STALL_S)
                assert not syncing.done()
                # The restarted trainer publishes v3 as a delta on v1, the newest version held whole.
                v3 = encode_delta(w1, w3, model_id=MODEL, version=3, base_version=1, key=kit.key.key,
                                  piece_bytes=PIECE)
                await upload_version(s, url, v3.manifest, v3.manifest_bytes, v3.pieces)
                started = time.monotonic()
                assert await asyncio.wait_for(syncing, 30) is True
                took = time.monotonic() - started
                assert sync.version == 3 and kit.same_bits(read_weights(config.dir), w3)
                assert took < 6 * STALL_S + 2.0, f"the pool moved on after {took:.1f} s"

    asyncio.run(main())
