"""Encoding the part of a version that one process holds: some rows of some tensors, against its own base.

A trainer rank holds rows [start, stop) of each tensor (its FSDP2 shard along dim 0; a single
process holds every tensor whole). `encode_part` compares what it holds of the new version with what
it held of the base, cuts the changes (or, for a full snapshot or a tensor new in shape, the words)
into pieces whose segments name whole-tensor element ranges, and hashes its rows tile by tile. It
never needs another process's rows: the pieces are independently decodable, and the `Part` it returns
describes them in a few bytes per piece and tile (`Part.describe`, JSON), which is all that another
process (rank 0) needs to assemble the version's manifest (assemble.py).

`Cuts` say where pool ranks' shares of a tensor end (the version's pool layouts: layouts.py): its row
bands are cut there and tiled by the column bounds too, no segment crosses a cut, and each row band's
`key` (who needs it) picks the pieces it may share: bands needed by the same pool ranks pack together,
others never do, so a pool rank fetches only what covers its share. Without cuts a process's rows of
a tensor are one band of one tile, hashed in the same pass that finds the changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
import xxhash

from .bitdiff import scan_changes
from .cuts import NO_CUTS, Cuts, TensorSpec
from .device_scan import on_device, scan_on_device
from .dtypes import dtype_name, is_float, np_words
from .errors import CodecError
from .grid import tile_digests
from .hashing import digest
from .parallel import thread_stream
from .piece_writer import BuiltPiece, DeltaPieceCutter, TensorChanges, full_pieces
from .smallwords import MagnitudeSample, sample_stride
from .tensors import cpu_tensor

SCAN_AHEAD_BYTES = 256 << 20  # tensor bytes scanned ahead of cutting their changes into pieces ...
SCAN_AHEAD_LARGEST = 3  # ... or this many times the largest tensor, so it never stalls the other cores


@dataclass(frozen=True)
class HeldTiles:
    """What a part holds of one tensor: rows [bands[0], bands[-1]) cut into row bands, the column bounds
    of its grid (empty: not cut), and the digest of each tile (row-major), of the new version and, when
    asked for, of the base."""

    index: int
    bands: tuple[int, ...]
    cols: tuple[int, ...]
    tiles: tuple[str, ...]
    base_tiles: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Part:
    """One process's part of an encoded version: its pieces and the tiles of the rows it holds."""

    held: tuple[HeldTiles, ...]
    pieces: list[BuiltPiece] = field(repr=False)
    cut: bool = False
    """Encoded for pool layouts (some tensor had cuts): its pieces are fetched by their spans."""

    def describe(self) -> dict:
        """The part without its pieces' bytes: what rank 0 needs to assemble the manifest (JSON)."""
        described = {
            "held": [[h.index, list(h.bands), list(h.cols), list(h.tiles)] for h in self.held],
            "pieces": [[len(p.data), p.digest, list(p.tensors), [list(s) for s in p.spans]] for p in self.pieces],
        }
        if self.held and all(h.base_tiles is not None for h in self.held):
            described["base"] = {str(h.index): list(h.base_tiles) for h in self.held}
        if self.cut:
            described["cut"] = True
        return described


