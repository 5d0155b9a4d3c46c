"""`BrokerClient`: the one place that knows the dataflow broker's `/v1/` URLs (see docs/api/broker.md).

Pools lease tasks and submit trajectories, trainers report versions and step timings, poll batches
and acknowledge them, the autoscaler and the demo read the status and the balance report: all
through this client, which builds every path, speaks the binary trajectory/batch layout of
`deltamesh.data` and raises `HttpError` with the broker's reason. It keeps no delivery bookkeeping:
the trainer's at-least-once batch stream (`deltamesh.trainer.batch_client.BatchClient`) does that on top.
A submission is acknowledged only once it is durable and resubmitting the same trajectory ids is
harmless, so `submit` may retry on a 503 or a lost connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, Trajectory, encode_trajectories
from deltamesh.http import HttpError, bearer, client_session, request_bytes, request_json
from deltamesh.tls import TlsSettings, check_token_transport

log = logging.getLogger(__name__)


@dataclass
class TaskLease:
    """A task leased to a pool until `deadline` (unix time); submit its samples under `group_id`."""

    lease_id: str
    group_id: str
    task_id: str
    epoch: int
    prompt: Any
    metadata: dict[str, Any]
    n_samples: int
    model_ids: list[str]
    deadline: float


@dataclass
class SubmitResult:
    accepted: int
    duplicates: int


class BrokerClient:
    """Calls to the broker at `url` with the caller's `token` (its role and name are the token's), over
    TLS as `tls` says for https:// URLs. A pool names itself (`pool`, `region`, `gpus`) for leases and
    submissions; a trainer passes the model_id to each of its calls. Close it (or use `async with`).

    Raises TlsError at once if the token would travel in clear text to a host that is not loopback."""

    def __init__(self, url: str, *, token: str = "", tls: TlsSettings | None = None, pool: str = "",
                 region: str = "", gpus: int = 1, connections: int = 8, timeout_s: float | None = 300.0) -> None:
        self.base = url.rstrip("/")
        self.pool = pool
        self.region = region
        self.gpus = gpus
        if token:
            check_token_transport(self.base, tls.insecure if tls is not None else False)
        headers = bearer(token) if token else None
        self._session = client_session(connections=connections, timeout_s=timeout_s, tls=tls, headers=headers)

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    def _url(self, path: str) -> str:
        return f"{self.base}{path}"

    # -- anyone -----------------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """Each model's trainer version and buffers, and the tasks' progress."""
        return await request_json(self._session, "GET", self._url("/v1/status"), timeout_s=30)

    async def balance(self) -> dict[str, Any]:
        """The report that drives the autoscaler: trainer waits and pool throughput per model."""
        return await request_json(self._session, "GET", self._url("/v1/balance"), timeout_s=30)

    # -- pools ------------------------------------------------------------------------------------------
    async def lease(self, max_tasks: int = 1) -> list[TaskLease]:
        """Up to `max_tasks` tasks; an empty list when none is available right now."""
        body = {"pool": self.pool, "region": self.region, "gpus": self.gpus, "max_tasks": max_tasks}
        answer = await request_json(self._session, "POST", self._url("/v1/leases"), body=body, timeout_s=60)
        return [TaskLease(**item) for item in answer["leases"]]

    async def submit(self, trajectories: Sequence[Trajectory], *, retries: int = 0,
                     retry_delay_s: float = 1.0) -> SubmitResult:
        """Submit trajectories (tagged with this pool and region if they are not yet); returns once durable.

        With `retries`, a 503 (store unavailable) or an unreachable broker is retried after
        `retry_delay_s`; that is safe because submission is idempotent. Other errors raise HttpError.
        """
        for t in trajectories:
            t.pool = t.pool or self.pool
            t.region = t.region or self.region
        data = encode_trajectories(trajectories)
        headers = {"Content-Type": TRAJECTORIES_CONTENT_TYPE}
        attempt = 0
        while True:
            try:
                raw = await request_bytes(self._session, "POST", self._url("/v1/trajectories"), data=data,
                                          headers=headers, timeout_s=120)
                answer = json.loads(raw)
                return SubmitResult(answer["accepted"], answer["duplicates"])
            except HttpError as e:
                if e.status not in (0, 503) or attempt >= retries:
                    raise
                attempt += 1
                log.warning("submission to %s failed (%s); retrying", self.base, e)
                await asyncio.sleep(retry_delay_s)

    # -- trainers ---------------------------------------------------------------------------------------
    async def report_version(self, model_id: str, version: int) -> dict[str, Any]:
        """The trainer of `model_id` now holds `version` (registers the model_id if the broker allows)."""
        return await request_json(self._session, "POST", self._url(f"/v1/models/{model_id}/version"),
                                  body={"version": version}, timeout_s=30)

    async def report_step(self, model_id: str, wait_s: float, step_s: float) -> dict[str, Any]:
        """One training step's timings: seconds spent waiting for its batch and the whole step's length."""
        return await request_json(self._session, "POST", self._url(f"/v1/models/{model_id}/steps"),
                                  body={"wait_s": wait_s, "step_s": step_s}, timeout_s=30)

    async def poll_batch(self, model_id: str, body: dict[str, Any], *, timeout_s: float) -> bytes:
        """Long-poll one batch (`size`, `version`, `timeout_s`, `ack`, `held`); empty bytes when none came."""
        return await request_bytes(self._session, "POST", self._url(f"/v1/models/{model_id}/batch"),
                                   data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                   timeout_s=timeout_s)

    async def ack_batches(self, model_id: str, batch_ids: Sequence[str]) -> dict[str, list[str]]:
        """Acknowledge batches: `{"acked", "already_acked", "requeued"}`."""
        return await request_json(self._session, "POST", self._url(f"/v1/models/{model_id}/acks"),
                                  body={"batch_ids": list(batch_ids)}, timeout_s=30)
