"""Publishing versions in the background of a synchronous training loop: one in flight, on a loop thread.

The training loop is synchronous (every rank runs the same collectives in step), but publishing is
asyncio HTTP. A `LoopThread` (`deltamesh.loop_thread`) runs one event loop in a daemon thread;
`Publishing` runs a version's
publish there, at most one at a time (a new one first waits for the last: versions reach the gateway
in order), and tells the loop when the version in flight is encoded (`wait_encoded`: on a CPU the next
step's compute waits for that, since they share cores) and when it has ended (`wait_published`). Rank
0's `MeshClient` publishes this way with the broker around it; every other rank of a trainer that
publishes in parts does too, with `ShardedVersions` (each rank's rows through
`deltamesh.trainer.shard_publisher`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import torch

from deltamesh.delta.cuts import TensorSpec
from deltamesh.loop_thread import LoopThread
from deltamesh.trainer.publisher import Published
from deltamesh.trainer.shard_publisher import ShardPublisher

log = logging.getLogger(__name__)


@dataclass
class PublishOutcome:
    """How one version's publish went: `ok`, seconds from its start to its end, bytes and kinds sent, and
    the wall-clock time (time.time()) each stage ended: "step_end" (the optimizer step) and "cast" (the
    bf16 copy ready) as the trainer passed them, then the publisher's stages (`Published.stages`)."""

    version: int
    ok: bool
    seconds: float
    bytes_sent: int = 0
    kinds: list[str] = field(default_factory=list)
    error: str = ""
    stages: dict[str, float] = field(default_factory=dict)


class Publishing:
    """At most one publish in flight on `thread`: `publish(weights, version, stages)` runs the coroutine
    `run(weights, version, stages)` (which returns the outcome and never raises)."""

    def __init__(self, thread: LoopThread,
                 run: Callable[[Mapping[str, torch.Tensor], int, dict[str, float]], Awaitable[PublishOutcome]]):
        self._thread = thread
        self._run = run
        self._publishing: concurrent.futures.Future[PublishOutcome] | None = None
        self._encoded = threading.Event()  # the publish in flight has encoded its version (or ended)
        self._encoded.set()
        self._latest: tuple[Mapping[str, torch.Tensor], int, dict[str, float]] | None = None
        """The arguments of the latest publish while it failed or is in flight (None once it got through)."""

    @property
    def in_flight(self) -> bool:
        return self._publishing is not None and not self._publishing.done()

    def encoded(self) -> None:
        """The publish in flight has encoded its version (called by its publisher, on any thread)."""
        self._encoded.set()

    def publish(self, weights: Mapping[str, torch.Tensor], version: int, stages: Mapping[str, float] | None = None) -> float:
        """Start publishing `weights` as `version` once the previous publish has ended; returns how many
        seconds this call waited for it (0 when it had ended)."""
        stalled = self.wait_published()
        # One event per publish: the previous one's done-callback may still be on its way.
        self._encoded = encoded = threading.Event()
        latest = self._latest = (weights, version, dict(stages or {}))
        self._publishing = publishing = self._thread.submit(self._run(*latest))
        publishing.add_done_callback(lambda _: encoded.set())  # a failed publish encodes nothing
        publishing.add_done_callback(lambda f: self._forget(latest, f))
        return stalled

    def _forget(self, latest: tuple, done: concurrent.futures.Future[PublishOutcome]) -> None:
        if not done.cancelled() and done.exception() is None and done.result().ok and self._latest is latest:
            self._latest = None

    def retry_failed(self) -> bool:
        """Publish the latest version again if its publish failed (and nothing is in flight); True if
        it started one. A trainer waiting for batches calls it: the version it failed to publish is the
        one pools need to catch up, and until they do the broker may hold their leases back (the
        staleness bound), so no batch, no next step and no next publish would ever come."""
        if self.in_flight or self._latest is None:
            return False
        weights, version, stages = self._latest
        log.info("publishing v%d again: its last publish failed", version)
        self.publish(weights, version, stages)
        return True

    def wait_encoded(self) -> float:
        """Wait until the publish in flight has encoded its version (its upload may still be under way)
        or has ended; returns the seconds waited."""
        start = time.monotonic()
        self._encoded.wait()
        return time.monotonic() - start

    def wait_published(self) -> float:
        """Wait for the publish in flight, if any; returns the seconds waited."""
        if self._publishing is None:
            return 0.0
        start = time.monotonic()
        self._publishing.result()
        self._publishing = None
        return time.monotonic() - start


@dataclass
class ShardedVersions:
    """A rank's `ShardPublisher` with the model's table and the rows this rank holds, fixed for the run,
    so that a version is published from the rank's rows alone: `publish(rows_held, version)`."""

    shards: ShardPublisher
    table: Sequence[TensorSpec]
    rows: Mapping[str, tuple[int, int]]

    @property
    def base(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        return self.shards.base

    async def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> Published:
        return await self.shards.publish(self.table, weights, self.rows, version)

    async def publish_statement(self) -> bool:
        return await self.shards.publish_statement()

    async def aclose(self) -> None:
        await self.shards.aclose()


def rank_publishing(thread: LoopThread, versions: ShardedVersions) -> Publishing:
    """The background publishing of a rank other than 0: its part of each version, failures logged
    (rank 0 reports every version's outcome)."""
    publishing: Publishing

    async def run(weights: Mapping[str, torch.Tensor], version: int, stages: dict[str, float]) -> PublishOutcome:
        start = time.monotonic()
        try:
            published = await versions.publish(weights, version)
        except Exception as e:  # noqa: BLE001 - the loop goes on; the next version is encoded against the last published
            log.error("rank %d: its part of v%d was not published: %s", versions.shards.rank, version, e)
            return PublishOutcome(version, False, time.monotonic() - start, error=str(e), stages=stages)
        return PublishOutcome(version, True, time.monotonic() - start, published.bytes_sent,
                              [m.kind for m in published.manifests], stages={**stages, **published.stages})

    publishing = Publishing(thread, run)
    versions.shards.on_encoded = publishing.encoded
    return publishing
