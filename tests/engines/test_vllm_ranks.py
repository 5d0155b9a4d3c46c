"""vLLM with 2 tensor-parallel ranks, each fetching, verifying and applying only its share of every version.

vLLM's CPU build starts once for this module with two worker processes (`VLLMRanksEngine`) on the tiny
Qwen3 model. A trainer publishes through a real gateway (in this process, on loopback) with the cuts of
the engine's layout: v0 a full snapshot, v1 and v2 deltas (3% of the words moved by one or two ulps, as an
optimizer step moves them). Each rank fetches its own pieces from the gateway with its own fetcher
(`take_step`), and after each version the engine's greedy logprobs equal those of the same engine
reloading that version from a model directory on disk (the pool's synced directory, written by the
directory applier from the whole version), while every rank fetched fewer bytes than the whole version.
A tampering relay that corrupts one piece only rank 1 needs makes rank 1 refuse the version: rank 0,
which took it into its host copy, puts it back and vLLM is never touched, so the logprobs served stay
bit-for-bit; the same version then goes through from the gateway itself, in the middle of a generation
whose tokens name the version each came from.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from deltamesh.delta import apply_to_dir, generate_key, load_manifest, read_weights, save_keypair
from deltamesh.delta.encode import table_of
from deltamesh.delta.layouts import shares_of
from deltamesh.delta.share_plan import pieces_for
from deltamesh.delta.side_files import read_side_files
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch.judge import FetchError
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway.server.app import create_app
from deltamesh.http import serving
from deltamesh.mesh.demo.models import VLLM_TINY, tiny_model_dir
from deltamesh.mesh.engines.base import EngineError, SamplingParams
from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig, VLLMRanksEngine
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("vllm_layout_check", Path(__file__).with_name("vllm_layout_check.py"))
layout_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_check)

MODEL = "tiny"
TP = 2
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ("The capital of France is", "1, 2, 3,", "def main():")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir(VLLM_TINY)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = VLLMRanksEngine(VLLMRanksConfig(model_id=MODEL, model_dir=str(model_dir), tensor_parallel_size=TP,
                                             kv_cache_bytes=64 << 20))
    yield engine
    asyncio.run(engine.close())


async def probe(engine: VLLMRanksEngine) -> list[tuple[list[int], list[float]]]:
    gens = await engine.generate([engine.encode(p) for p in PROMPTS], GREEDY)
    return [(g.tokens, g.logprobs) for g in gens]


async def tampering_relay(real: str, piece_path: str, seen: list[str]) -> tuple[web.AppRunner, str]:
    """A relay passing everything through from `real` (ranges too) except one piece, whose bytes it
    corrupts: a compromised relay, which ranks must never trust."""
    session = ClientSession()

    async def proxy(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("range", "authorization", "x-deltamesh-peer")}
        async with session.request(request.method, f"{real}{request.path_qs}", headers=headers,
                                   data=await request.read()) as r:
            body = bytearray(await r.read())
            status, kept = r.status, {k: v for k, v in r.headers.items() if k.lower() in ("content-range", "content-type")}
        if request.path.endswith(piece_path) and body:
            body[len(body) // 2] ^= 0x40
            seen.append(request.path)
        return web.Response(body=bytes(body), status=status, headers=kept)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    app.on_cleanup.append(lambda _app: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_two_ranks_hold_what_the_layout_says(engine, model_dir) -> None:
    hf = json.loads((model_dir / "config.json").read_text())
    checkpoint = read_weights(model_dir)
    compared, unreadable = layout_check.check_layout(engine, checkpoint, hf, TP)
    # every (rank, tensor) pair compared, but those the CPU build repacked (never the norms or embeddings)
    assert compared + unreadable >= TP * len(checkpoint) and compared >= TP * 3


def test_ranks_take_their_shares_through_a_gateway_as_disk_would(engine, model_dir, tmp_path, rl_step) -> None:
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    weights = {"v0": read_weights(model_dir)}
    for version in (1, 2, 3):
        weights[f"v{version}"] = rl_step(weights[f"v{version - 1}"], version, share=0.03)
    table = table_of(weights["v0"])
    gateway = GatewayConfig(store=str(tmp_path / "store"), trusted_keys=[str(public)], anonymous=True, piece_wait_s=1.0)
    synced = tmp_path / "synced"  # the pool's directory, moved version by version by the directory applier

    def sync(url: str) -> WeightSyncSettings:
        return WeightSyncSettings(gateways=[url], token="t", trusted_keys=[str(public)], connections=2,
                                  stall_timeout_s=2.0, give_up_s=20.0)

    async def scenario():
        async with serving(create_app(gateway), "127.0.0.1:0") as url:
            published = []
            pub = Publisher(url, key, MODEL, full_every=0, piece_bytes=16 << 10, side_files=read_side_files(model_dir),
                            layouts=[engine.layout], on_encoded=published.append)
            served = [await probe(engine)]

            async def publish(name: str, version: int):
                await pub.publish(weights[name], version)
                enc = published[-1]
                manifest = load_manifest(enc.manifest_bytes, [key.public_key()])
                step = PlanStep(version, manifest.kind, manifest.base_version, manifest.payload_bytes, len(enc.pieces))
                return manifest, enc.pieces, step

            for version, name in enumerate(("v0", "v1", "v2")):
                manifest, pieces, step = await publish(name, version)
                reports = await engine.take_step(step, sync(url), "pool/tp")
                assert engine.version == version and [r.rank for r in reports] == list(range(TP))
                assert all(0 < r.fetched_bytes < r.payload_bytes == manifest.payload_bytes for r in reports), reports
                in_place = await probe(engine)
                assert (in_place == served[-1]) == (name == "v0")  # v0: the weights vLLM started with
                grids = {t.name: t.grid for t in manifest.tensors if t.grid is not None}
                digests = (await engine.served_digests([t.name for t in manifest.tensors], grids)).digests
                readable = {n: d for n, d in digests.items() if d is not None}
                assert readable and all(readable[t.name] == t.hash for t in manifest.tensors if t.name in readable)
                await asyncio.to_thread(apply_to_dir, synced, [(manifest, pieces)])
                await engine.load_version(synced, version)
                assert await probe(engine) == in_place, f"v{version}: ranks' in-place update differs from disk"
                served.append(in_place)

            manifest, pieces, step = await publish("v3", 3)
            rank_pieces = [set(pieces_for(manifest, shares_of(table, engine.layout, r))) for r in range(TP)]
            only_rank1 = sorted(rank_pieces[1] - rank_pieces[0])
            assert only_rank1, "the cuts give rank 1 pieces of its own"
            seen: list[str] = []
            runner, relay = await tampering_relay(url, f"/pieces/{only_rank1[0]}", seen)
            try:
                with pytest.raises(FetchError, match="1 of 2 ranks refused"):
                    await engine.take_step(step, sync(relay), "pool/tp")
            finally:
                await runner.cleanup()
            assert seen and engine.version == 2
            assert await probe(engine) == served[-1]  # nothing reached vLLM, on either rank
            with pytest.raises(EngineError, match="rank by rank"):
                await engine.apply_update(None)
            # Rank 0 put its host copy back: the delta from v2 applies on both ranks from the gateway itself,
            # while a generation goes on: the ranks fetch and apply beside the engine's steps, and the new
            # weights land between two of them.
            long = SamplingParams(max_new_tokens=256, temperature=0, ignore_eos=True)
            task = asyncio.create_task(engine.generate([engine.encode("Once upon a time")], long))
            while not any(len(r.gen.tokens) >= 3 for r in engine._requests.values()):
                await asyncio.sleep(0.01)
            await engine.take_step(step, sync(url), "pool/tp")
            (gen,) = await task
            assert gen.versions[0] == 2 and gen.versions[-1] == 3 and gen.versions == sorted(gen.versions)
            in_place = await probe(engine)
            await asyncio.to_thread(apply_to_dir, synced, [(manifest, pieces)])
            await engine.load_version(synced, 3)
            assert await probe(engine) == in_place != served[-1]

    asyncio.run(scenario())