def encode_part(table: Sequence[TensorSpec], new: Mapping[str, torch.Tensor], *,
                base: Mapping[str, torch.Tensor] | None = None, rows: Mapping[str, tuple[int, int]] | None = None,
                cuts: Mapping[str, Cuts] | None = None, piece_bytes: int, hash_base: bool = False,
                known: Mapping[str, tuple[str, ...]] | None = None, device_passes: bool = False) -> Part:
    """Encode what this process holds of the version whose tensors are `table` (sorted by name).

    `new`: name -> the rows held (dim 0 [start, stop) as `rows` says; a tensor without an entry in
    `rows` is held whole). `base`: the same rows of the base version (None: a full snapshot; a tensor
    missing from it, or of another shape or dtype, is sent whole). `cuts`: the pool layouts' cuts by
    tensor name. `hash_base`: also hash the base's tiles (to name the base when its hash is not known).
    `known`: tiles of the new rows already hashed (a full snapshot after a delta to the same weights).
    Rows held off the CPU are compared with their base on their device (device_scan.py);
    `device_passes` takes that torch path for CPU tensors too, with the same output.
    """
    cuts, known = cuts or {}, known or {}
    holdings = []
    for index, spec in enumerate(table):
        if spec.name not in new:
            continue
        start, stop = (rows or {}).get(spec.name, (0, spec.rows))
        if stop > start:
            holdings.append(_Holding(index, spec, start, stop, cuts.get(spec.name, NO_CUTS)))
    held_names = {table[h.index].name for h in holdings}
    if set(new) - held_names - {n for n, t in new.items() if t.numel() == 0}:
        raise CodecError(f"tensors not in the version's table: {sorted(set(new) - held_names)[:4]}")
    sizes = [new[h.spec.name].numel() * new[h.spec.name].element_size() for h in holdings]
    ahead = max(SCAN_AHEAD_BYTES, SCAN_AHEAD_LARGEST * max(sizes, default=0))
    scans = thread_stream(
        lambda h: _scan(h, new[h.spec.name], None if base is None else base.get(h.spec.name),
                        hash_base, known.get(h.spec.name), device_passes),
        holdings, ahead, weight=lambda h: new[h.spec.name].numel() * new[h.spec.name].element_size())
    cutters: dict[str, DeltaPieceCutter] = {}
    whole: dict[str, list[tuple[int, int, int, np.ndarray]]] = {}  # key -> (index, first, end, words held)
    held = []
    for h, scan in zip(holdings, scans):
        held.append(scan.tiles)
        element0 = h.start * h.spec.row_elements
        for lo, hi in zip(h.bands, h.bands[1:]):
            key = h.cuts.key(lo)
            first, end = lo * h.spec.row_elements, hi * h.spec.row_elements
            if scan.changes is not None:
                a, b = np.searchsorted(scan.changes.positions, [first, end])
                if b > a:
                    cutters.setdefault(key, DeltaPieceCutter(piece_bytes)).add(scan.changes, int(a), int(b))
            elif scan.full:
                whole.setdefault(key, []).append((h.index, first - element0, end - element0, scan.words))
    pieces = [p for cutter in cutters.values() for p in cutter.finish()]
    for ranges in whole.values():
        pieces += _whole_pieces(ranges, piece_bytes, {h.index: h.start * h.spec.row_elements for h in holdings})
    return Part(tuple(held), pieces, cut=bool(cuts))


@dataclass(frozen=True)
class _Holding:
    index: int
    spec: TensorSpec
    start: int
    stop: int
    cuts: Cuts

    @property
    def bands(self) -> list[int]:
        return [self.start, *(c for c in self.cuts.rows if self.start < c < self.stop), self.stop]

    @property
    def cols(self) -> tuple[int, ...]:
        if not self.cuts.cols or len(self.spec.shape) < 2:
            return ()
        return (0, *self.cuts.cols, self.spec.shape[1])


@dataclass(frozen=True)
class _Scan:
    tiles: HeldTiles
    words: np.ndarray | None
    """The new words held, kept for a tensor written whole."""
    full: bool
    changes: TensorChanges | None = None


