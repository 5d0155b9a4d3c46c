"""Runs the broker's blocking store off the event loop, on one worker thread, with group commit.

Every store call goes through one single-thread executor, so the store sees one caller at a time and
long-polls and the HTTP server stay responsive while SQLite works. Trajectory submissions are
coalesced: while one commit runs, new submissions queue, and the next commit writes all of them in
one transaction (each still all-or-nothing on its own). That is what makes a durable acknowledgement
cheap at thousands of trajectories per second: one fsync per commit, not per submission. A submission
is packed (digests, payload blobs) as it is queued, on the event loop, so the worker thread's commits,
the one serial path, do only the database's part.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import zstandard

from deltamesh.data import Trajectory
from deltamesh.mesh.broker.store_interface import (
    BrokerStore,
    GroupVerdict,
    IngestResult,
    StoreConflict,
    StoreUnavailable,
    Submission,
)
from deltamesh.mesh.broker.store_rows import pack_submission

log = logging.getLogger(__name__)
R = TypeVar("R")
# A broker closes on shutdown and when it stops being the active one; callers caught in between get a
# 503 and retry (at the next active broker), never a 500.
_CLOSED = "this broker is shutting down or no longer active; nothing was written"


class StoreRunner:
    """`on_ingested` sees every committed submission's result on the event loop, even one whose
    submitter has gone away, so the broker's memory always follows what the store holds."""

    def __init__(self, open_store: Callable[[], BrokerStore], verdict: GroupVerdict, *, max_commit: int,
                 on_ingested: Callable[[IngestResult], None], on_commit: Callable[[], None] = lambda: None):
        self._open_store = open_store
        self._verdict = verdict
        self._max_commit = max_commit
        self._on_ingested = on_ingested
        self._on_commit = on_commit
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="broker-store")
        self._pending: deque[tuple[Submission, asyncio.Future[IngestResult]]] = deque()
        self._compressor = zstandard.ZstdCompressor(level=1)  # used on the event loop only
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self.store: BrokerStore | None = None
        self._closed = False

    async def start(self) -> None:
        self.store = await self._run(self._open_store)
        self._flusher = asyncio.create_task(self._flush_forever(), name="broker-group-commit")

    async def close(self) -> None:
        self._closed = True  # from here on every call answers StoreUnavailable instead of waiting
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        for _, fut in self._pending:
            if not fut.done():
                fut.set_exception(StoreUnavailable(_CLOSED))
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.store.close)
        self._executor.shutdown(wait=True)

    async def _run(self, fn: Callable[..., R], *args: Any) -> R:
        if self._closed:
            raise StoreUnavailable(_CLOSED)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call(self, fn: Callable[..., R], *args: Any) -> R:
        """Run `fn` (a method of `self.store`, or a function that calls them) on the worker thread."""
        return await self._run(fn, *args)

    async def ingest(self, trajectories: Sequence[Trajectory]) -> IngestResult:
        """Store one submission durably; returns once its commit is done. Raises StoreConflict/StoreUnavailable."""
        if self._closed:
            raise StoreUnavailable(_CLOSED)
        fut: asyncio.Future[IngestResult] = asyncio.get_running_loop().create_future()
        self._pending.append((pack_submission(trajectories, self._compressor), fut))
        self._wakeup.set()
        return await fut

    async def _flush_forever(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch, count = [], 0
                while self._pending and (not batch or count + len(self._pending[0][0].trajectories) <= self._max_commit):
                    item = self._pending.popleft()
                    batch.append(item)
                    count += len(item[0].trajectories)
                await self._commit(batch)

    async def _commit(self, batch: list[tuple[Submission, asyncio.Future[IngestResult]]]) -> None:
        assert self.store is not None
        try:
            results = await self._run(self.store.ingest, [t for t, _ in batch], self._verdict)
        except asyncio.CancelledError:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(StoreUnavailable(_CLOSED))
            raise
        except Exception as e:  # StoreUnavailable, or a bug: no submission of this commit was stored
            if isinstance(e, StoreUnavailable):
                log.warning("commit of %d submissions failed: %s", len(batch), e)
            else:
                log.exception("commit of %d submissions failed", len(batch))
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        self._on_commit()
        for (_, fut), result in zip(batch, results):
            if not isinstance(result, StoreConflict):
                try:
                    self._on_ingested(result)
                except Exception:  # a bug there must not leave the other submitters waiting forever
                    log.exception("updating the broker's memory after a commit failed")
            if fut.done():  # the submitter went away; what was committed stays committed
                continue
            if isinstance(result, StoreConflict):
                fut.set_exception(result)
            else:
                fut.set_result(result)
