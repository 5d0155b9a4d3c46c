"""The host copy that vLLM and SGLang pools apply versions to never writes into a decoded version.

Regression for benchmarks/swap.py's failure (issue 33): a pool's plan of a full snapshot and a delta
after it was swapped into vLLM's host copy whole (the copy adopted the snapshot's tensors and patched
them with the delta) before the directory write read the snapshot, so the write applied the delta on
top of already-patched tensors and every result hash failed (then the benchmark waited for a
directory that never moved). Real codec, real files.
"""

from __future__ import annotations

import torch

from deltamesh.delta import (
    apply_to_dir,
    decode_version,
    dir_manifest,
    encode_delta,
    encode_full,
    generate_key,
    load_manifest,
    read_weights,
    tensor_digest,
)
from deltamesh.mesh.engines.host_weights import HostWeights

KEY = generate_key()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16) for i in range(4)}


def _stepped(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + 0.02 * torch.randn(t.shape, generator=g) * t.float()).to(torch.bfloat16) for n, t in w.items()}


def _decoded(enc):
    return decode_version(load_manifest(enc.manifest_bytes, [KEY.public_key()]), enc.pieces)


def test_a_delta_after_an_adopted_full_snapshot_leaves_the_snapshot_as_decoded(tmp_path) -> None:
    v0, v1 = _weights(0), _weights(1)
    v2 = _stepped(v1, 2)
    full = _decoded(encode_full(v1, model_id="m", version=1, key=KEY))
    delta = _decoded(encode_delta(v1, v2, model_id="m", version=2, base_version=1, key=KEY))
    host = HostWeights({n: t.clone() for n, t in v0.items()}, None)

    result, _ = host.apply(full, 0, diff=False)
    host.commit(result, full.manifest.weights_hash, adopted=True)
    result, changed = host.apply(delta, 1)
    host.commit(result, delta.manifest.weights_hash)

    assert changed and all(torch.equal(host.weights[n], v2[n]) for n in v2)
    # The snapshot is still what it decoded to: the directory write of the same plan succeeds.
    for i, t in full.whole.items():
        assert tensor_digest(t) == full.manifest.tensors[i].hash
    apply_to_dir(tmp_path / "pool", [full, delta])
    assert dir_manifest(tmp_path / "pool").version == 2
    written = read_weights(tmp_path / "pool")
    assert all(torch.equal(written[n], v2[n]) for n in v2)


def test_a_failed_delta_after_an_adopted_snapshot_restores_the_copy(tmp_path) -> None:
    v1 = _weights(1)
    v2 = _stepped(v1, 2)
    full = _decoded(encode_full(v1, model_id="m", version=1, key=KEY))
    delta = _decoded(encode_delta(_weights(7), v2, model_id="m", version=2, base_version=1, key=KEY))  # wrong base
    host = HostWeights(_weights(0), None)
    result, _ = host.apply(full, 0, diff=False)
    host.commit(result, full.manifest.weights_hash, adopted=True)
    try:
        host.apply(delta, 1)
    except Exception:  # noqa: BLE001 - the base check refuses it; what matters is what is left
        pass
    else:
        raise AssertionError("a delta for other base weights was applied")
    assert all(torch.equal(host.weights[n], v1[n]) for n in v1)
    assert all(tensor_digest(t) == full.manifest.tensors[i].hash for i, t in full.whole.items())
