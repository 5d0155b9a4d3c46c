"""The codec: bit-diff deltas and full snapshots of model weights, their signed container, and apply.

Imports no other deltamesh component and touches no network. The byte layouts are specified in
docs/FORMAT.md. All code that applies a version lives here, to weights in memory, to a safetensors
directory, or to a live engine's tensors on any device, through one applier with rollback. Typical use:

    enc = encode_delta(old, new, model_id="m", version=7, base_version=6, key=private_key)
    manifest = load_manifest(enc.manifest_bytes, trusted_keys)      # receiver: verify signature
    weights = apply(old, manifest, enc.pieces)                       # or Applier (pieces one by one)
    decoded = decode_version(manifest, enc.pieces)                   # a pool decodes once, then
    swap_in_place(live_tensors(model), decoded, base_hash=h)         # ... its engine and
    apply_to_dir(path, [decoded])                                    # ... its synced directory

The names below load their module on first use (PEP 562), so that `import deltamesh.delta.manifest`
or `from deltamesh.delta import load_manifest` loads no torch: a gateway imports the manifest,
hashing, key and piece layers, and a gateway host has no torch (tests/delta/test_torch_free.py).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each module of this package -> the public names it defines.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "applier": ("Applier", "apply", "apply_version"),
    "decoded_version": ("DecodedVersion", "VersionDecoder", "decode_version"),
    "directory": ("HeldWeights", "apply_to_dir", "dir_manifest"),
    "dtypes": ("word_view",),
    "encode": ("PIECE_BYTES", "Encoded", "encode_delta", "encode_full"),
    "errors": ("BaseMismatchError", "CodecError", "CorruptError", "KeyFileError", "SignatureError"),
    "hashing": ("digest", "piece_digest"),
    "keys": ("generate_key", "key_id", "load_private_key", "load_public_key", "save_keypair"),
    "live": ("SwapStats", "copy_in", "live_hash", "live_tensors", "swap_in_place"),
    "manifest": ("FileEntry", "Manifest", "PieceEntry", "TensorEntry", "load_manifest", "load_manifest_unverified"),
    "side_files": ("read_side_files",),
    "slices": ("Grid", "Span"),
    "small_index": ("SmallWordIndex",),
    "statement": ("HeadStatement", "StaleStatementError", "check_fresh", "load_statement", "sign_statement"),
    "storage": ("read_weights", "write_weights"),
    "tensor_updates": ("TensorUpdate", "decode_piece"),
    "tensors": ("tensor_digest", "tensor_digests", "weights_hash"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
