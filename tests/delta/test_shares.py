"""A pool rank's share of a version: tensor- and expert-parallel ranks fetch only the pieces that reach
their slices, apply them in place and check them against the tiles of the signed manifest alone.

Real codec on small dense and mixture-of-experts checkpoints named as Hugging Face names them; the
layouts follow vLLM's sharding (delta/layouts.py; tests/engines/test_vllm_layouts.py checks the rules
against vLLM's own weight loaders).
"""

from __future__ import annotations

import pytest
import torch

from deltamesh.delta import CodecError, CorruptError, generate_key, load_manifest, tensor_digest
from deltamesh.delta.assemble import assemble
from deltamesh.delta.encode import encode_delta, encode_full, manifest_of_parts, table_of
from deltamesh.delta.layouts import PoolLayout, cuts_for, shares_of
from deltamesh.delta.parts import encode_part
from deltamesh.delta.share_plan import pieces_for
from deltamesh.delta.shares import apply_share, decode_pieces
from deltamesh.trainer.distributed import shard_rows

KEY = generate_key()
H, INTER, V, HEADS, KV = 64, 128, 200, 8, 2


def dense(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": w(H), "lm_head.weight": w(V, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(KV * H // HEADS, H),
                    p + "self_attn.v_proj.weight": w(KV * H // HEADS, H), p + "self_attn.o_proj.weight": w(H, H),
                    p + "mlp.gate_proj.weight": w(INTER, H), p + "mlp.up_proj.weight": w(INTER, H),
                    p + "mlp.down_proj.weight": w(H, INTER), p + "input_layernorm.weight": w(H)})
    return out


def moe(seed: int, experts: int = 8, layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": w(H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(H, H),
                    p + "self_attn.v_proj.weight": w(H, H), p + "self_attn.o_proj.weight": w(H, H),
                    p + "mlp.gate.weight": w(experts, H), p + "input_layernorm.weight": w(H)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": w(INTER, H), q + "up_proj.weight": w(INTER, H), q + "down_proj.weight": w(H, INTER)})
    return out


def step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 2% of words move by one ulp, as an optimizer step moves them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in weights.items():
        words = t.view(torch.int16).clone()
        words[torch.rand(words.shape, generator=g) < 0.02] += 1
        out[n] = words.view(torch.bfloat16)
    return out


def signed(enc):
    return load_manifest(enc.manifest_bytes, [KEY.public_key()]), enc.pieces


def rank_takes(manifest, pieces, base_slices, shares, held):
    wanted = pieces_for(manifest, shares)
    local = {n: t.clone() for n, t in base_slices.items()}
    apply_share(manifest, decode_pieces(manifest, {i: pieces[i] for i in wanted}), local, shares, held=held)
    return local, sum(manifest.pieces[i].length for i in wanted)


@pytest.mark.parametrize("layout", [PoolLayout(tp=2, kv_heads=KV), PoolLayout(tp=4, kv_heads=KV)])
def test_tensor_parallel_ranks_take_their_slices_of_a_delta_and_a_full(layout):
    v0 = dense(0)
    v1 = step(v0, 1)
    table = table_of(v0)
    cuts = cuts_for(table, [layout])
    full, full_pieces = signed(encode_full(v0, model_id="m", version=0, key=KEY, cuts=cuts))
    delta, delta_pieces = signed(encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=KEY,
                                              base_hash=full.weights_hash, cuts=cuts))
    assert full.format_version == delta.format_version == 4
    fetched = []
    for rank in range(layout.ranks):
        shares = shares_of(table, layout, rank)
        empty = {n: torch.zeros(s.local_shape(v0[n].shape), dtype=torch.bfloat16) for n, s in shares.items()}
        local, _ = rank_takes(full, full_pieces, empty, shares, None)
        assert all(torch.equal(local[n], s.take(v0[n])) for n, s in shares.items())
        local, nbytes = rank_takes(delta, delta_pieces, local, shares, full)
        assert all(torch.equal(local[n], s.take(v1[n])) for n, s in shares.items()), rank
        fetched.append(nbytes / delta.payload_bytes)
    assert max(fetched) < 1.0  # row-parallel tensors are fetched whole, column-parallel ones by rank


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_fetch_their_experts_only(ep):
    v0 = moe(0)
    v1 = step(v0, 1)
    table = table_of(v0)
    layout = PoolLayout(ep=ep)
    full, full_pieces = signed(encode_full(v0, model_id="m", version=0, key=KEY, cuts=cuts_for(table, [layout])))
    delta, delta_pieces = signed(encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=KEY,
                                              base_hash=full.weights_hash, cuts=cuts_for(table, [layout])))
    for rank in range(ep):
        shares = shares_of(table, layout, rank)
        assert sum(".experts." in n for n in shares) == 2 * 3 * 8 // ep
        local, nbytes = rank_takes(delta, delta_pieces, {n: s.take(v0[n]).clone() for n, s in shares.items()},
                                   shares, full)
        assert all(torch.equal(local[n], v1[n]) for n in shares)
        # Its experts and the dense layers, in proportion to their words (changes are spread evenly here),
        # plus the fixed bytes of each piece (a few hundred: much of a delta this small).
        share = sum(v0[n].numel() for n in shares) / sum(t.numel() for t in v0.values())
        assert delta.format_version == 4 and nbytes / delta.payload_bytes <= share + 0.05, (rank, nbytes, share)


