"""One pool rank's share of the weights (`RankShare`, what each vLLM worker of a tensor-parallel engine
keeps), without vLLM: read from a model directory by its slices, a version fetched through a real gateway
(in this process, on loopback) and applied, handed to an engine as full-shaped tensors, then settled or
put back; a model directory staged and checked against its manifest's tiles; what a rank proves of the
tensors it serves. The same rank code runs inside vLLM's workers in test_vllm_ranks.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from deltamesh.delta import (
    BaseMismatchError,
    CorruptError,
    apply_to_dir,
    generate_key,
    load_manifest,
    save_keypair,
    write_weights,
)
from deltamesh.delta.layouts import PoolLayout
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch.judge import FetchError
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway.server.app import create_app
from deltamesh.http import serving
from deltamesh.mesh.engines.vllm_rank_share import RankReport, RankShare, RankStep, error_kind
from deltamesh.mesh.engines.vllm_ranks import _combined, dealt_cores
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.trainer.publisher import Publisher

pytestmark = pytest.mark.slow  # a real gateway and decodes on every test: ~10 s in all

LAYOUT = PoolLayout(tp=2, kv_heads=2)
H, INTER, V, HEADS, KV = 64, 128, 200, 8, 2


def dense(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": w(H)}
    p = "model.layers.0."
    out.update({p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(KV * H // HEADS, H),
                p + "self_attn.v_proj.weight": w(KV * H // HEADS, H), p + "self_attn.o_proj.weight": w(H, H),
                p + "mlp.gate_proj.weight": w(INTER, H), p + "mlp.up_proj.weight": w(INTER, H),
                p + "mlp.down_proj.weight": w(H, INTER), p + "input_layernorm.weight": w(H)})
    return out


def same_shares(share: RankShare, weights: dict[str, torch.Tensor], slices=None) -> bool:
    slices = share.slices if slices is None else slices
    return all(torch.equal(slices[n], s.take(weights[n])) for n, s in share.shares.items())


def test_a_rank_takes_its_share_puts_it_back_and_proves_it(tmp_path, rl_step) -> None:
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    w0, start = dense(0), tmp_path / "start"
    w1 = rl_step(w0, 1, share=0.03)
    write_weights(start, w0)
    gateway = GatewayConfig(store=str(tmp_path / "store"), trusted_keys=[str(public)], anonymous=True, piece_wait_s=1.0)

    async def scenario():
        async with serving(create_app(gateway), "127.0.0.1:0") as url:
            published = []
            pub = Publisher(url, key, "m", full_every=0, piece_bytes=4096, layouts=[LAYOUT],
                            on_encoded=published.append)
            sync = WeightSyncSettings(gateways=[url], token="t", trusted_keys=[str(public)], stall_timeout_s=2.0,
                                      give_up_s=5.0)
            steps = []
            for version, w in enumerate((w0, w1)):
                await pub.publish(w, version)
                m = load_manifest(published[-1].manifest_bytes, [key.public_key()])
                steps.append((m, published[-1].pieces,
                              RankStep("m", PlanStep(version, m.kind, m.base_version, m.payload_bytes, len(m.pieces)),
                                       sync, "pool/p")))
            # The driver's message is plain JSON, whatever carries it to the worker.
            again = RankStep.from_body(json.loads(json.dumps(steps[1][2].body())))
            assert again == steps[1][2]
            ranks = [RankShare.read(start, LAYOUT, r) for r in range(LAYOUT.ranks)]
            for share in ranks:
                assert share.held is None and same_shares(share, w0)
                with pytest.raises(BaseMismatchError, match="nothing known"):  # a delta needs a known base
                    await asyncio.to_thread(share.prepare, steps[1][2])
                full = await asyncio.to_thread(share.prepare, steps[0][2])
                assert full.ok and full.version == 0 and 0 < full.fetched_bytes < full.payload_bytes
                share.settle()
                assert share.version == 0 and same_shares(share, w0)

                report = await asyncio.to_thread(share.prepare, steps[1][2])
                assert same_shares(share, w1) and report.changed == len(share.shares)
                with pytest.raises(Exception, match="prepared and not settled"):
                    await asyncio.to_thread(share.prepare, steps[1][2])
                loads = dict(share.loads(sorted(share.shares)))
                assert all(loads[n].shape == w1[n].shape and torch.equal(s.take(loads[n]), s.take(w1[n]))
                           for n, s in share.shares.items())
                assert share.revert() == []  # not handed to the engine: nothing to load again
                assert same_shares(share, w0) and share.version == 0
                await asyncio.to_thread(share.prepare, steps[1][2])
                share.loading()
                assert share.revert() == sorted(share.shares)  # the engine must take the old values again
                assert same_shares(share, w0)
                share.begin(lambda: share.prepare(steps[1][2]))  # as the worker runs it: beside the engine
                while (report := share.outcome()) is None:
                    await asyncio.sleep(0.01)
                assert report.ok and report.version == 1 and share.outcome() == report  # asked again: the same
                share.settle()
                assert share.version == 1 and same_shares(share, w1)
                frame = dict(share.loads(["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
                rows = share.slices["model.embed_tokens.weight"]  # a share of rows is handed without a copy
                assert rows.untyped_storage().data_ptr() == frame.untyped_storage().data_ptr()

            # What the ranks serve, by tiles: together they make up every tensor's signed hash.
            m1 = steps[1][0]
            names = [t.name for t in m1.tensors]
            answers = [share.proofs(share.slices, names) for share in ranks]
            grids = {t.name: t.grid for t in m1.tensors}
            assert {t.name: _combined(t.name, answers, grids[t.name]) for t in m1.tensors} == {t.name: t.hash
                                                                                             for t in m1.tensors}
            wrong = {**ranks[1].slices, "model.layers.0.mlp.up_proj.weight": ranks[0].slices["model.layers.0.mlp.up_proj.weight"]}
            answers[1] = ranks[1].proofs(wrong, names)
            assert _combined("model.layers.0.mlp.up_proj.weight", answers, grids["model.layers.0.mlp.up_proj.weight"]) \
                != m1.tensors[m1.tensor_index()["model.layers.0.mlp.up_proj.weight"]].hash
            assert _combined("model.norm.weight", [answers[0], {"model.norm.weight": {"whole": "0" * 32}}], None) \
                == "ranks disagree on model.norm.weight"
            unread = ranks[0].proofs({**ranks[0].slices, "model.norm.weight": None}, names)
            assert unread["model.norm.weight"] is None and _combined("model.norm.weight", [unread], None) is None

            # A model directory the pool applied v1 to: staged beside the host copy, checked by its tiles.
            synced = tmp_path / "synced"
            apply_to_dir(synced, [steps[0][:2], steps[1][:2]])
            share = ranks[0]
            with pytest.raises(BaseMismatchError, match="holds v1"):
                share.stage(synced, 0)
            staged = share.stage(synced, 1)
            assert staged.ok and staged.weights_hash == m1.weights_hash
            assert share.revert() == [] and share.version == 1
            share.stage(synced, 1)
            share.settle()
            assert share.held.weights_hash == m1.weights_hash and same_shares(share, w1)
            bad = tmp_path / "bad"
            apply_to_dir(bad, [steps[0][:2], steps[1][:2]])
            tampered = {**w1, "model.layers.0.mlp.gate_proj.weight": w0["model.layers.0.mlp.gate_proj.weight"]}
            write_weights(bad.resolve(), tampered)
            with pytest.raises(CorruptError, match="gate_proj"):
                share.stage(bad, 1)
            assert share.version == 1 and same_shares(share, w1)

            # No gateway serving it: the rank refuses, its copy as it was.
            gone = RankStep("m", steps[1][2].step, WeightSyncSettings(
                gateways=["http://127.0.0.1:9"], token="t", trusted_keys=[str(public)], stall_timeout_s=0.5,
                give_up_s=1.0), "pool/p")
            fresh = RankShare.read(start, LAYOUT, 1)
            with pytest.raises(FetchError) as refused:
                await asyncio.to_thread(fresh.prepare, gone)
            assert error_kind(refused.value) == "fetch" and same_shares(fresh, w0)

    asyncio.run(scenario())


def test_reports_name_the_error_class_and_cores_are_dealt_over_ranks() -> None:
    assert RankReport.failed(1, CorruptError("x")).kind == "corrupt"
    assert RankReport.failed(1, BaseMismatchError("x")).kind == "base"
    assert RankReport.failed(1, RuntimeError("x")).body()["kind"] == "error"
    assert dealt_cores(2, [0, 1]) == "0|1"
    assert dealt_cores(4, [0, 1]) == "0|1|0|1"
    assert dealt_cores(2, [3, 0, 1, 2, 4]) == "0,1|2,3"
