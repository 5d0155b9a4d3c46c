"""Where deltamesh keeps what it can rebuild: one folder per user, never inside a source checkout.

`cache_dir("models")` is $DELTAMESH_CACHE/models when that is set (tests point it at a temp dir,
comparisons of two checkouts share one), else $XDG_CACHE_HOME/deltamesh/models, else
~/.cache/deltamesh/models. Built models, benchmark payloads and results, and a publisher's state
live there; deleting the folder costs only the time to build them again.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache folder, or `parts` below it (not created: the caller makes what it writes)."""
    root = os.environ.get("DELTAMESH_CACHE")
    if root:
        return Path(root).joinpath(*parts)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg, "deltamesh").joinpath(*parts)
