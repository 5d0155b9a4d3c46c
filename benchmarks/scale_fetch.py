"""The expert-parallel fetch of benchmarks/scale.py: how much of a delta one pool rank fetches.

A synthetic mixture of experts (scale_model.moe_shapes: 8 experts per layer) is published for pools
of 2 and of 4 expert-parallel ranks at once (`cuts_for` of both layouts: the trainer declares the
layouts its pools run), a full snapshot then a delta. Each rank of each layout picks the pieces whose
spans reach its shares (its experts, and the dense layers every rank holds), decodes them, applies
them to its slices and checks them against the signed manifest's tiles; the figure is the most any
rank of the layout fetched, over the delta's payload bytes.
"""

from __future__ import annotations

import scale_model
import torch

from deltamesh.delta import generate_key, load_manifest
from deltamesh.delta.encode import encode_delta, encode_full, table_of
from deltamesh.delta.layouts import PoolLayout, cuts_for, shares_of
from deltamesh.delta.share_plan import pieces_for
from deltamesh.delta.shares import apply_share, decode_pieces


def ep_fetch_fractions(ranks: tuple[int, ...] = (2, 4), *, quick: bool = False) -> dict[str, float]:
    shapes = scale_model.moe_shapes(layers=2, hidden=256, intermediate=512, vocab=2048) if quick else scale_model.moe_shapes()
    v0 = {name: scale_model.rows_block(name, shape, 0, shape[0]) for name, shape in shapes.items()}
    v1 = {name: scale_model.step_block(t, name, 0, 1) for name, t in v0.items()}
    table = table_of(v0)
    layouts = [PoolLayout(ep=n) for n in ranks]
    cuts = cuts_for(table, layouts)
    key = generate_key()
    full = encode_full(v0, model_id="moe", version=0, key=key, cuts=cuts)
    base = load_manifest(full.manifest_bytes, [key.public_key()])
    enc = encode_delta(v0, v1, model_id="moe", version=1, base_version=0, key=key, base_hash=base.weights_hash,
                       cuts=cuts)
    delta = load_manifest(enc.manifest_bytes, [key.public_key()])
    out = {}
    for layout in layouts:
        most = 0.0
        for rank in range(layout.ranks):
            shares = shares_of(table, layout, rank)
            wanted = pieces_for(delta, shares)
            local = {n: s.take(v0[n]).clone() for n, s in shares.items()}
            apply_share(delta, decode_pieces(delta, {i: enc.pieces[i] for i in wanted}), local, shares, held=base)
            if not all(torch.equal(local[n], s.take(v1[n])) for n, s in shares.items()):
                raise RuntimeError(f"ep{layout.ranks} rank {rank}: its slices are not the new version's")
            most = max(most, sum(delta.pieces[i].length for i in wanted) / delta.payload_bytes)
        out[str(layout.ranks)] = most
    return out
