"""The version the transfer scenarios move: a real deltamesh full snapshot of synthetic bf16 weights.

Seeded random weights (matrices near 0, as in a trained model) encoded by the codec's `encode_full`,
sized so that the encoded payload is about the asked size; the codec's byte-plane entropy coding
shrinks random bf16 ~1.4x, so the weights themselves are larger than the payload. Cached under
`~/.cache/deltamesh/transfer/` (deltamesh/cache.py) as a folder holding `manifest.json` (the unsigned manifest body; the publisher
signs it with the run's key and the run's version number, which pieces do not contain) and
`version.bin` (the pieces back to back, which is also the one file the plain-HTTP baselines serve).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch

from deltamesh.cache import cache_dir
from deltamesh.delta import Manifest, encode_full, generate_key
from deltamesh.delta.manifest import FORMAT_VERSION

log = logging.getLogger(__name__)

MODEL_ID = "transfer-bench"
ROWS, COLS = 1024, 4096  # one 8 MiB bf16 matrix per tensor
CACHE = cache_dir("transfer")
RECIPE = 1


def synthetic_weights(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i // 3}.mlp.{('gate', 'up', 'down')[i % 3]}_proj.weight":
            (0.02 * torch.randn(ROWS, COLS, generator=gen)).to(torch.bfloat16) for i in range(count)}


def tensors_for(payload_bytes: int) -> int:
    """How many 8 MiB tensors make a full snapshot of about `payload_bytes` (measured on one tensor)."""
    key = generate_key()
    one = encode_full(synthetic_weights(1, seed=1), model_id=MODEL_ID, version=0, key=key)
    return max(1, math.ceil(payload_bytes / one.manifest.payload_bytes))


def prepare_payload(payload_mb: float, cache: Path = CACHE) -> Path:
    """The folder of a ~`payload_mb` MB version (built once, then reused)."""
    # Named by the format too: a side-by-side run (swap_compare.py's shim) reads with an older codec.
    folder = cache / f"full-{payload_mb:g}mb-r{RECIPE}-f{FORMAT_VERSION}"
    if (folder / "version.bin").exists() and (folder / "manifest.json").exists():
        return folder
    count = tensors_for(int(payload_mb * 1e6))
    log.info("building a %g MB version from %d synthetic bf16 tensors", payload_mb, count)
    encoded = encode_full(synthetic_weights(count), model_id=MODEL_ID, version=0, key=generate_key())
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "manifest.json").write_bytes(encoded.manifest.body_bytes())
    with open(tmp / "version.bin", "wb") as f:
        for piece in encoded.pieces:
            f.write(piece)
    (tmp / "info.json").write_text(json.dumps({"tensors": count, "weights_bytes": count * ROWS * COLS * 2,
                                               "payload_bytes": encoded.manifest.payload_bytes}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def payload_manifest(folder: Path) -> Manifest:
    return Manifest.from_body((folder / "manifest.json").read_bytes())


def payload_info(folder: Path) -> dict:
    return json.loads((folder / "info.json").read_text())
