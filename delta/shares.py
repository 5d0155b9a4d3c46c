"""A pool rank's share of a version: which pieces it fetches, and applying them to the slices it holds.

A rank of a tensor- or expert-parallel engine holds a share of each tensor (layouts.py: all of it, some
rows, some columns, or none). Of a version built with its layout's cuts (parts.py), it fetches only the
pieces whose spans (format 4) reach into its shares (`pieces_for`), decodes them, and
`apply_share` writes the changes that land in its slices in place, then checks each share against
the tiles of the signed manifest's hash grid that cover it, all before it returns: the rank moves to
the version bit-exact or its slices are restored, as a whole-model apply does (applier.py). Its base is
what it checked against the base version's tiles last time, which the delta's `base_hash` names (the
caller passes the manifest it holds). A share the version has no tiles for (a layout the trainer did
not publish for), or a change located by small-word rank in a segment the share holds only part of,
is refused with a clear error before anything is written.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from .dtypes import is_float, np_words
from .errors import BaseMismatchError, CodecError, CorruptError
from .grid import tile_digests
from .kernels import write_changes
from .manifest import Manifest, TensorEntry
from .parallel import thread_map
from .parts import TensorSpec
from .patch import Rollback
from .share_plan import Share
from .storage import weight_files
from .tensor_updates import TensorUpdate, decode_piece
from .tensors import tensor_digest


def read_shares(directory: str | Path, pick: Callable[[list[TensorSpec]], Mapping[str, Share]]
                ) -> tuple[list[TensorSpec], dict[str, Share], dict[str, torch.Tensor]]:
    """A rank's slices of the checkpoint in safetensors `directory`, reading only their bytes: `pick`
    is given the checkpoint's table (sorted by name) and names the shares; returns (table, shares,
    name -> contiguous CPU slice)."""
    root = Path(directory).resolve()
    where: dict[str, str] = {}
    table = []
    try:
        for file in weight_files(root):
            with safe_open(root / file, "pt") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    table.append(TensorSpec(name, part.get_dtype(), tuple(part.get_shape())))
                    where[name] = file
        table.sort(key=lambda spec: spec.name)
        shares = dict(pick(table))
        slices = {}
        for file in sorted(set(where[name] for name in shares)):
            with safe_open(root / file, "pt") as f:
                for name in (n for n in shares if where[n] == file):
                    share, part = shares[name], f.get_slice(name)
                    cut = slice(None) if share.dim is None else slice(share.start, share.stop)
                    slices[name] = (part[cut] if share.dim != 1 else part[:, cut]).contiguous()
    except (OSError, SafetensorError, RuntimeError) as e:  # safetensors reports open errors as RuntimeError
        raise CorruptError(f"{root}: {e}") from e
    return table, shares, slices


def decode_pieces(manifest: Manifest, pieces: Mapping[int, bytes]) -> dict[int, list[TensorUpdate]]:
    """Verify and decode the given pieces (index -> bytes), on all cores; updates by tensor index."""
    decoded = thread_map(lambda item: decode_piece(manifest, *item), list(pieces.items()))
    out: dict[int, list[TensorUpdate]] = {}
    for updates in decoded:
        for u in updates:
            out.setdefault(u.index, []).append(u)
    return out


def apply_share(manifest: Manifest, updates: Mapping[int, Sequence[TensorUpdate]], local: Mapping[str, torch.Tensor],
                shares: Mapping[str, Share], *, held: Manifest | None, rollback: Rollback | None = None) -> None:
    """Move the slices `local` (tensor name -> the CPU tensor of its share) to `manifest`'s version in
    place. `updates`: the decoded pieces (`decode_pieces`) of at least `pieces_for(manifest, shares)`.
    `held`: the verified manifest of the version the slices hold (a delta needs it: its weights hash is
    the delta's base). On any error every slice is restored and the error raised. `rollback`: a fresh
    one the caller keeps, holding every word written, so that it can put the slices back after a
    success too (a pool rank whose peers refused the version)."""
    if manifest.kind == "delta" and (held is None or held.weights_hash != manifest.base_hash):
        raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} applies to v{manifest.base_version}, "
                                f"the slices hold {'nothing known' if held is None else f'v{held.version}'}")
    index = manifest.tensor_index()
    missing = [name for name in shares if name not in index]
    if missing:
        raise CorruptError(f"{manifest.model_id} v{manifest.version} has no tensor {missing[0]!r}")
    rollback = Rollback() if rollback is None else rollback
    try:
        thread_map(lambda name: _apply_one(manifest.tensors[index[name]], shares[name], local[name],
                                           updates.get(index[name], ()), rollback, manifest.kind == "full"),
                   list(shares))
    except BaseException:
        rollback.restore()
        raise


def check_share(entry: TensorEntry, share: Share, t: torch.Tensor) -> bool:
    """Whether the slice `t` holds this share of the tensor as `entry` names it (by the tiles covering it)."""
    if share.dim is None:
        return tensor_digest(t, entry.grid) == entry.hash
    return all(entry.grid.tiles[i] == d for i, d in share_tiles(entry, share, t).items())


def share_tiles(entry: TensorEntry, share: Share, t: torch.Tensor) -> dict[int, str]:
    """The digests of the tiles of `entry`'s hash grid that the slice `t` (rows or columns `share` of the
    tensor) covers, by tile index: what one rank proves of a tensor it holds part of."""
    grid = entry.grid
    bounds = grid.rows if grid is not None and share.dim == 0 else grid.cols if grid is not None else ()
    if share.dim is None or share.start not in bounds or share.stop not in bounds:
        raise CodecError(f"tensor {entry.name}: the version has no tiles for {_describe(share)}; a pool of this "
                         "layout needs versions published for it (the trainer's pool layouts)")
    words = np_words(t)
    if share.dim == 0:
        bands = [b for b in grid.rows if share.start <= b <= share.stop]
        first, last = grid.rows.index(share.start), grid.rows.index(share.stop)
        digests = tile_digests(words, t.shape, bands, grid.cols, row_offset=share.start)
        return dict(zip(range(first * grid.col_bands, last * grid.col_bands), digests))
    c = grid.cols.index(share.start)
    if grid.cols[c + 1] != share.stop:
        raise CodecError(f"tensor {entry.name}: {_describe(share)} spans several tiles' columns")
    digests = tile_digests(words, t.shape, grid.rows, (share.start, share.stop), col_offset=share.start)
    return {grid.tile_index(r, c): d for r, d in enumerate(digests)}


def _apply_one(entry: TensorEntry, share: Share, t: torch.Tensor, updates: Iterable[TensorUpdate],
               rollback: Rollback, full: bool) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != share.local_shape(entry.shape):
        raise CodecError(f"tensor {entry.name}: its slice must be a contiguous CPU tensor of shape "
                         f"{share.local_shape(entry.shape)}, not {tuple(t.shape)} on {t.device}")
    words = np_words(t)
    floating = is_float(entry.dtype)
    covered = 0
    for u in updates:
        positions, values, literal, whole = _local(entry, share, u, words)
        covered += positions.size if whole else 0
        if positions.size == 0:
            continue
        if whole:
            rollback.keep(words, positions)
            words[positions] = values
            continue
        old, _ = write_changes(words, positions, values, literal, floating)
        rollback.keep(words, positions, old)
    if full and covered != words.size:
        raise CorruptError(f"tensor {entry.name}: a full snapshot's pieces write {covered} of the share's {words.size} words")
    if not check_share(entry, share, t):
        raise CorruptError(f"tensor {entry.name}: {_describe(share)} does not match the manifest's tiles")


def _local(entry: TensorEntry, share: Share, u: TensorUpdate, words: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
    """(positions in the slice, values, literal flags, whether they are whole words) of update `u`'s
    changes that land in the share."""
    row = entry.numel // entry.shape[0] if entry.shape and entry.shape[0] else 1
    lo, hi = (share.start * row, share.stop * row) if share.dim == 0 else (0, entry.numel)
    if u.start + u.count <= lo or hi <= u.start:
        return np.empty(0, np.int64), u.values[:0], None, u.is_full
    if u.is_full:
        flat = np.arange(u.start, u.start + u.count, dtype=np.int64)
        keep, local = _map(entry, share, flat, lo)
        return local, u.values[keep], None, True
    inside = lo <= u.start and u.start + u.count <= hi
    if u.small_ranks is not None:
        if share.dim == 1 or not inside:
            raise CodecError(f"tensor {entry.name}: a change located by small-word rank lies in a segment that "
                             f"{_describe(share)} holds only part of; publish versions for this pool layout")
        moved = replace(u, start=u.start - lo, positions=u.positions - lo)
        return moved.locate(words), u.values, u.literal, False
    keep, local = _map(entry, share, u.positions, lo)
    return local, u.values[keep], None if u.literal is None else u.literal[keep], False


def _map(entry: TensorEntry, share: Share, flat: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of the tensor's flat element indices `flat` the share holds, and where in the slice."""
    if share.dim is None:
        return np.arange(flat.size), flat
    if share.dim == 0:
        keep = np.flatnonzero((flat >= lo) & (flat < share.stop * (entry.numel // entry.shape[0])))
        return keep, flat[keep] - lo
    cols = entry.shape[1]
    inner = entry.numel // (entry.shape[0] * cols) if entry.shape[0] * cols else 1
    col = (flat // inner) % cols
    keep = np.flatnonzero((col >= share.start) & (col < share.stop))
    kept = flat[keep]
    width = share.stop - share.start
    local = ((kept // (inner * cols)) * width + (col[keep] - share.start)) * inner + kept % inner
    return keep, local


def _describe(share: Share) -> str:
    return "the whole tensor" if share.dim is None else f"{'rows' if share.dim == 0 else 'columns'} [{share.start}, {share.stop})"
