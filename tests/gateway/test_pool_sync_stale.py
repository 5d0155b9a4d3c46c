"""`deltamesh pool sync` (a real process) against a frozen relay: the relay double of relay_double.py in
front of an honest origin that holds v0..v3 and the trainer's signed head statement for v3, its head
frozen at v1. Its registry answers still come from the honest gateway (head 3), the way a relay that
stopped following but still answers heartbeats would look.

With `--metrics-listen`, the pool serves what docs/SECURITY.md says it shows: the gateway flagged stale
(`deltamesh_pool_gateway_stale`), the refusal counted (`deltamesh_pool_gateway_refusals_total`),
`refusals` and `gateways` in its `/v1/status`, and a head metric that agrees with its one gateway's
head. `pool sync --once` ends at v1 with exit 7 (docs/CLI.md) and one warning naming v3; with an
honest gateway beside the frozen one it reaches v3 through it and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import AsyncIterator

import deltamesh_test_relay_double as relay_double  # a helper module of this folder, loaded by its conftest.py
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltamesh.delta import dir_manifest
from deltamesh.mesh.cli.exits import Exit
from deltamesh.mesh.demo.processes import free_port
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow

MODEL = "tiny"
DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


@contextlib.asynccontextmanager
async def frozen(kit, tmp_path: Path) -> AsyncIterator[tuple[str, relay_double.RelayDouble]]:
    """(honest origin URL, the relay double frozen at v1 in front of it), v0..v3 published."""
    async with kit.running_gateway(kit.config(tmp_path / "honest")) as honest:
        pub = Publisher(honest, kit.key.key, MODEL, piece_bytes=4096)
        weights = [kit.tiny_weights()]
        for v in (1, 2, 3):
            weights.append(kit.next_step(weights[-1], v))
        for w in weights[:2]:
            await pub.publish(w)
        async with relay_double.RelayDouble(honest, head=1).serving() as double:
            for w in weights[2:]:
                await pub.publish(w)  # each with the trainer's signed head statement: the last names v3
            yield honest, double


async def pool_sync(kit, tmp_path: Path, gateways: list[str], *extra: str) -> asyncio.subprocess.Process:
    args = [DELTAMESH, "pool", "sync", "--name", "p1", "--dir", str(tmp_path / "pool"), "--model", MODEL,
            "--trusted-key", str(kit.key.public), "--stall-timeout-s", "1",
            "--heartbeat-s", "0.3", *extra]
    for g in gateways:
        args += ["--gateway", g]
    return await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, "DELTAMESH_TOKEN": "t", "DELTAMESH_LOG": "INFO"})


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=5) as r:
        return json.loads(r.read())


def test_pool_sync_shows_a_frozen_gateway_as_stale_in_its_metrics_and_status(kit, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with frozen(kit, tmp_path) as (_, double):
            proc = await pool_sync(kit, tmp_path, [double.url], "--metrics-listen", url.removeprefix("http://"),
                                   "--stale-after-s", "1", "--poll-wait-s", "0.5")
            try:
                for _ in range(150):
                    await asyncio.sleep(0.1)
                    try:
                        got = await asyncio.to_thread(scrape, url)
                    except OSError:
                        continue
                    stale = f"deltamesh_pool_gateway_stale[('gateway', '{double.url}'), ('model', 'tiny')]"
                    if got.get(stale) == 1:
                        return got, await asyncio.to_thread(status, url)
                raise AssertionError(f"the frozen gateway was never shown stale: {got}")
            finally:
                proc.terminate()
                await proc.communicate()

    got, state = asyncio.run(main())
    refused = "deltamesh_pool_gateway_refusals_total[('model', 'tiny'), ('reason', 'stale')]"
    assert got[refused] == 1
    head = got["deltamesh_pool_sync_head[('model', 'tiny')]"]
    (gateway,) = state["gateways"].values()
    assert head == gateway["head"] == 1 and state["head"] == 1  # not the 3 of the registry's answers
    assert gateway["state"] == "stale" and "v3" in gateway["reason"]
    assert state["refusals"] == {"rollback": 0, "equivocation": 0, "statement": 0, "stale": 1}
    assert got["deltamesh_pool_sync_version[('model', 'tiny')]"] == 1


def test_pool_sync_once_against_a_frozen_gateway_exits_7_with_a_warning(kit, tmp_path):
    async def main():
        async with frozen(kit, tmp_path) as (honest, double):
            alone = await pool_sync(kit, tmp_path, [double.url], "--once")
            out, err = await asyncio.wait_for(alone.communicate(), 60)
            first = (alone.returncode, out.decode(), err.decode())
            both = await pool_sync(kit, tmp_path / "both", [double.url, honest], "--once")
            out, err = await asyncio.wait_for(both.communicate(), 60)
            return first, (both.returncode, out.decode(), err.decode())

    (code, out, err), (code2, out2, err2) = asyncio.run(main())
    assert code == Exit.STALE == 7, err
    assert out.strip() == "tiny v1" and dir_manifest(tmp_path / "pool").version == 1
    warned = [line for line in err.splitlines() if "stopped at v1, behind" in line]
    assert len(warned) == 1 and " W " in warned[0] and "v3 exists" in warned[0], err
    assert "Traceback" not in err and not [line for line in err.splitlines() if " E " in line], err
    # Beside an honest gateway: the frozen one is put last, and the pool reaches v3 through the other.
    assert code2 == 0, err2
    assert out2.strip() == "tiny v3" and dir_manifest(tmp_path / "both" / "pool").version == 3
    assert "is stale" in err2
