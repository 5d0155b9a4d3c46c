"""A full disk is a state, not a crash: on a small tmpfs, a version that does not fit is refused with 507
before anything is written or announced, nothing temporary is left behind, the state shows in the
health answer and the metrics, and the same publish succeeds once space is freed. A relay whose disk
is full reports it and mirrors the version on its own once there is room.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from deltamesh.http import HttpError, client_session, request_bytes, request_json
from deltamesh.trainer.upload import upload_version

MODEL = "m"
MIB = 2**20


@pytest.fixture
def small_fs(tmp_path: Path):
    """mount(name, size_mib): a fresh tmpfs of that size (unmounted after the test)."""
    mounted: list[Path] = []

    def mount(name: str, size_mib: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the disk-full tests need root to mount one")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _ballast(path: Path, mib: int) -> Path:
    """Another writer's file, taking `mib` MiB of the filesystem."""
    f = path / "ballast"
    f.write_bytes(b"\0" * (mib * MIB))
    return f


def _leftovers(store: Path) -> list[str]:
    return [str(p) for p in store.rglob("*") if p.name.endswith(".tmp")]


async def _metric(s, url: str, name: str) -> float:
    text = (await request_bytes(s, "GET", f"{url}/metrics")).decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


def test_a_version_that_does_not_fit_is_refused_with_507_and_published_once_space_is_freed(kit, small_fs):
    store = small_fs("origin", 20)
    m, raw, pieces = kit.version(MODEL, 0, "full", pieces=5, piece_size=2 * MIB)  # 10 MiB

    async def main():
        config = kit.config(store.parent, store=str(store), disk_margin_mib=1)
        async with kit.running_gateway(config) as url, client_session(timeout_s=60) as s:
            ballast = _ballast(store, 12)
            with pytest.raises(HttpError) as refused:
                await upload_version(s, url, m, raw, pieces)
            assert refused.value.status == 507 and "no room" in refused.value.reason
            assert (await request_json(s, "GET", f"{url}/v1/models"))["models"] == {}  # nothing announced
            assert not (store / "models" / MODEL).exists() and _leftovers(store) == []
            health = await request_json(s, "GET", f"{url}/healthz")
            assert health["disk"]["full"] is True
            assert await _metric(s, url, "deltamesh_gateway_disk_full") == 1
            ballast.unlink()
            assert await upload_version(s, url, m, raw, pieces) == 10 * MIB  # the same publish, now it fits
            assert (await request_json(s, "GET", f"{url}/v1/models/{MODEL}/head"))["head"] == 0
            assert (await request_json(s, "GET", f"{url}/healthz"))["disk"]["full"] is False
            assert await _metric(s, url, "deltamesh_gateway_disk_full") == 0

    asyncio.run(main())


def test_a_disk_filled_by_another_writer_refuses_pieces_and_keeps_no_temporary_file(kit, small_fs):
    store = small_fs("origin", 20)
    m, raw, pieces = kit.version(MODEL, 0, "full", pieces=5, piece_size=2 * MIB)

    async def main():
        config = kit.config(store.parent, store=str(store), disk_margin_mib=1)
        async with kit.running_gateway(config) as url, client_session(timeout_s=60) as s:
            base = f"{url}/v1/models/{MODEL}/versions/0/full"
            await request_bytes(s, "PUT", f"{base}/manifest", data=raw)  # room for all of it is reserved
            ballast = _ballast(store, 15)  # ... and then someone else fills the disk
            with pytest.raises(HttpError) as refused:
                await upload_version(s, url, m, raw, pieces, connections=1)
            assert refused.value.status == 507
            assert _leftovers(store) == []
            ballast.unlink()
            await upload_version(s, url, m, raw, pieces)  # finishes what is missing
            listing = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/versions")
            assert listing["versions"][0]["complete"] is True

    asyncio.run(main())


def test_a_relay_with_a_full_disk_reports_it_and_mirrors_once_there_is_room(kit, tmp_path, small_fs):
    relay_store = small_fs("relay", 20)

    async def main():
        async with kit.running_gateway(kit.config(tmp_path / "o")) as origin, client_session(timeout_s=60) as s:
            relay_config = kit.config(tmp_path, store=str(relay_store), upstreams=[origin], disk_margin_mib=1)
            async with kit.running_gateway(relay_config) as relay:
                ballast = _ballast(relay_store, 12)
                await upload_version(s, origin, *kit.version(MODEL, 0, "full", pieces=5, piece_size=2 * MIB))

                async def reported() -> bool:
                    health = await request_json(s, "GET", f"{relay}/healthz")
                    return health["disk"]["full"] and any("disk full" in r["error"] for r in health["relay"]["retrying"])

                for _ in range(200):
                    if await reported():
                        break
                    await asyncio.sleep(0.05)
                assert await reported()
                assert await _metric(s, relay, "deltamesh_gateway_disk_full") == 1
                assert (await request_json(s, "GET", f"{relay}/v1/models"))["models"] == {}
                assert _leftovers(relay_store) == []
                ballast.unlink()
                listing: dict = {}
                for _ in range(300):  # retried with backoff: 1 s, then 2 s, ...
                    with contextlib.suppress(HttpError):  # 404 until its manifest is in
                        listing = await request_json(s, "GET", f"{relay}/v1/models/{MODEL}/versions")
                    if listing and listing["versions"][0]["complete"]:
                        break
                    await asyncio.sleep(0.05)
                assert listing and listing["versions"][0]["complete"], listing
                assert (await request_json(s, "GET", f"{relay}/healthz"))["disk"]["full"] is False

    asyncio.run(main())


def test_leftovers_of_interrupted_writes_are_removed_at_start(kit, tmp_path):
    m, raw, pieces = kit.version(MODEL, 0, "full", pieces=2)
    store = tmp_path / "store"

    async def main():
        async with kit.running_gateway(kit.config(tmp_path, store=str(store))) as url, client_session() as s:
            await upload_version(s, url, m, raw, pieces)

    asyncio.run(main())
    kind_dir = store / "models" / MODEL / "0" / "full"
    (kind_dir / "pieces" / ".1.123.456.tmp").write_bytes(b"half a piece")
    (kind_dir / ".manifest.json.123.456.tmp").write_bytes(b"{")
    os.makedirs(store / "models" / MODEL / "1" / "delta" / "pieces")  # a manifest that never made it to disk
    asyncio.run(main())  # a restart: the leftovers go, the version stays
    assert _leftovers(store) == [] and not (store / "models" / MODEL / "1").exists()
    assert sorted(p.name for p in (kind_dir / "pieces").iterdir()) == ["0", "1"]
