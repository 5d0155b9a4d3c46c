"""The rollout pools' client of the broker: lease tasks, submit trajectories.

A pool leases tasks (`lease`), generates `n_samples` trajectories per task with the lease's id as
their group id, and submits them (`submit`) in the binary layout of `deltamesh.data`. A
submission is acknowledged only once it is durable, and resubmitting the same trajectory ids is
harmless, so on a 503 or a lost connection a pool simply submits again (`retries`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from deltamesh.http import HttpError, client_session, request_bytes, request_json
from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, Trajectory, encode_trajectories

log = logging.getLogger(__name__)


@dataclass
class TaskLease:
    """A task leased to this pool until `deadline` (unix time); submit its samples under `group_id`."""

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


class PoolClient:
    def __init__(self, broker_url: str, *, pool: str, region: str = "", gpus: int = 1, connections: int = 8):
        self.base = broker_url.rstrip("/")
        self.pool = pool
        self.region = region
        self.gpus = gpus
        self._session = client_session(connections=connections, timeout_s=300.0)

    async def __aenter__(self) -> PoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def lease(self, max_tasks: int = 1) -> list[TaskLease]:
        """Up to `max_tasks` tasks; an empty list when none is available right now."""
        body = {"pool": self.pool, "region": self.region, "gpus": self.gpus, "max_tasks": max_tasks}
        answer = await request_json(self._session, "POST", f"{self.base}/v1/leases", body=body, timeout_s=60)
        return [TaskLease(**item) for item in answer["leases"]]

    async def status(self) -> dict[str, Any]:
        """The broker's status: each model's trainer version and buffers, and the tasks' progress."""
        return await request_json(self._session, "GET", f"{self.base}/v1/status", timeout_s=30)

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
                raw = await request_bytes(self._session, "POST", f"{self.base}/v1/trajectories", data=data,
                                          headers=headers, timeout_s=120)
                answer = json.loads(raw)
                return SubmitResult(answer["accepted"], answer["duplicates"])
            except HttpError as e:
                if e.status not in (0, 503) or attempt >= retries:
                    raise
                attempt += 1
                log.warning("submission to %s failed (%s); retrying", self.base, e)
                await asyncio.sleep(retry_delay_s)
