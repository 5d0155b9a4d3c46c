"""What a pool rank holds of a tensor (`Share`), and which pieces of a version reach its shares.

Pure data and the manifest only (no numpy, no torch), so the fetch side of a pool rank, which decides
what to ask gateways for, reads it without the codec's array code: the piece spans of a format 4
manifest (slices.py) say which pieces write into which element ranges. layouts.py says which shares
each rank of an engine holds; shares.py applies the fetched pieces to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .manifest import Manifest, TensorEntry


@dataclass(frozen=True)
class Share:
    """What a rank holds of one tensor: all of it (`dim` None), or rows (`dim` 0) or columns (`dim` 1)
    [start, stop)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = self.stop - self.start
        return tuple(out)

    def take(self, tensor):
        """This share of a whole tensor (a view)."""
        if self.dim is None:
            return tensor
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


def pieces_for(manifest: Manifest, shares: Mapping[str, Share]) -> list[int]:
    """Indices of the codec pieces that write into `shares` (tensor name -> share): by their spans when
    the manifest has them, else every piece writing a tensor held. Side-file pieces are never needed."""
    index = manifest.tensor_index()
    held = {index[name]: share for name, share in shares.items() if name in index}
    files = manifest.file_pieces()
    wanted = []
    for i, piece in enumerate(manifest.pieces):
        if i in files:
            continue
        if piece.spans is None:
            if any(t in held for t in piece.tensors):
                wanted.append(i)
            continue
        if any(s.tensor in held and _reaches(manifest.tensors[s.tensor], held[s.tensor], s.start, s.stop)
               for s in piece.spans):
            wanted.append(i)
    return wanted


def _reaches(entry: TensorEntry, share: Share, start: int, stop: int) -> bool:
    """Whether elements [start, stop) of the tensor meet the share (columns meet every row range)."""
    if share.dim != 0:
        return True
    row = entry.numel // entry.shape[0] if entry.shape and entry.shape[0] else 1
    return start < share.stop * row and share.start * row < stop
