"""Rank 0's dealings with the mesh, off the training thread: batches in, versions out, timings reported.

The training loop is synchronous (every rank runs the same collectives in step), but the broker and
the gateway speak asyncio HTTP. `MeshClient` runs one event loop in a background thread
(`deltamesh.trainer.publishing`) and offers the loop blocking calls for what it must wait for (the
next batch, the start of the weight stream) and fire-and-forget calls for what it must not: a
version's publish (encode, sign, upload, then report the version to the broker) runs in the
background while the next batch is polled and trained, with at most one publish in flight, so
versions reach the gateway in order and a slow upload delays training by at most the part of it
that outlasts a whole step. The version goes out through a `Publisher` of the whole weights, or, for
a trainer that publishes in parts, through rank 0's `ShardedVersions` (its own rows, and the manifest
it signs for every rank's). Step timings and batch acknowledgements go to the broker the same way (an
acknowledgement that does not get through goes again with the next poll). The same loop serves the
trainer's Prometheus metrics when asked (`serve_metrics`). Only rank 0 creates one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Callable, Mapping

import torch
from prometheus_client import CollectorRegistry

from deltamesh.data import Batch, DataFormatError
from deltamesh.delta import CodecError
from deltamesh.delta.keys import Ed25519PrivateKey
from deltamesh.http import HttpError, serving
from deltamesh.loop_thread import LoopThread
from deltamesh.metrics import status_app
from deltamesh.tls import TlsSettings
from deltamesh.trainer.batch_client import BatchClient
from deltamesh.trainer.publish_settings import PublishSettings
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.publishing import Publishing, PublishOutcome, ShardedVersions
from deltamesh.trainer.stream_start import StreamStart, start_sharded, start_stream

log = logging.getLogger(__name__)

RETRY_S = 1.0
__all__ = ["MeshClient", "PublishOutcome"]


class MeshClient:
    """The broker's batch API and the origin gateway, for one model_id, as seen from the training loop.

    `broker` is one URL or several (comma-separated: active and standby brokers); each call to them
    fails over for up to `broker_failover_s` (see `deltamesh.broker_client`)."""

    def __init__(self, *, broker: str, publish: PublishSettings, key: Ed25519PrivateKey, broker_token: str = "",
                 statement_every_s: float = 0.0, on_published: Callable[[PublishOutcome], None] | None = None,
                 broker_failover_s: float = 60.0, side_files: Mapping[str, bytes] | None = None,
                 sharded: ShardedVersions | None = None, thread: LoopThread | None = None):
        """`publish`: where and how versions go out (the broker's TLS is the gateway's, `publish.tls`)."""
        model_id, tls = publish.model_id, publish.tls
        self.model_id = model_id
        self.on_published = on_published
        """Called (on the client's thread) as each publish ends, successful or not."""
        self.trusted_keys = [key.public_key()]
        self._owns_thread = thread is None
        self._thread = thread or LoopThread(f"mesh-{model_id}")
        self._publishing = Publishing(self._thread, self._publish)
        self.sharded = sharded
        """Rank 0's part of a trainer that publishes in parts (None: it publishes the whole weights)."""
        self.publisher: Publisher | ShardedVersions
        if sharded is not None:
            self.publisher = sharded
            sharded.shards.on_encoded = self._publishing.encoded
        else:
            self.publisher = Publisher.from_settings(
                publish, key, side_files=side_files,  # config and tokenizer travel with every version
                on_encoded=lambda _: self._publishing.encoded())
        self._batches: BatchClient = self._thread.call(self._open(broker, broker_token, tls, broker_failover_s))
        self._reports: list[concurrent.futures.Future[None]] = []
        self._statements = (self._thread.submit(self._refresh_statements(statement_every_s))
                            if statement_every_s > 0 else None)
        self._served = contextlib.AsyncExitStack()

    def serve_metrics(self, registry: CollectorRegistry, listen: str) -> str:
        """Serve `registry` at `/metrics` on `listen` (HOST:PORT) from the client's thread until `close`;
        returns the base URL."""
        return self._thread.call(self._served.enter_async_context(serving(status_app(registry), listen)))

    async def _refresh_statements(self, every_s: float) -> None:
        """Re-sign the head statement between versions, so pools that require a fresh one can tell a
        frozen gateway from a trainer that is between steps (a statement also goes with each version)."""
        while True:
            await asyncio.sleep(every_s)
            if not self._publishing.in_flight:  # a version in flight brings its own
                await self.publisher.publish_statement()

    async def _open(self, broker: str, token: str, tls: TlsSettings | None, failover_s: float) -> BatchClient:
        # Its HTTP session belongs to this thread's loop. The loop says when a batch's update is safe.
        return BatchClient(broker, self.model_id, auto_ack=False, token=token, tls=tls, failover_s=failover_s)

    def close(self) -> None:
        """Finish the publish in flight and the pending reports, then stop the thread."""
        try:
            try:
                self._publishing.wait_published()
            except Exception:  # noqa: BLE001 - closing after a failure; say what else went wrong
                log.exception("%s: the last publish failed", self.model_id)
            concurrent.futures.wait(self._reports)
            if self._batches.unconfirmed_acks:  # one more try: unacknowledged, they are served again
                self._thread.call(self._ack([]))
        finally:
            if self._statements is not None:
                self._statements.cancel()
            self._thread.call(self.publisher.aclose())  # the connections kept open to the origin
            self._thread.call(self._served.aclose())
            self._thread.call(self._batches.close())
            if self._owns_thread:
                self._thread.close()

    # -- the weight stream -------------------------------------------------------------------------
    def start(self, version: int, weights: Mapping[str, torch.Tensor] | None, stop: threading.Event) -> StreamStart | None:
        """Join the gateway's stream with the trainer's `version` (see `start_stream`); tell the broker.
        Publishing in parts, only the version the ranks' full snapshot takes is chosen (`start_sharded`;
        `weights` are not used).

        An unreachable gateway is retried every second until `stop` is set (then None).
        """
        while True:
            try:
                if self.sharded is not None:
                    at = self._thread.call(start_sharded(self.sharded.shards.link, version))
                    # The ranks publish it next, all at once; its publish reports it to the broker.
                    return StreamStart(at, at, None, "every rank publishes its rows as a full snapshot")
                start = self._thread.call(start_stream(self.publisher, version, weights, self.trusted_keys))
                break
            except HttpError as e:
                if e.status not in (0, 502, 503, 504):
                    raise
                log.warning("%s: gateway not available yet: %s", self.model_id, e)
                if stop.wait(RETRY_S):
                    return None
        log.info("%s: weight stream at v%d, next delta on v%d: %s", self.model_id, start.version,
                 start.base_version, start.reason)
        self._thread.call(self._report_version(start.version))
        return start

    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                stages: Mapping[str, float] | None = None) -> float:
        """Start publishing `weights` (rank 0's rows, when publishing in parts) as `version` in the
        background, once the previous publish has ended. `stages` are the trainer's own stage times
        ("step_end", "cast"), carried into the outcome.

        Returns how many seconds this call waited for the previous publish (0 when it had ended).
        """
        return self._publishing.publish(weights, version, stages)

    def wait_encoded(self) -> float:
        """Wait until the publish in flight has encoded its version (its upload may still be under way)
        or has ended; returns the seconds waited."""
        return self._publishing.wait_encoded()

    def wait_published(self) -> float:
        """Wait for the publish in flight, if any; returns the seconds waited."""
        return self._publishing.wait_published()

    async def _publish(self, weights: Mapping[str, torch.Tensor], version: int,
                       stages: dict[str, float]) -> PublishOutcome:
        start = time.monotonic()
        try:
            published = await self.publisher.publish(weights, version)
        except (HttpError, CodecError, OSError, ValueError) as e:
            base = self.publisher.base[0] if self.publisher.base is not None else None
            log.error("%s: publishing v%d failed (%s); the next version is encoded against v%s",
                      self.model_id, version, e, base)
            outcome = PublishOutcome(version, False, time.monotonic() - start, error=str(e), stages=stages)
        else:
            outcome = PublishOutcome(version, True, time.monotonic() - start, published.bytes_sent,
                                     [m.kind for m in published.manifests], stages={**stages, **published.stages})
        if self.on_published is not None:
            self.on_published(outcome)
        if outcome.ok:
            await self._report_version(version)
        return outcome

    async def _report_version(self, version: int) -> None:
        try:
            await self._batches.report_version(version)
        except HttpError as e:
            # The broker keeps its staleness bound on the version it knew; the next report fixes it.
            log.warning("%s: could not report v%d to the broker: %s", self.model_id, version, e)

    # -- batches and timings -------------------------------------------------------------------------
    def next_batch(self, size: int, poll_s: float, stop: threading.Event) -> Batch | None:
        """Long-poll the broker until a batch comes (None once `stop` is set and a poll came back empty).

        An unreachable or failing broker is retried every second: the trainer waits on batches, and
        that is what it is waiting for. Meanwhile a version whose publish failed (a full disk at the
        origin, say) is published again, once per poll, until it gets through.
        """
        while True:
            if self.sharded is None:  # in parts, every rank's next step publishes again (a retry needs them all)
                self._publishing.retry_failed()
            try:
                batch = self._thread.call(self._batches.next_batch(size, timeout_s=poll_s))
            except (HttpError, DataFormatError) as e:
                log.warning("%s: batch poll failed: %s", self.model_id, e)
                batch = None
                stop.wait(RETRY_S)
            if batch is not None:
                if batch.model_id != self.model_id:
                    raise DataFormatError(f"the broker sent a batch of {batch.model_id!r} to {self.model_id!r}")
                return batch
            if stop.is_set():
                return None

    def ack(self, batch_ids: list[str]) -> None:
        """Acknowledge batches whose update is safe, without waiting for the answer. Until the broker
        has it, the acknowledgement rides along with every poll; a batch never acknowledged is
        served again once this trainer (restarted) polls without it."""
        self._reports = [f for f in self._reports if not f.done()]
        self._reports.append(self._thread.submit(self._ack(batch_ids)))

    async def _ack(self, batch_ids: list[str]) -> None:
        try:
            answer = await self._batches.ack(batch_ids)
        except HttpError as e:
            log.warning("%s: could not acknowledge batches %s: %s", self.model_id, batch_ids, e)
            return
        if answer["requeued"]:
            log.warning("%s: batches %s were acknowledged after the broker had requeued them; their samples "
                        "will be trained on again", self.model_id, answer["requeued"])

    def report_step(self, wait_s: float, step_s: float) -> None:
        """Send one step's timings to the broker's balance report, without waiting for the answer."""
        self._reports = [f for f in self._reports if not f.done()]
        self._reports.append(self._thread.submit(self._report_step(wait_s, step_s)))

    async def _report_step(self, wait_s: float, step_s: float) -> None:
        try:
            await self._batches.report_step(wait_s, step_s)
        except HttpError as e:
            log.warning("%s: could not report step timings: %s", self.model_id, e)
