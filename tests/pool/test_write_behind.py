"""The synced directory written behind the engine (mesh/pool/dir_writer.py), with a real gateway in
this process and a real tiny transformers engine: the next version comes in while a write is held,
writes land in order, a failed write is redone."""

from __future__ import annotations

import asyncio

import deltamesh_pool_test_weights_kit as wk  # a helper module of this folder, loaded by its conftest.py
import torch

from deltamesh.delta import dir_manifest, read_weights


def test_the_next_version_goes_in_while_a_full_snapshot_it_adopted_is_still_being_written(kit):
    """An engine updated in place serves v1 while its directory write waits (held at a gate); v1 is a
    full snapshot whose tensors the engine's host copy adopted, so v2, applied in place meanwhile, must
    copy what it changes rather than write into the tensors v1's write still holds: v2 goes into the
    engine at once, v1's write lands bit-exact on v1, then v2's on v2, in order."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    landed: dict[int, dict[str, torch.Tensor]] = {}

    async def main():
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url) as (engine, w):
            gate, written = wk.gate_writes(w)
            persist = w.sync.persist

            async def read_back(versions):
                done = await persist(versions)
                landed[versions[-1].version] = read_weights(w.dir)
                return done

            w.sync.persist = read_back
            try:
                assert await w.sync_round() and engine.version == 1
                assert dir_manifest(w.dir) is None and w.writer.writing and w.writer.held == 1
                await pub.publish(v2)
                assert await asyncio.wait_for(w.sync_round(), 60)
                assert engine.version == 2 and wk.same(engine, v2) and written == []
                assert "persisted" not in w.timeline.get(1)
            finally:
                gate.set()  # else leaving the pool would wait for the writes for ever
            await w.writer.flush()
            assert written == [[1], [2]] and dir_manifest(w.dir).version == 2 and w.sync.version == 2
            for version, weights in ((1, v1), (2, v2)):
                on_disk = landed[version]
                assert all(torch.equal(on_disk[n].view(torch.int16), t.view(torch.int16))
                           for n, t in weights.items()), f"v{version}'s write is not v{version}"
            assert "persisted" in w.timeline.get(1) and "persisted" in w.timeline.get(2)

    asyncio.run(main())


def test_a_delta_goes_into_the_engine_while_the_one_before_is_still_being_written(kit):
    """A delta's write owns no tensors: the next delta is fetched, decoded and swapped into the engine
    while it is held at a gate, and the writes still land in order, the directory bit-exact."""
    v1 = kit.next_version(kit.base_weights(), 1)
    v2 = kit.next_version(v1, 2)
    v3 = kit.next_version(v2, 3)

    async def main():
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url) as (engine, w):
            assert await w.sync_round() and engine.version == 1
            await w.writer.flush()
            gate, written = wk.gate_writes(w)
            try:
                await pub.publish(v2)
                assert await w.sync_round() and engine.version == 2 and w.writer.writing
                await pub.publish(v3)
                assert await asyncio.wait_for(w.sync_round(), 60) and engine.version == 3 and wk.same(engine, v3)
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
        async with wk.gateway(kit, v1) as (url, pub), wk.pool_weights(kit, url) as (engine, w):
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
            assert w.status.swaps == {"in_place": 2, "reload": 0} and wk.same(engine, v2)

    asyncio.run(main())
