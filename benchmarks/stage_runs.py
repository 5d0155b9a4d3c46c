"""One timed pass of every stage a version goes through, on one pair of weight versions, for
benchmarks/stage_speeds.py.

The stages, each over the whole model and timed alone (what runs before a stage, untimed, gives it
its input): `cast` (fp32 master weights to their bf16 copy, as a trainer publishing does), `scan`
(the codec's dense pass alone: comparing old and new words, finding the changed ones, hashing the
new ones), `encode` (the whole delta, the base's hash known as a publisher knows it; it includes the
scan), `sign` (the manifest signed), `hash` (xxh3 of every tensor), `decode` (the signed manifest
checked and loaded, every piece checked against it and decoded), `apply_first` and `apply` (the
decoded version applied in place with every result hash checked: the first version a pool applies to
its weights, and every later one, which reads its changes' positions off the small-word index the
first one built), and `check` (the after-swap check: the weights read back and hashed). The cores a
stage may use are the caller's to set (stage_speeds.py's `cores`). Pieces are cut at 512 KiB rather
than the publisher's 4 MiB, so that a model of 1 GB has as many pieces (a few) as a big model's rank
has of 4 MiB and decoding, which runs a piece per thread, can use more than one core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import xxhash
from inputs import Case

from deltamesh.delta import (
    Encoded,
    SmallWordIndex,
    apply_version,
    decode_version,
    encode_delta,
    generate_key,
    live_hash,
    load_manifest,
    tensor_digests,
    weights_hash,
)
from deltamesh.delta.bitdiff import scan_changes, to_key
from deltamesh.delta.dtypes import np_words
from deltamesh.delta.keys import Ed25519PrivateKey
from deltamesh.delta.parallel import thread_map
from deltamesh.mesh.demo.models import to_bf16

PIECE_BYTES = 512 << 10
STAGES = ("cast", "scan", "encode", "sign", "hash", "decode", "apply_first", "apply", "check")


@dataclass
class Prepared:
    """What the stages of one case take as input, made once: the base's hash, a key, and both the
    delta old -> new and its reverse (a pool's second version, applied with a warm index)."""

    case: Case
    key: Ed25519PrivateKey
    base_hash: str
    new_hash: str
    forward: Encoded
    backward: Encoded
    delta_bytes: int
    manifest_entries: int
    manifest_bytes: int


def prepare(case: Case) -> Prepared:
    key = generate_key()
    base_hash, new_hash = weights_hash(case.old), weights_hash(case.new)
    forward = encode_delta(case.old, case.new, model_id="m", version=1, base_version=0, key=key, base_hash=base_hash,
                           piece_bytes=PIECE_BYTES)
    backward = encode_delta(case.new, case.old, model_id="m", version=2, base_version=1, key=key, base_hash=new_hash,
                            piece_bytes=PIECE_BYTES)
    m = forward.manifest
    return Prepared(case, key, base_hash, new_hash, forward, backward, sum(len(p) for p in forward.pieces),
                    len(m.tensors) + len(m.pieces), len(forward.manifest_bytes))


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _scan(case: Case) -> list:
    def one(name: str) -> int:
        return scan_changes(np_words(case.old[name]), np_words(case.new[name]), None, xxhash.xxh3_128())[0].size

    return thread_map(one, list(case.new))


def run_once(p: Prepared) -> dict[str, float]:
    """Seconds each stage took, once; raises if any result is not what the codec promises."""
    case, public = p.case, p.key.public_key()
    out: dict[str, float] = {}
    if case.master:
        out["cast"], cast = _timed(lambda: to_bf16(case.master))
        del cast
    out["scan"], _ = _timed(lambda: _scan(case))
    out["encode"], encoded = _timed(lambda: encode_delta(
        case.old, case.new, model_id="m", version=1, base_version=0, key=None, base_hash=p.base_hash,
        piece_bytes=PIECE_BYTES))
    out["sign"], signed = _timed(lambda version=encoded: version.signed(p.key))
    del encoded, signed
    out["hash"], _ = _timed(lambda: tensor_digests(case.new))
    out["decode"], forward = _timed(lambda: decode_version(load_manifest(p.forward.manifest_bytes, [public]),
                                                           p.forward.pieces))
    backward = decode_version(load_manifest(p.backward.manifest_bytes, [public]), p.backward.pieces)
    weights = {name: t.clone() for name, t in case.old.items()}
    index = SmallWordIndex()
    out["apply_first"], _ = _timed(lambda: apply_version(forward, weights, base_hash=p.base_hash, in_place=True,
                                                         small_index=index))
    if index.weights_hash != p.new_hash:
        raise RuntimeError("the first apply did not leave its small-word index at the new version")
    out["apply"], _ = _timed(lambda: apply_version(backward, weights, base_hash=p.new_hash, in_place=True,
                                                   small_index=index))
    out["check"], held = _timed(lambda: live_hash(weights, p.backward.manifest))
    if held != p.base_hash:
        raise RuntimeError("the weights after applying a delta and its reverse are not the base")
    return out


def change_statistics(case: Case) -> dict[str, float]:
    """How the case's words changed: the fraction that did, the share of those that moved by one ulp,
    and the median magnitude of changed words over that of all words (the small weights' share)."""
    changed = one_ulp = 0
    magnitudes, everything = [], []
    for name, new in case.new.items():
        old = case.old[name]
        moved = old.view(torch.int16) != new.view(torch.int16)
        changed += int(moved.sum())
        floating = old.is_floating_point()
        keys = [to_key(np_words(t).reshape(-1)[moved.reshape(-1).numpy()], floating).astype(np.int64)
                for t in (old, new)]
        one_ulp += int((np.abs(keys[1] - keys[0]) == 1).sum())
        magnitudes.append(old.float()[moved].abs())
        everything.append(old.float().reshape(-1)[:: max(1, old.numel() // 100_000)].abs())
    numel = sum(t.numel() for t in case.new.values())
    median_changed = float(torch.cat(magnitudes).median()) if changed else 0.0
    return {"changed_fraction": changed / numel, "one_ulp_share": one_ulp / max(changed, 1),
            "changed_magnitude_over_all": median_changed / max(float(torch.cat(everything).median()), 1e-30)}
