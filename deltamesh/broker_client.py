"""`BrokerClient`: the one place that knows the dataflow broker's `/v1/` URLs (see docs/api/broker.md).

Pools lease tasks and submit trajectories, trainers report versions and step timings, poll batches
and acknowledge them, the autoscaler and the demo read the status and the balance report: all
through this client, which builds every path, speaks the binary trajectory/batch layout of
`deltamesh.data` and raises `HttpError` with the broker's reason. It keeps no delivery bookkeeping:
the trainer's at-least-once batch stream (`deltamesh.trainer.batch_client.BatchClient`) does that on top.

Several brokers (one active, the others standby) are one client: given several URLs it sends every
call to the broker it last reached, and on a lost connection or a 503 it moves on, to the broker
that a standby names as its leader (`X-Broker-Leader`) when that is one of its own URLs, else to the
next one, retrying with a short backoff until `failover_s` have passed. It never follows a leader it
was not configured with: that would carry its bearer token to a host no one vouched for. Retrying
any call is safe: a submission is acknowledged only once durable and resubmitting the same
trajectory ids is harmless, acknowledgements and equal version reports repeat harmlessly, a batch
poll carries the trainer's acknowledgements and held batches again, and an unused lease expires.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from deltamesh.config import split_urls
from deltamesh.data import TRAJECTORIES_CONTENT_TYPE, Trajectory, encode_trajectories
from deltamesh.http import HttpError, bearer, client_session, request_bytes, request_json
from deltamesh.tls import TlsSettings, check_token_transport

log = logging.getLogger(__name__)
T = TypeVar("T")


STATUS_PATH = "/v1/status"
"""A service's status (GET): the broker's, and likewise a pool's and the evaluator's (`deltamesh.metrics`)."""
BALANCE_PATH = "/v1/balance"
"""The broker's report that drives the autoscaler (GET, admin)."""
EVALS_PATH = "/v1/evals"
"""The evaluator's scored versions (GET) and where an admin asks it to score one more (POST)."""


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


LEADER_HEADER = "X-Broker-Leader"
"""The header of a standby broker's 503 that names the active broker's base URL (empty: unknown)."""

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0


class HeldBack(Exception):
    """No lease for a pool serving a model more than the broker's `policies.max_staleness` behind that
    model's training_version: what it would generate is stale before a batch takes it. The broker
    raises it (and answers 200 with no leases and `held_back`), the client raises it again for the pool.
    `training_versions` names, per such model, the version to serve before asking again."""

    def __init__(self, training_versions: dict[str, int], reason: str):
        super().__init__(reason)
        self.training_versions = training_versions