def test_two_trainer_ranks_and_two_pool_ranks_meet_in_one_version():
    """Trainer rows (FSDP shards) and pool shares cut the same tensors differently: the tiles and pieces
    follow both, and each pool rank checks its share alone."""
    v0 = dense(2)
    v1 = step(v0, 3)
    table = table_of(v0)
    layout = PoolLayout(tp=2, kv_heads=KV)
    cuts = cuts_for(table, [layout])
    descriptions, pieces = [], []
    for rank in range(3):
        rows = {s.name: shard_rows(s.rows, 3, rank) for s in table}
        part = encode_part(table, {n: t[slice(*rows[n])] for n, t in v1.items()},
                           base={n: t[slice(*rows[n])] for n, t in v0.items()}, rows=rows, cuts=cuts, piece_bytes=2048)
        descriptions.append(part.describe())
        pieces += [p.data for p in part.pieces]
    base = signed(encode_full(v0, model_id="m", version=0, key=KEY, cuts=cuts))[0]
    assembled = assemble(table, descriptions)
    manifest = load_manifest(manifest_of_parts(assembled, model_id="m", version=1, base_version=0,
                                               base_hash=base.weights_hash, files={}).signed(KEY), [KEY.public_key()])
    for rank in range(2):
        shares = shares_of(table, layout, rank)
        local, _ = rank_takes(manifest, pieces, {n: s.take(v0[n]).clone() for n, s in shares.items()}, shares, base)
        assert all(torch.equal(local[n], s.take(v1[n])) for n, s in shares.items())


def test_a_share_without_tiles_and_a_wrong_base_are_refused_with_the_slices_unchanged():
    v0 = dense(4)
    v1 = step(v0, 5)
    table = table_of(v0)
    plain, plain_pieces = signed(encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=KEY))
    base = signed(encode_full(v0, model_id="m", version=0, key=KEY))[0]
    shares = shares_of(table, PoolLayout(tp=2, kv_heads=KV), 0)
    before = {n: s.take(v0[n]).clone() for n, s in shares.items()}
    local = {n: t.clone() for n, t in before.items()}
    with pytest.raises(CodecError, match="no tiles|small-word rank"):
        apply_share(plain, decode_pieces(plain, dict(enumerate(plain_pieces))), local, shares, held=base)
    assert all(torch.equal(local[n], before[n]) for n in before)
    cuts = cuts_for(table, [PoolLayout(tp=2, kv_heads=KV)])
    other = signed(encode_full(dense(9), model_id="m", version=0, key=KEY, cuts=cuts))[0]
    delta, pieces = signed(encode_delta(v0, v1, model_id="m", version=1, base_version=0, key=KEY,
                                        base_hash=signed(encode_full(v0, model_id="m", version=0, key=KEY, cuts=cuts))[0].weights_hash,
                                        cuts=cuts))
    with pytest.raises(CodecError, match="applies to v0"):
        apply_share(delta, decode_pieces(delta, dict(enumerate(pieces))), local, shares, held=other)
    # Slices that are not the base the delta was made from: the tiles catch it and nothing stays written.
    wrong = {n: t.clone() for n, t in local.items()}
    first = next(iter(wrong))
    wrong[first].view(-1)[0] += 1
    snapshot = {n: t.clone() for n, t in wrong.items()}
    held = signed(encode_full(v0, model_id="m", version=0, key=KEY, cuts=cuts))[0]
    with pytest.raises(CorruptError, match="tiles"):
        apply_share(delta, decode_pieces(delta, dict(enumerate(pieces))), wrong, shares, held=held)
    assert all(torch.equal(wrong[n], snapshot[n]) for n in wrong)
    assert tensor_digest(wrong[first]) == tensor_digest(snapshot[first])
