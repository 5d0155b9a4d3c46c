"""Proof of what an engine serves: after every swap, its weights read back and compared to the version's
signed per-tensor hashes.

The manifest of every version (delta or full) carries the xxh3-128 of each resulting tensor, under the
trainer's signature. After a swap the pool asks the engine for the digests of some of those tensors as
its forward pass reads them (`ReadsBack.served_digests`: the live tensors of the transformers engine,
vLLM's own parameters sliced back into checkpoint tensors) and compares them, with the version the
engine claims, to that manifest. Which tensors: every tensor the swap wrote (a delta's touched tensors,
every tensor after a full snapshot or a reload), where a stale or half-taken update must show, plus a
rotating share of all tensors, so that a tensor no delta touches (a norm that never moves by an ulp)
and that went bad inside the engine is caught within `rotation` checks. Hashing runs at memory speed
(~16 GB/s here), and a delta's touched tensors are the ones its apply has just hashed anyway, so the
check costs about what the apply's own result check costs (docs/PROOF.md has the figures and why not
probe logprobs). An engine that cannot read back (SGLang) is reported unchecked, never failed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from deltamesh.delta import Manifest
from deltamesh.mesh.engines.base import Engine, EngineError, ReadsBack
from deltamesh.mesh.pool.config import ServeCheckConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckResult:
    """One check of an engine against the manifest of the version it claims to serve."""

    ok: bool
    version: int
    """The version checked against (the manifest's)."""
    checked: int = 0
    """Tensors read back and compared."""
    unreadable: int = 0
    """Tensors the engine could not read back (not compared)."""
    mismatched: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""

    def describe(self) -> str:
        if self.ok:
            return f"v{self.version}: {self.checked} tensors match ({self.unreadable} unreadable, {self.seconds * 1e3:.1f} ms)"
        return f"v{self.version}: {self.reason}"


class ServeCheck:
    """Checks one engine after each swap (see the module docstring); keeps the rotation's place."""

    def __init__(self, config: ServeCheckConfig | None = None) -> None:
        self.config = config or ServeCheckConfig()
        self._cursor = 0

    def checkable(self, engine: Engine) -> bool:
        return self.config.enabled and isinstance(engine, ReadsBack)

    def plan(self, manifest: Manifest, touched: Iterable[str] | None) -> list[str]:
        """The tensors to read back: `touched` (None: every tensor) plus the next share of the rotation."""
        names = [t.name for t in manifest.tensors]
        if touched is None:
            return names
        share = math.ceil(len(names) / self.config.rotation)
        start = self._cursor % max(1, len(names))
        self._cursor = start + share
        rotating = (names + names)[start:start + share]
        chosen = set(touched) | set(rotating)
        return [n for n in names if n in chosen]

    async def run(self, engine: Engine, manifest: Manifest, touched: Iterable[str] | None = None) -> CheckResult:
        """Read back the planned tensors of `engine` and compare them and its version with `manifest`."""
        started = time.perf_counter()
        names = self.plan(manifest, touched)
        try:
            grids = {t.name: t.grid for t in manifest.tensors if t.grid is not None}
            served = await engine.served_digests(names, grids)  # type: ignore[attr-defined]
        except EngineError as e:
            return CheckResult(False, manifest.version, reason=f"cannot read the engine's weights back: {e}",
                               seconds=time.perf_counter() - started)
        seconds = time.perf_counter() - started
        if served.version != manifest.version:
            return CheckResult(False, manifest.version, seconds=seconds,
                               reason=f"the engine claims v{served.version}, the pool put v{manifest.version} in")
        expected = {t.name: t.hash for t in manifest.tensors}
        unreadable = [n for n in names if served.digests.get(n) is None]
        mismatched = [n for n in names if served.digests.get(n) not in (None, expected[n])]
        checked = len(names) - len(unreadable)
        if mismatched:
            reason = (f"{len(mismatched)} of {checked} tensors read back differ from the signed hashes, "
                      f"e.g. {mismatched[:3]}")
            return CheckResult(False, manifest.version, checked, len(unreadable), mismatched, seconds, reason)
        return CheckResult(True, manifest.version, checked, len(unreadable), [], seconds)