class BrokerClient:
    """Calls to the broker at `urls` (one URL, several separated by commas, or a sequence of them; see
    the module's docstring for how it fails over) with the caller's `token` (its role and name are
    the token's), over TLS as `tls` says for https:// URLs. A pool names itself (`pool`, `region`,
    `gpus`) for leases and submissions; a trainer passes the model_id to each of its calls. A call
    that finds no broker willing to answer within `failover_s` raises its last HttpError (0: at the
    first failure, though the next call still goes to the next broker). Close it (or use `async with`).

    Raises TlsError at once if the token would travel in clear text to a host that is not loopback,
    ValueError if `urls` names none."""

    def __init__(self, urls: str | Sequence[str], *, token: str = "", tls: TlsSettings | None = None,
                 pool: str = "", region: str = "", gpus: int = 1, connections: int = 8,
                 timeout_s: float | None = 300.0, failover_s: float = 60.0) -> None:
        self.urls = split_urls(urls)
        if not self.urls:
            raise ValueError(f"no broker URL in {urls!r}")
        self.pool = pool
        self.region = region
        self.gpus = gpus
        self.failover_s = failover_s
        self._current = 0
        self._not_followed: set[str] = set()
        if token:
            for url in self.urls:
                check_token_transport(url, tls.insecure if tls is not None else False)
        headers = bearer(token) if token else None
        self._session = client_session(connections=connections, timeout_s=timeout_s, tls=tls, headers=headers)

    @property
    def base(self) -> str:
        """The broker's URL that calls go to now."""
        return self.urls[self._current]

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _call(self, request: Callable[..., Awaitable[T]], method: str, path: str, **kwargs: Any) -> T:
        """`request` (`request_json` or `request_bytes`) against the current broker, failing over on
        a lost connection or a 503 until `failover_s` have passed; any other error raises at once."""
        deadline: float | None = None
        delay = RETRY_FIRST_S
        while True:
            at = self._current
            try:
                return await request(self._session, method, f"{self.urls[at]}{path}", **kwargs)
            except HttpError as e:
                if e.status not in (0, 503):
                    raise
                self._fail_over(at, e)  # even when giving up: the caller's next call goes elsewhere
                now = time.monotonic()
                deadline = now + self.failover_s if deadline is None else deadline
                if now >= deadline:
                    raise
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, RETRY_MAX_S)

    def _fail_over(self, failed: int, error: HttpError) -> None:
        """Move on from broker `failed`, unless a concurrent call already did."""
        if self._current != failed:
            return
        leader = error.headers.get(LEADER_HEADER, "").strip().rstrip("/") if error.status == 503 else ""
        if leader in self.urls:
            nxt = self.urls.index(leader)
        else:
            if leader and leader not in self._not_followed:
                # Never follow it: our bearer token would go to a host the operator did not name.
                self._not_followed.add(leader)
                log.warning("broker %s names %s as its leader, which is not one of the configured brokers; "
                            "not following it", self.urls[failed], leader)
            nxt = (failed + 1) % len(self.urls)
        if nxt != failed:
            log.warning("broker %s failed (%s); switching to %s", self.urls[failed], error, self.urls[nxt])
        self._current = nxt

    # -- anyone -----------------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """Each model's trainer version and buffers, and the tasks' progress."""
        return await self._call(request_json, "GET", STATUS_PATH, timeout_s=30)

    async def balance(self) -> dict[str, Any]:
        """The report that drives the autoscaler: trainer waits and pool throughput per model."""
        return await self._call(request_json, "GET", BALANCE_PATH, timeout_s=30)

    # -- pools ------------------------------------------------------------------------------------------
    async def lease(self, max_tasks: int = 1, served: Mapping[str, int] | None = None) -> list[TaskLease]:
        """Up to `max_tasks` tasks; an empty list when none is available right now. `served`: the version
        of each model this pool generates with; HeldBack if one is beyond the broker's staleness bound."""
        body: dict[str, Any] = {"pool": self.pool, "region": self.region, "gpus": self.gpus, "max_tasks": max_tasks}
        if served:
            body["served"] = dict(served)
        answer = await self._call(request_json, "POST", "/v1/leases", body=body, timeout_s=60)
        if answer.get("held_back"):
            raise HeldBack({str(m): int(v) for m, v in answer["held_back"].items()}, str(answer.get("reason", "")))
        return [TaskLease(**item) for item in answer["leases"]]

    async def submit(self, trajectories: Sequence[Trajectory]) -> SubmitResult:
        """Submit trajectories (tagged with this pool and region if they are not yet); returns once durable."""
        for t in trajectories:
            t.pool = t.pool or self.pool
            t.region = t.region or self.region
        raw = await self._call(request_bytes, "POST", "/v1/trajectories", data=encode_trajectories(trajectories),
                               headers={"Content-Type": TRAJECTORIES_CONTENT_TYPE}, timeout_s=120)
        answer = json.loads(raw)
        return SubmitResult(answer["accepted"], answer["duplicates"])

    # -- trainers ---------------------------------------------------------------------------------------
    async def report_version(self, model_id: str, version: int) -> dict[str, Any]:
        """The trainer of `model_id` now holds `version` (registers the model_id if the broker allows)."""
        return await self._call(request_json, "POST", f"/v1/models/{model_id}/version",
                                body={"version": version}, timeout_s=30)

    async def report_step(self, model_id: str, wait_s: float, step_s: float) -> dict[str, Any]:
        """One training step's timings: seconds spent waiting for its batch and the whole step's length."""
        return await self._call(request_json, "POST", f"/v1/models/{model_id}/steps",
                                body={"wait_s": wait_s, "step_s": step_s}, timeout_s=30)

    async def poll_batch(self, model_id: str, body: dict[str, Any], *, timeout_s: float) -> bytes:
        """Long-poll one batch (`size`, `version`, `timeout_s`, `ack`, `held`); empty bytes when none came."""
        return await self._call(request_bytes, "POST", f"/v1/models/{model_id}/batch",
                                data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                timeout_s=timeout_s)

    async def ack_batches(self, model_id: str, batch_ids: Sequence[str]) -> dict[str, list[str]]:
        """Acknowledge batches: `{"acked", "already_acked", "requeued"}`."""
        return await self._call(request_json, "POST", f"/v1/models/{model_id}/acks",
                                body={"batch_ids": list(batch_ids)}, timeout_s=30)
