"""Versions built in parts: trainer ranks each encode, stage and describe the rows they hold, rank 0 signs one
manifest, and the origin announces the version only whole. A real `deltamesh gateway` process, ranks as
threads of this process (each with its own event loop and connections, their exchange in memory), and a
pool's weight sync checking every version bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deltamesh.delta import read_weights
from deltamesh.delta.encode import table_of
from deltamesh.delta.parts import encode_part
from deltamesh.http import HttpError, client_session, request_bytes
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.distributed import shard_rows
from deltamesh.trainer.exchange import LocalBoard, LocalExchange
from deltamesh.trainer.shard_publisher import PartsError, ShardPublisher
from deltamesh.trainer.upload import stage_pieces

MODEL = "tiny"


def publishers(url: str, key, world: int, board: LocalBoard | None = None, **kw) -> list[ShardPublisher]:
    board = board or LocalBoard()
    return [ShardPublisher(url, MODEL, LocalExchange(board, r, world), key=key if r == 0 else None,
                           piece_bytes=4096, **kw) for r in range(world)]


def rows_of(weights, world: int, rank: int) -> dict[str, tuple[int, int]]:
    return {s.name: shard_rows(s.rows, world, rank) for s in table_of(weights) if s.shape}


def run_ranks(pubs: list[ShardPublisher], weights, version: int, ranks: list[int] | None = None) -> list:
    """Every rank (or those of `ranks`) publishes its rows of `weights` as `version`, each in its own thread."""
    table = table_of(weights)

    def one(rank: int):
        rows = rows_of(weights, len(pubs), rank)
        held = {n: t[slice(*rows[n])] if n in rows else t for n, t in weights.items()}
        try:
            return asyncio.run(pubs[rank].publish(table, held, rows, version))
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            return e

    ranks = list(range(len(pubs))) if ranks is None else ranks
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def pool_config(kit, tmp_path, url: str) -> PoolSyncConfig:
    return PoolSyncConfig(gateways=[url], token="region-token-1", name="p", dir=str(tmp_path / "pool"),
                          trusted_keys=[str(kit.key.public)], model=MODEL, give_up_s=10.0)


def listing(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/models/{MODEL}/versions", timeout=10) as r:
        return json.loads(r.read())


def test_ranks_publish_their_own_parts_and_a_pool_takes_each_version(spawn_gateway, kit, tmp_path):
    gw = spawn_gateway("origin")
    board = LocalBoard()
    pubs = publishers(gw.url, kit.key.key, 3, board, full_every=2)
    versions = [kit.tiny_weights()]
    for v in (1, 2):
        versions.append(kit.next_step(versions[-1], v))

    async def pool_takes(v: int) -> None:
        async with WeightSync(pool_config(kit, tmp_path, gw.url)) as sync:
            assert await sync.sync_once(wait_s=5) is True and sync.version == v
        assert kit.same_bits(read_weights(tmp_path / "pool"), versions[v])

    kinds = []
    for v, weights in enumerate(versions):
        results = run_ranks(pubs, weights, v)
        assert not any(isinstance(r, Exception) for r in results), results
        assert all(r.bytes_sent > 0 for r in results)  # every rank uploaded its own pieces
        kinds.append([m.kind for m in results[0].manifests])
        asyncio.run(pool_takes(v))
    assert kinds == [["full"], ["delta"], ["delta", "full"]]
    entries = {(e["version"], e["kind"]): e for e in listing(gw.url)["versions"]}
    assert all(e["complete"] for e in entries.values()) and (2, "full") in entries
    assert entries[(2, "full")]["weights_hash"] == entries[(2, "delta")]["weights_hash"]
    assert len(board) <= 2 * (3 + 1)  # the exchange keeps the last publish's keys (a delta and a full) only
    for pub in pubs:
        asyncio.run(pub.aclose())


def test_a_rank_that_dies_mid_upload_leaves_no_half_version(spawn_gateway, kit, tmp_path):
    gw = spawn_gateway("origin")
    pubs = publishers(gw.url, kit.key.key, 3, part_timeout_s=2.0)
    v0 = kit.tiny_weights()
    v1 = kit.next_step(v0, 1)
    assert not any(isinstance(r, Exception) for r in run_ranks(pubs, v0, 0))

    # Rank 1 stages half its pieces of v1 and dies before it describes its part.
    table, rows = table_of(v1), rows_of(v1, 3, 1)
    held = {n: t[slice(*rows[n])] if n in rows else t for n, t in v1.items()}
    base = {n: t[slice(*rows[n])] if n in rows else t for n, t in v0.items()}
    part = encode_part(table, held, base=base, rows=rows, piece_bytes=4096)
    half = part.pieces[: max(1, len(part.pieces) // 2)]

    async def die_half_way():
        async with client_session(timeout_s=10) as s:
            await stage_pieces(s, gw.url, MODEL, [p.data for p in half], [p.digest for p in half])

    asyncio.run(die_half_way())
    results = run_ranks(pubs, v1, 1, ranks=[0, 2])
    assert isinstance(results[0], PartsError) and "rank 1" in str(results[0])
    assert isinstance(results[1], PartsError)  # rank 2 learns it from rank 0's outcome
    assert [(e["version"], e["kind"]) for e in listing(gw.url)["versions"]] == [(0, "full")]

    async def pool_sees_nothing_new():
        async with WeightSync(pool_config(kit, tmp_path, gw.url)) as sync:
            assert await sync.sync_once() is True and sync.version == 0
            assert await sync.sync_once(wait_s=1) is False

    asyncio.run(pool_sees_nothing_new())
    # The job restarts its ranks (a fresh exchange, no bases): v1 goes as a full snapshot, announced whole.
    results = run_ranks(publishers(gw.url, kit.key.key, 3), v1, 1)
    assert not any(isinstance(r, Exception) for r in results), results
    assert [m.kind for m in results[0].manifests] == ["full"]
    assert listing(gw.url)["head"] == 1


def test_a_manifest_whose_pieces_are_not_all_staged_is_refused_whole(spawn_gateway, kit, tmp_path):
    gw = spawn_gateway("origin")
    relay = spawn_gateway("relay", upstreams=[gw.url])
    v0 = kit.tiny_weights()
    table = table_of(v0)
    part = encode_part(table, v0, piece_bytes=4096)
    from deltamesh.delta.assemble import assemble
    from deltamesh.delta.encode import manifest_of_parts

    manifest = manifest_of_parts(assemble(table, [part.describe()]), model_id=MODEL, version=0, base_version=None,
                                 base_hash=None, files={})
    envelope = manifest.signed(kit.key.key)
    pieces = [p.data for p in part.pieces]
    digests = [p.digest for p in part.pieces]

    async def main():
        async with client_session(timeout_s=10) as s:
            manifest_url = f"{gw.url}/v1/models/{MODEL}/versions/0/full/manifest?staged=1"
            await stage_pieces(s, gw.url, MODEL, pieces[1:], digests[1:])
            with pytest.raises(HttpError) as refused:
                await request_bytes(s, "PUT", manifest_url, data=envelope)
            assert refused.value.status == 409 and "not staged" in str(refused.value)
            with pytest.raises(HttpError) as forged:  # bytes that are not the digest they are staged under
                await stage_pieces(s, gw.url, MODEL, [pieces[1]], [digests[0]])
            assert forged.value.status == 400
            with pytest.raises(HttpError) as on_relay:
                await stage_pieces(s, relay.url, MODEL, pieces[:1], digests[:1])
            assert on_relay.value.status == 405
            with pytest.raises(urllib.error.HTTPError):  # nothing of the model is announced
                urllib.request.urlopen(f"{gw.url}/v1/models/{MODEL}/versions", timeout=10)
            await stage_pieces(s, gw.url, MODEL, pieces[:1], digests[:1])
            await request_bytes(s, "PUT", manifest_url, data=envelope)

    asyncio.run(main())
    assert [(e["version"], e["complete"]) for e in listing(gw.url)["versions"]] == [(0, True)]


def test_a_pool_rank_receives_only_the_pieces_of_its_share(kit, tmp_path):
    """Versions cut for a pool of 2 expert-parallel ranks (a publisher told the layout): rank 0 asks a real
    gateway for only the pieces whose signed spans reach its experts and the dense layers, receives
    those bytes and nothing else, and its slices are bit-exact after applying them."""
    from deltamesh.delta.layouts import PoolLayout, shares_of
    from deltamesh.delta.share_plan import pieces_for
    from deltamesh.delta.shares import apply_share, decode_pieces
    from deltamesh.gateway.fetch.fetcher import Fetcher
    from deltamesh.gateway.fetch.plan_steps import fetch_share
    from deltamesh.gateway.fetch.sources import Source
    from deltamesh.gateway.plan import PlanStep
    from deltamesh.trainer.publisher import Publisher

    g = torch.Generator().manual_seed(5)
    v0 = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16)
          for i in range(2) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    v0["model.embed_tokens.weight"] = torch.randn(50, 32, generator=g).to(torch.bfloat16)
    v1 = kit.next_step(v0, 1)
    layout = PoolLayout(ep=2)
    shares = shares_of(table_of(v0), layout, 0)
    received: dict[tuple, int] = {}

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            async with Publisher(url, kit.key.key, MODEL, piece_bytes=2048, layouts=[layout]) as pub:
                await pub.publish(v0, 0)
                published = await pub.publish(v1, 1)
            async with client_session(timeout_s=30) as s:
                fetcher = Fetcher(s, [Source(url)], "pool/rank0",
                                  on_received=lambda src, key, n: received.__setitem__(key, received.get(key, 0) + n))
                step = PlanStep(1, "delta", 0, published.manifests[0].payload_bytes, len(published.manifests[0].pieces))
                base_manifest, _ = await fetch_share(fetcher, MODEL, PlanStep(0, "full", None, 0, 0),
                                                     [kit.key.key.public_key()], 4, shares)
                manifest, pieces = await fetch_share(fetcher, MODEL, step, [kit.key.key.public_key()], 4, shares)
        return base_manifest, manifest, pieces

    base_manifest, manifest, pieces = asyncio.run(main())
    wanted = pieces_for(manifest, shares)
    assert sorted(pieces) == wanted and 0 < len(wanted) < len(manifest.pieces)
    assert received[(MODEL, 1, "delta")] == sum(manifest.pieces[i].length for i in wanted) < manifest.payload_bytes
    local = {n: s.take(v0[n]).clone() for n, s in shares.items()}
    apply_share(manifest, decode_pieces(manifest, pieces), local, shares, held=base_manifest)
    assert all(kit.same_bits({n: local[n]}, {n: s.take(v1[n])}) for n, s in shares.items())
    assert manifest.format_version == 4


def test_staging_past_its_limit_is_refused_with_507_and_keeps_nothing(spawn_gateway, kit):
    part = encode_part(table_of(kit.tiny_weights()), kit.tiny_weights(), piece_bytes=4096)
    big = sorted(part.pieces, key=lambda p: -len(p.data))[:2]
    room = len(big[0].data) + len(big[1].data) // 2  # for the first piece, not for both
    gw = spawn_gateway("origin", extra=["--staging-max-gib", str(room / 2**30)])

    async def main():
        async with client_session(timeout_s=10) as s:
            await stage_pieces(s, gw.url, MODEL, [big[0].data], [big[0].digest])
            with pytest.raises(HttpError) as full:
                await stage_pieces(s, gw.url, MODEL, [big[1].data], [big[1].digest])
            assert full.value.status == 507 and "limit" in str(full.value)

    asyncio.run(main())
    staged = list((gw.store / "staging" / MODEL).iterdir())
    assert [p.name for p in staged] == [big[0].digest]
