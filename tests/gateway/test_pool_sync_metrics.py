"""`deltamesh pool sync --metrics-listen`: a weights-only pool serves Prometheus `/metrics` (version held,
head seen, lag, transfer state, failed rounds in a row, with process and build metrics), and serves
none unless asked. A real pool process following a real gateway, scraped over HTTP."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.delta import dir_manifest
from deltamesh.mesh.demo.processes import free_port
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_pool_sync_serves_its_metrics(kit, spawn_gateway, spawn_pool):
    gw = spawn_gateway("origin")
    asyncio.run(Publisher(gw.url, kit.key.key, MODEL, piece_bytes=4096).publish(kit.tiny_weights()))
    url = f"http://127.0.0.1:{free_port()}"
    pool = spawn_pool("p1", [gw.url], extra=["--model", MODEL, "--metrics-listen", url.removeprefix("http://")])
    kit.wait_until(lambda: dir_manifest(pool.dir) is not None, 30, "the pool to sync v0")

    def synced() -> dict | None:
        try:
            got = scrape(url)
        except OSError:
            return None
        return got if got.get("deltamesh_pool_sync_version[('model', 'tiny')]") == 0 else None

    kit.wait_until(synced, 15, "the pool's metrics to show v0")
    got = synced()
    assert got["deltamesh_pool_sync_versions_behind[('model', 'tiny')]"] == 0
    assert got["deltamesh_pool_sync_failed_rounds"] == 0
    assert any(k.startswith("deltamesh_build_info") and "pool-sync" in k for k in got)
    assert "process_cpu_seconds_total" in got
    for path in ("/metrics", "/v1/status"):  # read-only: a write is refused and changes nothing
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}{path}", data=b"{}", method="POST"), timeout=5)
        assert refused.value.code == 405
    assert scrape(url)["deltamesh_pool_sync_version[('model', 'tiny')]"] == 0

    gw.kill()
    kit.wait_until(lambda: scrape(url)["deltamesh_pool_sync_failed_rounds"] >= 1, 30, "failed rounds to show")
    assert scrape(url)["deltamesh_pool_sync_state[('state', 'error')]"] == 1
