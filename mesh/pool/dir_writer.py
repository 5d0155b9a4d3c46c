"""Writing a pool's synced directory behind its engine, so the next version need not wait for the disk.

An engine that swaps in place serves a version before the directory holds it (mesh/pool/weights.py).
Writing the directory (reading, patching, hashing and fsyncing the whole model: ~1.5 s for SmolLM2
on 2 cores) then used to hold up the pool's next round. `DirectoryWriter.write_behind` queues the
write instead and returns; the next round plans from `held`, the version the directory will hold
once the queued writes are done, and fetches, verifies and swaps the next version while the write
runs. Writes run one at a time, in the order queued, each atomic (`WeightSync.persist`). A write
whose base is not what the directory holds (an earlier write failed) is skipped, and `held` falls
back to the directory's version, so the next round plans from the directory again and brings it up
to the engine. `flush` waits for every queued write: before the directory is read (an engine
reload), written in the foreground, or left (a clean stop). Any other write runs beside the next
version's engine apply: the decoded versions a write reads are never written into by an engine (one
that adopts a full snapshot's tensors patches copies of them: `mesh/engines/host_weights.py`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

from deltamesh.delta import DecodedVersion
from deltamesh.mesh.pool.weight_sync import WeightSync

log = logging.getLogger(__name__)


class DirectoryWriter:
    """The synced directory's queued writes (see the module docstring)."""

    def __init__(self, sync: WeightSync, *, on_written: Callable[[list[int]], None],
                 on_error: Callable[[str], None]) -> None:
        self.sync = sync
        self._on_written = on_written
        self._on_error = on_error
        self._last: asyncio.Task | None = None
        self._to: int | None = None  # the version the newest queued write leaves the directory at

    @property
    def held(self) -> int | None:
        """The version the directory holds once the queued writes are done (what to plan from)."""
        return self._to if self._to is not None else self.sync.version

    @property
    def writing(self) -> bool:
        return self._last is not None and not self._last.done()

    def write_behind(self, base: int | None, versions: Sequence[DecodedVersion]) -> None:
        """Queue writing `versions` (a chain from `base`; None for one starting with a full snapshot)."""
        self._to = versions[-1].version
        self._last = asyncio.create_task(self._write(self._last, base, list(versions)))

    async def flush(self) -> None:
        """Wait until every queued write is done (their failures are reported, not raised)."""
        if self._last is not None:
            await asyncio.shield(self._last)

    async def _write(self, previous: asyncio.Task | None, base: int | None,
                     versions: list[DecodedVersion]) -> None:
        if previous is not None:
            await previous
        numbers = [v.version for v in versions]
        try:
            if base is not None and self.sync.version != base:
                log.info("%s: v%d not written behind: the directory holds v%s, not v%d; the next round "
                         "writes from there", self.sync.model, numbers[-1], self.sync.version, base)
                return
            await self.sync.persist(versions)
            self._on_written(numbers)
        except Exception as e:  # noqa: BLE001 - a failed write must not end the stream; it is retried
            self._on_error(f"writing v{numbers[-1]} to {self.sync.config.dir} failed, the next round "
                           f"writes it again: {type(e).__name__}: {e}")
        finally:
            if self._last is asyncio.current_task():
                self._to = None  # the queue is empty: the directory's own version is what it holds
