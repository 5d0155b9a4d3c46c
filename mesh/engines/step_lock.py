"""The transformers engine's step lock, on which a weight write goes before queued generation passes.

Every forward pass (a prefill chunk or a decoding step) of every running generation holds the lock,
and so does every weight write, so a write lands exactly between two passes. A plain FIFO lock would
make a write wait for one pass of every generation queued before it, each in turn; here a write waits
only for the pass in progress: while one is waiting, a generation that gets the lock gives it back
unused and waits for the write to finish.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator


class StepLock:
    """`passes()` for a generation's forward pass, `write()` for a weight write (which goes first)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._writers = 0
        self._no_writers = asyncio.Event()
        self._no_writers.set()

    @asynccontextmanager
    async def passes(self) -> AsyncIterator[None]:
        while True:
            await self._no_writers.wait()
            await self._lock.acquire()
            if self._no_writers.is_set():
                break
            self._lock.release()  # a write queued meanwhile: it goes first
        try:
            yield
        finally:
            self._lock.release()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        self._writers += 1
        self._no_writers.clear()
        try:
            async with self._lock:
                yield
        finally:
            self._writers -= 1
            if not self._writers:
                self._no_writers.set()
