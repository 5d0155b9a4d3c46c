"""A policy's weight stream against a real gateway (in-process, real loopback socket) and a real tiny
transformers engine: in-place hot swap, the synced directory, restarts and the reload fallbacks (the
directory written behind the engine: test_write_behind.py)."""

from __future__ import annotations

import asyncio
import time

import deltamesh_pool_test_weights_kit as wk  # a helper module of this folder, loaded by its conftest.py
import pytest
import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import decoded_version as decoded_module
from deltamesh.delta import dir_manifest, live_tensors, read_weights
from deltamesh.delta import tensor_updates as decode_module
from deltamesh.http import client_session, request_json
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.timeline import VersionTimeline
from deltamesh.mesh.pool.weights import PolicyWeights


def test_hot_swap_in_place_then_restart_resumes_from_the_directory(kit):
    v0 = kit.base_weights()
    v1 = kit.next_version(v0, 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with wk.gateway(kit, v1) as (url, pub):
            async with wk.pool_weights(kit, url, running=True) as (engine, w):
                await wk.until(lambda: w.ready, 30, "the first sync")
                # The engine started from other weights (v0 of the model directory): the full snapshot
                # went in place, before the directory was written.
                assert engine.version == 1 and w.version == 1 and wk.same(engine, v1)
                assert w.status.fetched == {"full": 1, "delta": 0} and w.status.swaps == {"in_place": 1, "reload": 0}
                await pub.publish(v2)
                await wk.until(lambda: engine.version == 2 and w.sync.version == 2, 30, "v2")
                assert wk.same(engine, v2) and w.status.swaps == {"in_place": 2, "reload": 0}
                assert w.status.fetched == {"full": 1, "delta": 1}
                assert dir_manifest(w.dir).version == 2

            # A restarted pool: a fresh engine from the model directory, the same synced directory.
            async with wk.pool_weights(kit, url, running=True) as (engine, w):
                await wk.until(lambda: w.ready, 30, "the restart")
                assert w.status.resumed_from_dir == 2 and engine.version == 2 and wk.same(engine, v2)
                assert w.status.fetched == {"full": 0, "delta": 0}, "nothing is downloaded again"
                await pub.publish(v3)
                await wk.until(lambda: engine.version == 3, 30, "v3")
                assert w.status.fetched == {"full": 0, "delta": 1} and w.status.swaps == {"in_place": 1, "reload": 1}
                assert wk.same(engine, v3)

    asyncio.run(main())


def test_a_failed_in_place_update_falls_back_to_the_directory(kit):
    """Live weights that are not the delta's base (here: one word changed behind the pool's back) make the
    in-place update fail its hash check; the engine is restored, then loads the version from disk."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url, running=True) as (engine, w):
            await wk.until(lambda: w.ready, 30, "the first sync")
            wk.change_behind_the_pools_back(engine, v1, v2)
            await pub.publish(v2)
            await wk.until(lambda: engine.version == 2, 30, "v2")
            assert wk.same(engine, v2)
            assert w.status.swaps == {"in_place": 1, "reload": 1}
            assert "in-place update to v2 failed" in w.status.last_error

    asyncio.run(main())


def test_without_hot_swap_every_version_is_reloaded_from_disk(kit):
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with wk.gateway(kit, None) as (url, pub), \
                wk.pool_weights(kit, url, hot_swap=False, running=True) as (engine, w):
            await asyncio.sleep(0.5)
            assert not w.ready and w.version is None, "nothing published: not ready to generate"
            await pub.publish(v1, 1)
            await wk.until(lambda: w.ready, 30, "v1")
            await pub.publish(v2)
            await wk.until(lambda: engine.version == 2, 30, "v2")
            assert wk.same(engine, v2) and read_weights(w.dir).keys() == v2.keys()
            assert w.status.swaps == {"in_place": 0, "reload": 2}

    asyncio.run(main())


def test_each_piece_is_decoded_once_per_round_for_engine_and_directory(kit, monkeypatch):
    """A chain of two multi-piece deltas goes into the live engine and the directory, and every piece is
    decoded exactly once for both (counted at the decoder, which every decode goes through)."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with wk.gateway(kit, v1, piece_bytes=512) as (url, pub), wk.pool_weights(kit, url) as (engine, w):
            assert await w.sync_round() and engine.version == 1
            published = [await pub.publish(v2), await pub.publish(v3)]
            pieces = sum(len(m.pieces) for r in published for m in r.manifests if m.kind == "delta")
            assert pieces >= 4
            decoded: list[tuple[int, int]] = []
            real = decode_module.decode_checked

            def counting(manifest, index, data):
                decoded.append((manifest.version, index))
                return real(manifest, index, data)

            monkeypatch.setattr(decode_module, "decode_checked", counting)
            monkeypatch.setattr(decoded_module, "decode_checked", counting)
            assert await w.sync_round() is True
            monkeypatch.undo()
            assert len(decoded) == pieces and len(set(decoded)) == pieces, "every piece decoded exactly once"
            assert engine.version == 3 and wk.same(engine, v3)
            assert w.status.swaps == {"in_place": 3, "reload": 0} and w.status.fetched == {"full": 1, "delta": 2}
            await w.writer.flush()  # the directory is written behind the engine
            on_disk = read_weights(w.dir)
            assert dir_manifest(w.dir).version == 3 and on_disk.keys() == v3.keys()
            assert all(torch.equal(on_disk[n].view(torch.int16), t.view(torch.int16)) for n, t in v3.items())

    asyncio.run(main())


def test_a_failed_engine_update_leaves_it_bit_identical_and_the_directory_brings_the_version(kit):
    """The in-place update fails its result hashes (a live word changed behind the pool's back): the engine
    is exactly as it was when the round reloads it from the freshly written directory, and ends on v2."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url) as (engine, w):
            assert await w.sync_round() and engine.version == 1
            wk.change_behind_the_pools_back(engine, v1, v2)
            before = {n: t.clone() for n, t in live_tensors(engine.model).items()}
            seen_at_reload: dict[str, torch.Tensor] = {}
            load_version = engine.load_version

            async def reload(path, version):
                assert dir_manifest(path).version == version == 2, "the directory is written first"
                seen_at_reload.update({n: t.clone() for n, t in live_tensors(engine.model).items()})
                await load_version(path, version)

            engine.load_version = reload
            await pub.publish(v2)
            assert await w.sync_round() is True
            assert seen_at_reload.keys() == before.keys()
            for n, t in before.items():
                assert torch.equal(seen_at_reload[n].view(torch.int16), t.view(torch.int16)), n
            assert engine.version == 2 and w.version == 2 and wk.same(engine, v2)
            assert w.status.swaps == {"in_place": 1, "reload": 1}
            assert "in-place update to v2 failed" in w.status.last_error

    asyncio.run(main())


def test_a_failed_reload_is_retried_by_the_next_round(kit):
    """No hot swap, and reloading from the directory fails twice: the round still persists the version;
    the next round retries first and, failing again, polls the head only briefly; the one after that
    brings the engine there."""
    v1 = kit.next_version(kit.base_weights(), 1)

    async def main():
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url, hot_swap=False) as (engine, w):
            load_version = engine.load_version
            calls = []

            async def flaky(path, version):
                calls.append(version)
                if len(calls) <= 2:
                    raise OSError("disk hiccup")
                await load_version(path, version)

            engine.load_version = flaky
            assert await w.sync_round() is True
            assert w.sync.version == 1 and w.version is None and not wk.same(engine, v1)
            assert "loading v1" in w.status.last_error and "disk hiccup" in w.status.last_error
            started = time.monotonic()
            assert await w.sync_round(wait_s=30) is False
            assert time.monotonic() - started < 10, "the poll is cut short while the engine is behind"
            assert calls == [1, 1] and w.version is None
            assert await w.sync_round() is False
            assert calls == [1, 1, 1] and w.version == 1 and wk.same(engine, v1)
            assert w.status.swaps == {"in_place": 0, "reload": 1}

    asyncio.run(main())


@pytest.mark.parametrize("hot_swap", [True, False], ids=["in_place", "reload"])
def test_each_synced_version_reports_its_stages_in_order(kit, hot_swap):
    """A round that brings a chain of two deltas notes, for each version, when it reached each stage on
    the pool's clock, in the order of the way in (an engine updated in place serves the version, checked,
    before the directory is written; one that loads from disk takes it after); the gateway's listing says when it held each version whole, before any pool
    had it; each stage's time feeds the pool's histogram."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)
    way = (("head", "fetched", "verified", "applied", "serving", "persisted") if hot_swap else
           ("head", "fetched", "verified", "persisted", "applied", "serving"))

    async def main():
        metrics = PoolMetrics(CollectorRegistry())
        async with wk.gateway(kit, v1) as (url, pub):
            engine = wk.tiny_engine(kit)
            try:
                async with PolicyWeights(engine, wk.sync_config(kit, url), hot_swap=hot_swap, metrics=metrics) as w:
                    assert await w.sync_round()
                    await w.writer.flush()  # an engine updated in place has its directory written behind it
                    assert w.timeline.get(1).keys() == set(way)
                    await pub.publish(v2)
                    await pub.publish(v3)
                    assert await w.sync_round() is True and engine.version == 3
                    await w.writer.flush()
                    async with client_session() as session:
                        listing = await request_json(session, "GET", f"{url}/v1/models/{kit.model}/versions")
            finally:
                await engine.close()
        stored = {e["version"]: e["stored_at"] for e in listing["versions"] if e["kind"] == "delta"}
        described = w.timeline.describe()
        assert list(described) == ["1", "2", "3"]
        for version in (2, 3):
            stages = described[str(version)]
            if not hot_swap and version == 2:
                # Loading from disk, the engine went straight to v3: v2 was never applied on its own.
                assert list(stages) == [s for s in way if s != "applied"]
            else:
                assert list(stages) == list(way), f"v{version}: {stages}"
            times = list(stages.values())
            assert times == sorted(times), f"v{version}: {stages}"
            assert stored[version] <= stages["fetched"], "the origin held the version before the pool did"
        assert described["2"]["fetched"] <= described["3"]["fetched"]
        counted = {sample.labels["stage"]: sample.value for family in metrics.registry.collect()
                   for sample in family.samples if sample.name == "deltamesh_pool_version_stage_seconds_count"}
        assert counted["serving"] == 3 and counted["fetched"] == 3

    asyncio.run(main())


def test_the_timeline_keeps_the_newest_versions():
    timeline = VersionTimeline(keep=3)
    for version in range(1, 6):
        timeline.mark(version, "fetched", at=100.0 + version)
    timeline.mark(5, "fetched", at=200.0)  # reached again: the later time
    assert timeline.describe() == {"3": {"fetched": 103.0}, "4": {"fetched": 104.0}, "5": {"fetched": 200.0}}
    assert timeline.get(1) == {}
    with pytest.raises(ValueError):
        timeline.mark(6, "downloaded")
