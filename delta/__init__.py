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
"""

from .apply import Applier, apply, apply_version
from .decode import TensorUpdate, decode_piece
from .decoded import DecodedVersion, VersionDecoder, decode_version
from .directory import apply_to_dir, dir_manifest
from .dtypes import word_view
from .encode import PIECE_BYTES, Encoded, encode_delta, encode_full
from .errors import BaseMismatchError, CodecError, CorruptError, SignatureError
from .hashing import digest, tensor_digest
from .keys import generate_key, key_id, load_private_key, load_public_key, save_keypair
from .live import SwapStats, copy_in, live_hash, live_tensors, swap_in_place
from .manifest import Manifest, PieceEntry, TensorEntry, load_manifest, load_manifest_unverified
from .statement import HeadStatement, StaleStatementError, check_fresh, load_statement, sign_statement
from .storage import read_weights, write_weights
from .tensors import weights_hash

__all__ = [
    "Applier",
    "BaseMismatchError",
    "CodecError",
    "CorruptError",
    "DecodedVersion",
    "Encoded",
    "HeadStatement",
    "Manifest",
    "PIECE_BYTES",
    "PieceEntry",
    "SignatureError",
    "StaleStatementError",
    "SwapStats",
    "TensorEntry",
    "TensorUpdate",
    "VersionDecoder",
    "apply",
    "apply_to_dir",
    "apply_version",
    "check_fresh",
    "copy_in",
    "decode_piece",
    "decode_version",
    "digest",
    "dir_manifest",
    "encode_delta",
    "encode_full",
    "generate_key",
    "key_id",
    "live_hash",
    "live_tensors",
    "load_manifest",
    "load_manifest_unverified",
    "load_private_key",
    "load_public_key",
    "load_statement",
    "read_weights",
    "save_keypair",
    "sign_statement",
    "swap_in_place",
    "tensor_digest",
    "weights_hash",
    "word_view",
    "write_weights",
]
