"""`BatchClient`, the trainer's side of the broker's batch API (see docs/api/broker.md).

It reports versions and step timings, long-polls batches in the layout of `deltamesh.data`
and acknowledges them through the base layer's `BrokerClient` (which fails over between several
brokers), keeping the bookkeeping that makes delivery at-least-once across restarts and failovers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Sequence

from deltamesh.broker_client import BrokerClient
from deltamesh.data import Batch, decode_batch
from deltamesh.http import HttpError
from deltamesh.tls import TlsSettings

TRAINED_MEMORY = 10_000
"""How many acknowledged batch ids a client remembers, to skip a batch served again after a failover."""


class BatchClient:
    """The trainer's side of the broker: report versions and step timings, long-poll and acknowledge batches.

    Delivery is at least once. The broker keeps every batch it serves until the batch is acknowledged;
    one not acknowledged goes back to its buffer when its ack deadline passes or when a poll does not
    list it as held, so a trainer that dies before acknowledging gets the same samples again after a
    restart. The client keeps that bookkeeping: every poll carries the acknowledgements not yet
    confirmed (`ack`) and the batches received and not yet acknowledged (`held`). With `auto_ack`
    (the default) a batch counts as trained once the next one is asked for; a trainer that must
    acknowledge later (after a checkpoint) passes `auto_ack=False` and calls `ack`.

    A batch whose acknowledgement was lost (a broker that failed over before it was durable) is
    served again under the same id by the broker that took over. The client remembers the last
    `TRAINED_MEMORY` ids it acknowledged; such a batch is acknowledged again and never handed to
    the trainer twice (the poll goes on).

    `next_batch` remembers how long it waited and when it was last called, so a trainer that calls it
    once per step can report `step_timings()` without measuring anything itself. Use one client per
    model_id, polling one batch at a time.
    """

    def __init__(self, broker_url: str | Sequence[str], model_id: str, *, auto_ack: bool = True, token: str = "",
                 tls: TlsSettings | None = None, failover_s: float = 60.0):
        self.model_id = model_id
        self.auto_ack = auto_ack
        self._broker = BrokerClient(broker_url, token=token, tls=tls, connections=4, timeout_s=None,
                                    failover_s=failover_s)
        self._last_call: float | None = None
        self._wait_s = 0.0
        self._last_step: tuple[float, float] = (0.0, 0.0)
        self._held: list[str] = []  # received, not yet acknowledged: the broker keeps them for us
        self._acks: list[str] = []  # acknowledged here, not yet confirmed by the broker
        self._trained: OrderedDict[str, None] = OrderedDict()  # acknowledged here, newest last

    async def __aenter__(self) -> BatchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._broker.close()

    @property
    def held(self) -> list[str]:
        """Batches received and not yet acknowledged, oldest first."""
        return list(self._held)

    @property
    def unconfirmed_acks(self) -> list[str]:
        """Batches acknowledged here whose acknowledgement the broker has not confirmed yet."""
        return list(self._acks)

    async def report_version(self, version: int) -> dict[str, Any]:
        """Tell the broker this trainer now holds `version` (registers the model_id if the broker allows)."""
        return await self._broker.report_version(self.model_id, version)

    async def report_step(self, wait_s: float, step_s: float) -> dict[str, Any]:
        """One training step's timings: seconds spent waiting for its batch and the whole step's length."""
        return await self._broker.report_step(self.model_id, wait_s, step_s)

    async def next_batch(self, size: int, *, version: int | None = None, timeout_s: float = 30.0) -> Batch | None:
        """Wait up to `timeout_s` for a batch of (at most, whole groups) `size` samples; None on timeout.

        The request also carries the pending acknowledgements and the batches held; a failed poll
        loses neither (they go with the next one). A batch already acknowledged here is not returned:
        its acknowledgement goes with the next poll, which is made at once, within the same `timeout_s`."""
        start = time.monotonic()
        if self._last_call is not None:
            self._last_step = (self._wait_s, start - self._last_call)
        self._last_call = start
        if self.auto_ack:
            self._mark_acked(self._held)
        deadline = start + timeout_s
        while True:
            wait_s = max(0.0, deadline - time.monotonic())
            sent = list(self._acks)
            body = {"size": size, "version": version, "timeout_s": wait_s, "ack": sent, "held": list(self._held)}
            data = await self._broker.poll_batch(self.model_id, body, timeout_s=wait_s + 30)
            self._confirmed(sent)
            batch = decode_batch(data) if data else None
            if batch is None or batch.batch_id not in self._trained:
                break
            self._mark_acked([batch.batch_id])  # trained already: acknowledge it again, never train twice
        self._wait_s = time.monotonic() - start
        if batch is not None:
            self._held.append(batch.batch_id)
        return batch

    async def ack(self, batch_ids: Sequence[str] | None = None) -> dict[str, list[str]]:
        """Acknowledge `batch_ids` (default: every batch held) now, with every acknowledgement still
        unconfirmed. Answers {"acked", "already_acked", "requeued"}: a requeued batch was acknowledged
        too late (after its deadline) and its samples are served again.

        Raises HttpError. After a 4xx (an id the broker never served, an unknown model) the ids sent
        are dropped, as the broker will never take them; after any other failure they stay pending
        and go with the next poll or ack."""
        self._mark_acked(self._held if batch_ids is None else batch_ids)
        sent = list(self._acks)
        if not sent:
            return {"acked": [], "already_acked": [], "requeued": []}
        try:
            answer = await self._broker.ack_batches(self.model_id, sent)
        except HttpError as e:
            if 400 <= e.status < 500:
                self._confirmed(sent)
            raise
        self._confirmed(sent)
        return answer

    def _mark_acked(self, batch_ids: Sequence[str]) -> None:
        for batch_id in list(batch_ids):
            if batch_id in self._held:
                self._held.remove(batch_id)
            if batch_id not in self._acks:
                self._acks.append(batch_id)
            self._trained[batch_id] = None
            self._trained.move_to_end(batch_id)
        while len(self._trained) > TRAINED_MEMORY:
            self._trained.popitem(last=False)

    def _confirmed(self, batch_ids: Sequence[str]) -> None:
        done = set(batch_ids)
        self._acks = [b for b in self._acks if b not in done]

    def step_timings(self) -> tuple[float, float]:
        """(wait_s, step_s) of the last complete step: from one `next_batch` call to the next."""
        return self._last_step
