"""The broker's request handlers: one named method per route of its HTTP API, and the checks of the
fields they read. Who may call each route is decided before any handler runs (`ROUTES` in server.py,
enforced by `deltamesh.auth`); a handler parses, checks and hands over to the active broker of its slot,
and `errors` maps the broker's exceptions to statuses (see server.py's docstring), counting each refusal.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltamesh.auth import identity, require_name
from deltamesh.broker_client import LEADER_HEADER  # on a standby's 503: where its clients fail over to
from deltamesh.data import BATCH_CONTENT_TYPE, TRAJECTORIES_CONTENT_TYPE, DataFormatError, decode_trajectories
from deltamesh.http import error_response, parse_json, read_body, read_json
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.delivery import UnknownBatch
from deltamesh.mesh.broker.json_form import trajectories_from_json
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.service import HeldBack, UnknownModel, VersionAhead, VersionConflict
from deltamesh.mesh.broker.slot import BrokerSlot, Standby
from deltamesh.mesh.broker.store_interface import IdConflict, LeaseNotHeld, StoreConflict, StoreUnavailable

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RETRY_AFTER_S = "1"
MAX_VERSION = 2**53  # versions travel as JSON numbers: beyond this they are not exact anywhere
MAX_BATCH_IDS = 10_000  # in one ack or held list: far more than a trainer holds between checkpoints

_REQUIRED = object()


def body_field(body: Any, key: str, kind: type, default: Any = _REQUIRED, *, minimum: float | None = None) -> Any:
    """One typed field of a JSON request body (absent or null: `default`), or HTTP 400 naming it."""
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(reason="body must be a JSON object")
    value = body.get(key)
    if value is None:
        if default is _REQUIRED:
            raise web.HTTPBadRequest(reason=f"{key} is required")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is float and not math.isfinite(value)):
        raise web.HTTPBadRequest(reason=f"{key} must be a finite {kind.__name__}, got {value!r:.40}")
    if minimum is not None and value < minimum:
        raise web.HTTPBadRequest(reason=f"{key} must be >= {minimum}")
    return value


def batch_ids(body: Any, key: str, default: Any = _REQUIRED) -> list[str]:
    """A list of batch ids, or HTTP 400 naming the field."""
    value = body_field(body, key, list, default)
    if len(value) > MAX_BATCH_IDS or not all(isinstance(v, str) and 0 < len(v) <= 128 for v in value):
        raise web.HTTPBadRequest(reason=f"{key} must list at most {MAX_BATCH_IDS} batch ids (strings of 1..128 chars)")
    return value


def bind_to_pool(request: web.Request, trajectories: list) -> None:
    """A pool submits under its own name and for the model ids of its token; an unnamed trajectory is
    named after the caller, so the broker never records a pool that did not send it."""
    who = identity(request)
    if who is None:
        return
    for t in trajectories:
        if t.pool and t.pool != who.name and who.role != "admin":
            raise web.HTTPForbidden(reason=f"pool {who.name!r} may not submit for pool {t.pool!r}")
        if not who.may_use(t.model_id):
            raise web.HTTPForbidden(reason=f"pool {who.name!r} may not submit for model {t.model_id!r}")
        t.pool = t.pool or who.name


class BrokerRoutes:
    """The broker's handlers over one slot (the active broker, or a standby's refusal); `table` routes them."""

    def __init__(self, config: BrokerConfig, slot: BrokerSlot, metrics: BrokerMetrics) -> None:
        self.config, self.slot, self.metrics = config, slot, metrics

    def table(self) -> list[web.RouteDef]:
        """Every route of the broker; those that reach the broker answer its errors as statuses."""
        return [
            web.post("/v1/trajectories", self.errors(self.submit)),
            web.post("/v1/leases", self.errors(self.lease)),
            web.get("/v1/leases", self.errors(self.list_leases)),
            web.post("/v1/models/{model_id}/version", self.errors(self.version)),
            web.post("/v1/models/{model_id}/steps", self.errors(self.steps)),
            web.post("/v1/models/{model_id}/batch", self.errors(self.batch)),
            web.post("/v1/models/{model_id}/acks", self.errors(self.acks)),
            web.get("/v1/status", self.errors(self.status)),
            web.get("/v1/balance", self.errors(self.balance)),
            web.get("/healthz", self.healthz),
            web.get("/metrics", self.prometheus),
        ]

    def errors(self, fn: Handler) -> Handler:
        """Map the broker's exceptions to HTTP answers, counting each refusal by status."""
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except IdConflict as e:
                resp = error_response(409, str(e))
            except LeaseNotHeld as e:
                resp = error_response(403, str(e))
            except (DataFormatError, StoreConflict) as e:
                resp = error_response(400, str(e))
            except (UnknownModel, UnknownBatch) as e:
                resp = error_response(404, str(e))
            except (VersionConflict, VersionAhead) as e:
                resp = error_response(409, str(e))
            except StoreUnavailable as e:
                resp = error_response(503, str(e))
                resp.headers["Retry-After"] = RETRY_AFTER_S
            except Standby as e:
                resp = web.json_response({"error": str(e), "leader": e.leader}, status=503,
                                         headers={"Retry-After": RETRY_AFTER_S, LEADER_HEADER: e.leader})
            except web.HTTPException as e:
                self.metrics.rejected.labels(str(e.status)).inc()
                raise
            except Exception:  # a bug: json_errors answers 500, and it counts for the broker-5xx alert
                self.metrics.rejected.labels("500").inc()
                raise
            self.metrics.rejected.labels(str(resp.status)).inc()
            return resp
        return handler

    async def submit(self, request: web.Request) -> web.Response:
        raw = await read_body(request, limit=self.config.max_body_bytes)
        limits = {"max_trajectories": self.config.max_trajectories_per_submission,
                  "max_tokens": self.config.max_tokens}
        if request.content_type == TRAJECTORIES_CONTENT_TYPE:
            trajectories = decode_trajectories(raw, **limits)
        elif request.content_type == "application/json":
            try:
                body = parse_json(raw)
            except ValueError as e:
                raise DataFormatError(f"malformed JSON: {e}") from e
            trajectories = trajectories_from_json(body, **limits)
        else:
            raise DataFormatError(f"Content-Type must be {TRAJECTORIES_CONTENT_TYPE} or application/json, "
                                  f"got {request.content_type!r}")
        bind_to_pool(request, trajectories)
        result = await self.slot.current().submit(trajectories)
        return web.json_response({"accepted": result.accepted, "duplicates": result.duplicates})

    async def lease(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        pool = body_field(body, "pool", str)
        region = body_field(body, "region", str, "")
        if not 0 < len(pool) <= 256 or len(region) > 256:
            raise web.HTTPBadRequest(reason="pool must be 1..256 characters, region at most 256")
        require_name(request, pool)
        gpus = body_field(body, "gpus", int, 1, minimum=0)
        max_tasks = body_field(body, "max_tasks", int, 1, minimum=1)
        served = body_field(body, "served", dict, {})
        if len(served) > 256 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                        for v in served.values()):
            raise web.HTTPBadRequest(reason="served must map model ids to versions (ints >= 0)")
        who = identity(request)
        broker = self.slot.current()
        try:
            # A pool token's leases under every name it may use (NAME.SUFFIX too) share its in-flight bound.
            leases = await broker.lease(pool, region, gpus, max_tasks, who.name if who is not None else None, served)
        except HeldBack as e:  # not an error: the pool waits for the version named, then asks again
            return web.json_response({"leases": [], "tasks": broker.status()["tasks"], "reason": str(e),
                                      "held_back": e.training_versions})
        return web.json_response({"leases": leases, "tasks": broker.status()["tasks"]})

    async def list_leases(self, request: web.Request) -> web.Response:
        broker = self.slot.current()
        who = identity(request)
        pool = who.name if who is not None and who.role == "pool" else request.query.get("pool")
        return web.json_response({"leases": broker.leases(pool)})

    async def version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        v = body_field(body, "version", int, minimum=0)
        if v >= MAX_VERSION:
            raise web.HTTPBadRequest(reason=f"version must be below 2**53, got {v}")
        return web.json_response(await self.slot.current().report_version(request.match_info["model_id"], v))

    async def steps(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        wait_s = body_field(body, "wait_s", float, minimum=0)
        step_s = body_field(body, "step_s", float, minimum=0)
        if wait_s > step_s:
            raise web.HTTPBadRequest(reason="wait_s cannot exceed step_s")
        return web.json_response(self.slot.current().report_step(request.match_info["model_id"], wait_s, step_s))

    async def batch(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        size = body_field(body, "size", int, minimum=1)
        v = body_field(body, "version", int, None, minimum=0)
        timeout_s = min(body_field(body, "timeout_s", float, 30.0, minimum=0), self.config.max_poll_s)
        ack, held = batch_ids(body, "ack", []), batch_ids(body, "held", [])
        # A poller that has gone away (its connection closed) takes no batch it could never receive.
        served = await self.slot.current().next_batch(request.match_info["model_id"], size, v, timeout_s, ack=ack,
                                                      held=held, alive=lambda: request.transport is not None)
        if served is None:
            return web.Response(status=204)
        batch_id, data = served
        return web.Response(body=data, content_type=BATCH_CONTENT_TYPE, headers={"X-Batch-Id": batch_id})

    async def acks(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        result = await self.slot.current().ack(request.match_info["model_id"], batch_ids(body, "batch_ids"))
        return web.json_response(result.as_json())

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.slot.current().status())

    async def balance(self, request: web.Request) -> web.Response:
        return web.json_response(self.slot.current().balance())

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, **self.slot.role()})

    async def prometheus(self, request: web.Request) -> web.Response:
        try:
            self.slot.current().balance()  # refresh the report's gauges
        except Standby:
            pass  # a standby still shows its own counters and that it is not active
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