def _scan(h: _Holding, t: torch.Tensor, base: torch.Tensor | None, hash_base: bool,
          known: tuple[str, ...] | None, device_passes: bool) -> _Scan:
    """Compare the rows held of one tensor with its base, hashing them tile by tile."""
    spec = h.spec
    expected = (h.stop - h.start, *spec.shape[1:]) if spec.shape else ()
    if tuple(t.shape) != expected or dtype_name(t) != spec.dtype:
        raise CodecError(f"tensor {spec.name}: holds {dtype_name(t)}{list(t.shape)}, its rows [{h.start}, "
                         f"{h.stop}) of {spec.dtype}{list(spec.shape)} are {spec.dtype}{list(expected)}")
    bands, cols = h.bands, h.cols
    one_tile = len(bands) == 2 and not cols
    if base is not None and (base.dtype != t.dtype or tuple(base.shape) != tuple(t.shape)):
        base = None
    if base is not None and (device_passes or on_device(base, t)):
        return _scan_on_device(h, t, base, hash_base, known, one_tile)
    t = cpu_tensor(t)
    words = np_words(t)
    if base is None:
        tiles = known or _tiles(words, t.shape, h, one_tile)
        base_tiles = None
        return _Scan(HeldTiles(h.index, tuple(bands), cols, tuple(tiles), base_tiles), words, full=True)
    base_words = np_words(cpu_tensor(base))
    # Hashing rides along with the scan while each chunk is in cache (the base only if needed).
    ride = one_tile and known is None
    hash_new = xxhash.xxh3_128() if ride else None
    hash_old = xxhash.xxh3_128() if hash_base and one_tile else None
    floating = is_float(spec.dtype)
    # The base's magnitude sample (for coding changes of small words) is taken in the same pass.
    sample = MagnitudeSample(words.itemsize, sample_stride(words.size)) if floating else None
    positions, old_words, new_words = scan_changes(base_words, words, hash_old, hash_new,
                                                   sample.add if sample is not None else None)
    changes = None
    if positions.size:
        changes = TensorChanges.of(h.index, base_words, positions, old_words, new_words, floating, sample,
                                   offset=h.start * spec.row_elements, small_words=not cols)
    tiles = known or ((hash_new.hexdigest(),) if hash_new is not None else _tiles(words, t.shape, h, one_tile))
    base_tiles = None
    if hash_base:
        base_tiles = (hash_old.hexdigest(),) if hash_old is not None else tuple(_tiles(base_words, t.shape, h, False))
    return _Scan(HeldTiles(h.index, tuple(bands), cols, tuple(tiles), base_tiles), words, False, changes)


def _scan_on_device(h: _Holding, t: torch.Tensor, base: torch.Tensor, hash_base: bool,
                    known: tuple[str, ...] | None, one_tile: bool) -> _Scan:
    """`_scan` with the dense passes on the tensor's own device: a single tile's digests are streamed
    to the host while the device scans; a grid of tiles is hashed from a host copy of the rows."""
    scan = scan_on_device(h.index, base, t, hash_new=one_tile and known is None, hash_base=hash_base and one_tile,
                          offset=h.start * h.spec.row_elements, small_words=not h.cols)
    tiles = known or ((scan.digest,) if scan.digest is not None else
                      tuple(_tiles(np_words(cpu_tensor(t)), t.shape, h, False)))
    base_tiles = None
    if hash_base:
        base_tiles = ((scan.base_digest,) if scan.base_digest is not None else
                      tuple(_tiles(np_words(cpu_tensor(base)), t.shape, h, False)))
    return _Scan(HeldTiles(h.index, tuple(h.bands), h.cols, tuple(tiles), base_tiles), None, False, scan.changes)


def _tiles(words: np.ndarray, shape: Sequence[int], h: _Holding, one_tile: bool) -> list[str]:
    if one_tile or not shape:
        return [digest(words)]
    return tile_digests(words, shape, h.bands, h.cols, row_offset=h.start)


def _whole_pieces(ranges: list[tuple[int, int, int, np.ndarray]], piece_bytes: int,
                  offsets: Mapping[int, int]) -> list[BuiltPiece]:
    """Full pieces of the given (tensor index, first, end, words held) ranges of one key."""
    words: dict[int, np.ndarray] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    for index, first, end, held in ranges:
        words.setdefault(index, held)
        spans.setdefault(index, []).append((first, end))
    order = list(words)
    return full_pieces(words, order, piece_bytes, [spans[i] for i in order], [offsets[i] for i in order])
