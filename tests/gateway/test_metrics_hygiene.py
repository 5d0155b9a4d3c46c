"""What a gateway's /metrics shows: Prometheus' naming conventions (counters end in `_total`, no
`_created` series), build and process metrics, per-pool series, and that a follower's read-ahead of a
version not made yet is not counted as a refused request while a wrong request still is."""

from __future__ import annotations

import asyncio
import re

from deltamesh.http import client_session
from deltamesh.trainer.upload import upload_version

MODEL = "tiny-1"


def test_metrics_follow_conventions_and_read_ahead_is_not_a_refusal(kit, tmp_path):
    async def main() -> str:
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session() as s:
            m, raw, pieces = kit.version(MODEL, 1, "full", pieces=2, piece_size=1000)
            await upload_version(s, url, m, raw, pieces)
            async with s.post(f"{url}/v1/pools", json={"name": "p1", "model": MODEL, "version": 0}) as r:
                assert r.status == 201
            async with s.get(f"{url}/v1/models/{MODEL}/versions/2/delta/manifest", params={"wait": "0.2"}) as r:
                assert r.status == 404  # the read-ahead of a follower that holds the head
            async with s.get(f"{url}/v1/models/{MODEL}/versions/1/delta/manifest") as r:
                assert r.status == 404  # asked without waiting: a request for what is not here
            async with s.get(f"{url}/metrics") as r:
                return await r.text()

    text = asyncio.run(main())
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert all(name.endswith("_total") for name, kind in types.items() if kind == "counter")
    assert "_created" not in text
    assert re.search(r'^deltamesh_build_info\{python="[^"]+",role="gateway",version="[^"]+"\} 1\.0$', text, re.M)
    assert "process_resident_memory_bytes" in text
    assert 'deltamesh_gateway_pool_versions_behind{model="tiny-1",pool="p1"} 1.0' in text
    assert 'deltamesh_gateway_pool_version{model="tiny-1",pool="p1"} 0.0' in text
    assert 'deltamesh_gateway_pool_up{model="tiny-1",pool="p1"} 1.0' in text
    assert 'deltamesh_gateway_last_propagation_seconds{model="tiny-1"}' in text
    assert re.findall(r"^deltamesh_gateway_rejected_requests_total\{reason=\"(\d+)\"\} (\S+)$", text, re.M) == [
        ("404", "1.0")]
