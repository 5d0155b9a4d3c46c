"""A package's face loaded on first use (PEP 562): the names a package exports, each imported from its
module only when someone asks for it, so that importing one side of a package (a pool's fetch, a
command line's settings) does not load another side's heavy modules (a server, torch)."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping


def lazy_face(package: str, face: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """`(__getattr__, __all__)` for `package`, whose public name -> module is `face`:
    `__getattr__, __all__ = lazy_face(__name__, {...})` in its `__init__.py`."""

    def __getattr__(name: str) -> Any:
        if name in face:
            return getattr(import_module(face[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(face)
