"""A policy's weight stream against a real gateway (in-process, real loopback socket) and a real tiny
transformers engine: in-place hot swap, the synced directory, restarts and the reload fallbacks."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import dir_manifest, live_tensors, read_weights
from deltamesh.delta import decode as decode_module
from deltamesh.delta import decoded as decoded_module
from deltamesh.gateway.config import PoolSyncConfig
from deltamesh.gateway.publisher import Publisher
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.http import client_session, request_json
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.timeline import VersionTimeline
from deltamesh.mesh.pool.weights import PolicyWeights


def _engine(kit) -> TransformersEngine:
    return TransformersEngine(TransformersEngineConfig(model_id=kit.model, model_dir=str(kit.model_dir)))


def _sync_config(kit, gateway: str, name: str = "p") -> PoolSyncConfig:
    return PoolSyncConfig(gateways=[gateway], token=kit.token, name=name, dir=str(kit.tmp / "weights" / name),
                          trusted_keys=[str(kit.public_key)], model=kit.model, heartbeat_s=0.3, poll_wait_s=1,
                          stall_timeout_s=3, give_up_s=20)


def _same(engine: TransformersEngine, weights: dict[str, torch.Tensor]) -> bool:
    live = live_tensors(engine.model)
    return all(torch.equal(live[n].view(torch.int16), w.view(torch.int16)) for n, w in weights.items())


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _gateway(kit, first: dict[str, torch.Tensor] | None, piece_bytes: int = 16384):
    """A gateway in this process with `first` published as v1 (a full): `async with ... as (url, pub)`."""
    async with kit.running_gateway(kit.gateway_config()) as url:
        pub = Publisher(url, kit.private_key, kit.model, full_every=0, piece_bytes=piece_bytes)
        if first is not None:
            await pub.publish(first, 1)
        yield url, pub


@contextlib.asynccontextmanager
async def _pool_weights(kit, url: str, *, hot_swap: bool = True, running: bool = False):
    """A pool's weights on a fresh engine, subscribed to the gateway at `url`: `async with ... as
    (engine, weights)`. With `running` they run their own loop; otherwise the test drives `sync_round`."""
    engine = _engine(kit)
    try:
        weights = PolicyWeights(engine, _sync_config(kit, url), hot_swap=hot_swap)
        async with (_Running(weights) if running else weights) as w:
            yield engine, w
    finally:
        await engine.close()


def _change_behind_the_pools_back(engine: TransformersEngine, v1: dict[str, torch.Tensor],
                                  v2: dict[str, torch.Tensor]) -> None:
    """Move one live word of a tensor that the v1 -> v2 delta changes, so the delta's base no longer
    matches the live weights."""
    name = next(n for n, t in v2.items() if not torch.equal(t.view(torch.int16), v1[n].view(torch.int16)))
    with torch.no_grad():
        live_tensors(engine.model)[name].view(-1)[0] += 1.0


class _Running:
    """`PolicyWeights.run` as a task, stopped and awaited on exit."""

    def __init__(self, weights: PolicyWeights):
        self.weights = weights
        self.stop = asyncio.Event()

    async def __aenter__(self) -> PolicyWeights:
        self.task = asyncio.create_task(self.weights.run(self.stop))
        return self.weights

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_hot_swap_in_place_then_restart_resumes_from_the_directory(kit):
    v0 = kit.base_weights()
    v1 = kit.next_version(v0, 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with _gateway(kit, v1) as (url, pub):
            async with _pool_weights(kit, url, running=True) as (engine, w):
                await _until(lambda: w.ready, 30, "the first sync")
                # The engine started from other weights (v0 of the model directory): the full snapshot
                # went in place, before the directory was written.
                assert engine.version == 1 and w.version == 1 and _same(engine, v1)
                assert w.status.fetched == {"full": 1, "delta": 0} and w.status.swaps == {"in_place": 1, "reload": 0}
                await pub.publish(v2)
                await _until(lambda: engine.version == 2 and w.sync.version == 2, 30, "v2")
                assert _same(engine, v2) and w.status.swaps == {"in_place": 2, "reload": 0}
                assert w.status.fetched == {"full": 1, "delta": 1}
                assert dir_manifest(w.dir).version == 2

            # A restarted pool: a fresh engine from the model directory, the same synced directory.
            async with _pool_weights(kit, url, running=True) as (engine, w):
                await _until(lambda: w.ready, 30, "the restart")
                assert w.status.resumed_from_dir == 2 and engine.version == 2 and _same(engine, v2)
                assert w.status.fetched == {"full": 0, "delta": 0}, "nothing is downloaded again"
                await pub.publish(v3)
                await _until(lambda: engine.version == 3, 30, "v3")
                assert w.status.fetched == {"full": 0, "delta": 1} and w.status.swaps == {"in_place": 1, "reload": 1}
                assert _same(engine, v3)

    asyncio.run(main())


def test_a_failed_in_place_update_falls_back_to_the_directory(kit):
    """Live weights that are not the delta's base (here: one word changed behind the pool's back) make the
    in-place update fail its hash check; the engine is restored, then loads the version from disk."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url, running=True) as (engine, w):
            await _until(lambda: w.ready, 30, "the first sync")
            _change_behind_the_pools_back(engine, v1, v2)
            await pub.publish(v2)
            await _until(lambda: engine.version == 2, 30, "v2")
            assert _same(engine, v2)
            assert w.status.swaps == {"in_place": 1, "reload": 1}
            assert "in-place update to v2 failed" in w.status.last_error

    asyncio.run(main())


def test_without_hot_swap_every_version_is_reloaded_from_disk(kit):
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with _gateway(kit, None) as (url, pub), \
                _pool_weights(kit, url, hot_swap=False, running=True) as (engine, w):
            await asyncio.sleep(0.5)
            assert not w.ready and w.version is None, "nothing published: not ready to generate"
            await pub.publish(v1, 1)
            await _until(lambda: w.ready, 30, "v1")
            await pub.publish(v2)
            await _until(lambda: engine.version == 2, 30, "v2")
            assert _same(engine, v2) and read_weights(w.dir).keys() == v2.keys()
            assert w.status.swaps == {"in_place": 0, "reload": 2}

    asyncio.run(main())


def test_each_piece_is_decoded_once_per_round_for_engine_and_directory(kit, monkeypatch):
    """A chain of two multi-piece deltas goes into the live engine and the directory, and every piece is
    decoded exactly once for both (counted at the decoder, which every decode goes through)."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with _gateway(kit, v1, piece_bytes=512) as (url, pub), _pool_weights(kit, url) as (engine, w):
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
            assert engine.version == 3 and _same(engine, v3)
            assert w.status.swaps == {"in_place": 3, "reload": 0} and w.status.fetched == {"full": 1, "delta": 2}
            await w.writer.flush()  # the directory is written behind the engine
            on_disk = read_weights(w.dir)
            assert dir_manifest(w.dir).version == 3 and on_disk.keys() == v3.keys()
            assert all(torch.equal(on_disk[n].view(torch.int16), t.view(torch.int16)) for n, t in v3.items())

    asyncio.run(main())


def _gate_writes(w) -> tuple[asyncio.Event, list[list[int]]]:
    """Hold the pool's directory writes until the returned gate is set; the list records each write's
    versions as it goes through."""
    gate, written = asyncio.Event(), []
    persist = w.sync.persist

    async def gated(versions):
        await gate.wait()
        written.append([v.version for v in versions])
        return await persist(versions)

    w.sync.persist = gated
    return gate, written


def test_the_next_version_is_fetched_while_the_directory_is_still_being_written(kit):
    """An engine updated in place serves v1 while its directory write waits (held at a gate), and the
    next round fetches and decodes v2 meanwhile; v1 is a full snapshot, whose tensors an engine may
    have adopted (a host copy does), so v2 goes into the engine once that write is done; the writes
    land in order, and the directory ends bit-exact on v2."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url) as (engine, w):
            gate, written = _gate_writes(w)
            try:
                assert await w.sync_round() and engine.version == 1
                assert dir_manifest(w.dir) is None and w.writer.writing and w.writer.held == 1
                await pub.publish(v2)
                second = asyncio.create_task(w.sync_round())
                await _until(lambda: "verified" in w.timeline.get(2), 30, "v2 fetched and decoded")
                assert engine.version == 1 and written == [], "v2 came in while v1's write waited"
                assert "persisted" not in w.timeline.get(1)
            finally:
                gate.set()  # else leaving the pool would wait for the writes for ever
            assert await second is True and engine.version == 2 and _same(engine, v2)
            await w.writer.flush()
            assert written == [[1], [2]] and dir_manifest(w.dir).version == 2 and w.sync.version == 2
            on_disk = read_weights(w.dir)
            assert all(torch.equal(on_disk[n].view(torch.int16), t.view(torch.int16)) for n, t in v2.items())
            assert "persisted" in w.timeline.get(1) and "persisted" in w.timeline.get(2)

    asyncio.run(main())


def test_a_delta_goes_into_the_engine_while_the_one_before_is_still_being_written(kit):
    """A delta's write owns no tensors: the next delta is fetched, decoded and swapped into the engine
    while it is held at a gate, and the writes still land in order, the directory bit-exact."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url) as (engine, w):
            assert await w.sync_round() and engine.version == 1
            await w.writer.flush()
            gate, written = _gate_writes(w)
            try:
                await pub.publish(v2)
                assert await w.sync_round() and engine.version == 2 and w.writer.writing
                await pub.publish(v3)
                assert await asyncio.wait_for(w.sync_round(), 60) and engine.version == 3 and _same(engine, v3)
                assert written == [] and w.writer.held == 3, "v3 went in while v2's write waited"
            finally:
                gate.set()
            await w.writer.flush()
            assert written == [[2], [3]] and dir_manifest(w.dir).version == 3
            on_disk = read_weights(w.dir)
            assert all(torch.equal(on_disk[n].view(torch.int16), t.view(torch.int16)) for n, t in v3.items())

    asyncio.run(main())


def test_a_failed_write_behind_is_written_again_by_the_next_round(kit):
    """The directory write of v2 fails (a full disk) after the engine served v2: the pool keeps serving
    v2, says why, and its next round brings the directory from v1 to v2 without swapping v2 in again."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url) as (engine, w):
            assert await w.sync_round()
            await w.writer.flush()
            persist, failures = w.sync.persist, []

            async def full_once(versions):
                if not failures:
                    failures.append(versions[-1].version)
                    raise OSError(28, "No space left on device")
                return await persist(versions)

            w.sync.persist = full_once
            await pub.publish(v2)
            assert await w.sync_round() is True and engine.version == 2
            await w.writer.flush()
            assert failures == [2] and dir_manifest(w.dir).version == 1 and w.writer.held == 1
            assert "writing v2" in w.status.last_error and "No space left" in w.status.last_error
            assert w.version == 2 and not w.status.drifted, "the engine keeps serving what it proved"
            assert await w.sync_round() is True
            await w.writer.flush()
            assert dir_manifest(w.dir).version == 2 and w.writer.held == 2
            assert w.status.swaps == {"in_place": 2, "reload": 0} and _same(engine, v2)

    asyncio.run(main())


def test_a_failed_engine_update_leaves_it_bit_identical_and_the_directory_brings_the_version(kit):
    """The in-place update fails its result hashes (a live word changed behind the pool's back): the engine
    is exactly as it was when the round reloads it from the freshly written directory, and ends on v2."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url) as (engine, w):
            assert await w.sync_round() and engine.version == 1
            _change_behind_the_pools_back(engine, v1, v2)
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
            assert engine.version == 2 and w.version == 2 and _same(engine, v2)
            assert w.status.swaps == {"in_place": 1, "reload": 1}
            assert "in-place update to v2 failed" in w.status.last_error

    asyncio.run(main())


def test_a_failed_reload_is_retried_by_the_next_round(kit):
    """No hot swap, and reloading from the directory fails twice: the round still persists the version;
    the next round retries first and, failing again, polls the head only briefly; the one after that
    brings the engine there."""
    v1 = kit.next_version(kit.base_weights(), 1)

    async def main():
        async with _gateway(kit, v1) as (url, pub), _pool_weights(kit, url, hot_swap=False) as (engine, w):
            load_version = engine.load_version
            calls = []

            async def flaky(path, version):
                calls.append(version)
                if len(calls) <= 2:
                    raise OSError("disk hiccup")
                await load_version(path, version)

            engine.load_version = flaky
            assert await w.sync_round() is True
            assert w.sync.version == 1 and w.version is None and not _same(engine, v1)
            assert "loading v1" in w.status.last_error and "disk hiccup" in w.status.last_error
            started = time.monotonic()
            assert await w.sync_round(wait_s=30) is False
            assert time.monotonic() - started < 10, "the poll is cut short while the engine is behind"
            assert calls == [1, 1] and w.version is None
            assert await w.sync_round() is False
            assert calls == [1, 1, 1] and w.version == 1 and _same(engine, v1)
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
        async with _gateway(kit, v1) as (url, pub):
            engine = _engine(kit)
            try:
                async with PolicyWeights(engine, _sync_config(kit, url), hot_swap=hot_swap, metrics=metrics) as w:
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
