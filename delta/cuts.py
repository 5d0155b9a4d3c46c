"""What every process knows of a version before encoding its part: the tensor table, and the pool cuts.

`TensorSpec` names one tensor of the whole version (name, dtype, whole shape), as every trainer rank
knows it whether or not it holds any of its rows. `Cuts` say where pool ranks' shares of a tensor end
and which pool ranks need each row band (layouts.py makes them from the pools' engine layouts;
parts.py cuts pieces and tiles by them). Pure data: a trainer's settings check layouts with it, and the
command line that parses them loads no array code.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

ALL = "*"
"""The key of a band every pool rank needs (and of every band when a version has no pool layouts)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the whole version, as every process knows it (name, dtype, whole shape)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def row_elements(self) -> int:
        """Elements per row of dim 0 (1 for a 0-d tensor)."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class Cuts:
    """Where pool ranks' shares of one tensor end: interior bounds of dim 0 (`rows`) and of dim 1 (`cols`),
    and per row band (len(rows) + 1 of them) the key of the pool ranks that need it."""

    rows: tuple[int, ...] = ()
    cols: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()

    def key(self, row: int) -> str:
        """The key of the band that row `row` lies in."""
        return self.keys[bisect.bisect_right(self.rows, row)] if self.keys else ALL


NO_CUTS = Cuts()
