"""The codec: bit-diff deltas and full snapshots of model weights, their signed container, and apply.

Imports no other deltamesh component and touches no network. The byte layouts are specified in
docs/FORMAT.md. Typical use:

    enc = encode_delta(old, new, model_id="m", version=7, base_version=6, key=private_key)
    manifest = load_manifest(enc.manifest_bytes, trusted_keys)      # receiver: verify signature
    weights = apply(old, manifest, enc.pieces)                       # or Applier / apply_to_dir
"""

from .apply import Applier, apply
from .decode import TensorUpdate, decode_piece
from .directory import apply_to_dir, dir_manifest
from .dtypes import word_view
from .encode import PIECE_BYTES, Encoded, encode_delta, encode_full
from .errors import BaseMismatchError, CodecError, CorruptError, SignatureError
from .hashing import digest, tensor_digest
from .keys import generate_key, key_id, load_private_key, load_public_key, save_keypair
from .manifest import Manifest, PieceEntry, TensorEntry, load_manifest, load_manifest_unverified
from .storage import read_weights, write_weights
from .tensors import weights_hash

__all__ = [
    "Applier",
    "BaseMismatchError",
    "CodecError",
    "CorruptError",
    "Encoded",
    "Manifest",
    "PIECE_BYTES",
    "PieceEntry",
    "SignatureError",
    "TensorEntry",
    "TensorUpdate",
    "apply",
    "apply_to_dir",
    "decode_piece",
    "digest",
    "dir_manifest",
    "encode_delta",
    "encode_full",
    "generate_key",
    "key_id",
    "load_manifest",
    "load_manifest_unverified",
    "load_private_key",
    "load_public_key",
    "read_weights",
    "save_keypair",
    "tensor_digest",
    "weights_hash",
    "word_view",
    "write_weights",
]
