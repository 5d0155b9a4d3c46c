"""The broker's HTTP API (aiohttp): pools lease tasks and submit trajectories, trainers report versions
and step timings and long-poll batches, operators read status, the balance report and /metrics.

Every route is authenticated (`ROUTES`: roles per route, enforced by `deltamesh.auth` before any
handler runs; 401 without a known credential, 403 for a wrong role, model or pool name) unless the
broker runs `anonymous`. Tokens come from a hashed tokens file that is re-read when it changes.

Handlers only parse, check and translate: the broker's errors map to statuses here (400 malformed or
conflicting data, 403 a trajectory for another pool's lease, 404 unknown model or batch id, 409 a
version going backwards, a trajectory claiming a version too far ahead, or a trajectory id reused with
other content, 413 body too large, 503 store unavailable), always as `{"error": reason}`.
Several brokers may share one PostgreSQL database (slot.py, leadership.py): a standby answers every
`/v1/` route with 503, `Retry-After` and the active broker's URL in `X-Broker-Leader` (and in the body's
`leader`), so that clients fail over to it. Endpoints are documented in docs/api/broker.md.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltamesh.auth import OPEN, Policy, auth_middleware, identity, require_name
from deltamesh.broker_client import LEADER_HEADER  # on a standby's 503: where its clients fail over to
from deltamesh.data import BATCH_CONTENT_TYPE, TRAJECTORIES_CONTENT_TYPE, DataFormatError, decode_trajectories
from deltamesh.http import error_response, json_errors, parse_json, parse_listen, read_body, read_json
from deltamesh.http_guard import ConnectionGuard, ConnectionLimits
from deltamesh.mesh.broker.auth_tokens import broker_token_store
from deltamesh.mesh.broker.backends import is_postgres
from deltamesh.mesh.broker.backends import open_store as open_db
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.delivery import UnknownBatch
from deltamesh.mesh.broker.json_form import trajectories_from_json
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.service import Broker, HeldBack, UnknownModel, VersionAhead, VersionConflict
from deltamesh.mesh.broker.slot import BrokerSlot, Standby
from deltamesh.mesh.broker.store_interface import (
    BrokerStore,
    IdConflict,
    LeaderTerm,
    LeaseNotHeld,
    StoreConflict,
    StoreUnavailable,
)
from deltamesh.tokens import TokenStore

log = logging.getLogger(__name__)

SLOT_KEY = web.AppKey("broker", BrokerSlot)
TOKENS_KEY = web.AppKey("tokens", TokenStore)
MAX_VERSION = 2**53  # versions travel as JSON numbers: beyond this they are not exact anywhere

# Who may call each route (deltamesh.auth refuses anything not listed). A pool acts under its own
# name only; a trainer only for the model ids of its token; admins read everything and run the
# autoscaler; Prometheus scrapes /metrics with a metrics token.
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("POST", "/v1/trajectories"): ("pool",),
    ("POST", "/v1/leases"): ("pool",),
    ("GET", "/v1/leases"): ("pool", "admin"),
    ("POST", "/v1/models/{model_id}/version"): ("trainer",),
    ("POST", "/v1/models/{model_id}/steps"): ("trainer",),
    ("POST", "/v1/models/{model_id}/batch"): ("trainer",),
    ("POST", "/v1/models/{model_id}/acks"): ("trainer",),
    ("GET", "/v1/status"): ("pool", "trainer", "admin", "metrics"),
    ("GET", "/v1/balance"): ("admin",),
    ("GET", "/metrics"): ("metrics", "admin"),
    ("GET", "/healthz"): OPEN,
}
RETRY_AFTER_S = "1"
MAX_BATCH_IDS = 10_000  # in one ack or held list: far more than a trainer holds between checkpoints


_REQUIRED = object()


def _field(body: Any, key: str, kind: type, default: Any = _REQUIRED, *, minimum: float | None = None) -> Any:
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


def _batch_ids(body: Any, key: str, default: Any = _REQUIRED) -> list[str]:
    """A list of batch ids, or HTTP 400 naming the field."""
    value = _field(body, key, list, default)
    if len(value) > MAX_BATCH_IDS or not all(isinstance(v, str) and 0 < len(v) <= 128 for v in value):
        raise web.HTTPBadRequest(reason=f"{key} must list at most {MAX_BATCH_IDS} batch ids (strings of 1..128 chars)")
    return value


def _errors(fn: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
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
            request.app[SLOT_KEY].metrics.rejected.labels(str(e.status)).inc()
            raise
        except Exception:  # a bug: json_errors answers 500, and it counts for the broker-5xx alert
            request.app[SLOT_KEY].metrics.rejected.labels("500").inc()
            raise
        request.app[SLOT_KEY].metrics.rejected.labels(str(resp.status)).inc()
        return resp
    return handler


def _bind_to_pool(request: web.Request, trajectories: list) -> None:
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


def _broker_slot(config: BrokerConfig, db: str | Path | None, open_store: Callable[[], BrokerStore] | None,
                 metrics: BrokerMetrics) -> BrokerSlot:
    """One always-active broker on an embedded store; on PostgreSQL, one that serves while it leads."""
    if open_store is not None:
        given = open_store
        return BrokerSlot(lambda term: Broker(config, given, metrics=metrics), metrics)
    if db is None:
        raise ValueError("build_app needs db or open_store")
    where = str(db)
    if not is_postgres(where):
        return BrokerSlot(lambda term: Broker(config, lambda: open_db(where, durability=config.durability),
                                              metrics=metrics), metrics)

    def make_broker(term: LeaderTerm | None) -> Broker:
        return Broker(config, lambda: open_db(where, durability=config.durability, term=term), metrics=metrics)

    from deltamesh.mesh.broker.leadership import Leadership  # psycopg: only for brokers on PostgreSQL
    from deltamesh.mesh.broker.postgres_schema import migrate

    holder = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
    leadership = Leadership(where, holder, config.leader.url or _own_url(config), config.leader,
                            prepare=lambda: migrate(where))
    return BrokerSlot(make_broker, metrics, leadership)


def _own_url(config: BrokerConfig) -> str:
    host, port = parse_listen(config.listen)
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()
        log.warning("leader.url is not set: standbys will name this broker %s:%d to clients", host, port)
    scheme = "https" if config.tls.cert else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def connection_guard(config: BrokerConfig, app: web.Application) -> ConnectionGuard:
    """The limits the broker's connections are held to (`deltamesh.http_guard`), its drops counted."""
    metrics = app[SLOT_KEY].metrics
    return ConnectionGuard(ConnectionLimits(config.header_timeout_s, config.max_connections_per_address),
                           on_drop=lambda reason: metrics.dropped.labels(reason).inc())


def build_app(config: BrokerConfig, db: str | Path | None = None, *,
              open_store: Callable[[], BrokerStore] | None = None) -> web.Application:
    """The broker as an aiohttp application; the store opens on start-up and closes on clean-up.

    On a PostgreSQL `db` the process is one of possibly several brokers on that database: it serves
    only while it holds the leadership lease, and answers 503 naming the active broker otherwise."""
    tokens = broker_token_store(config, db)
    if config.anonymous:
        log.warning("broker serves without authentication (anonymous = true): every caller may do anything")
    metrics = BrokerMetrics()
    slot = _broker_slot(config, db, open_store, metrics)
    policy = Policy(ROUTES, tokens, enabled=not config.anonymous,
                    denied=lambda status: metrics.rejected.labels(str(status)).inc())
    app = web.Application(middlewares=[json_errors, auth_middleware(policy)], client_max_size=config.max_body_bytes)
    app[SLOT_KEY] = slot
    app[TOKENS_KEY] = tokens

    async def on_startup(app: web.Application) -> None:
        await slot.start()

    async def on_cleanup(app: web.Application) -> None:
        await slot.close()
        tokens.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    routes = web.RouteTableDef()

    @routes.post("/v1/trajectories")
    @_errors
    async def submit(request: web.Request) -> web.Response:
        raw = await read_body(request, limit=config.max_body_bytes)
        limits = {"max_trajectories": config.max_trajectories_per_submission, "max_tokens": config.max_tokens}
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
        _bind_to_pool(request, trajectories)
        result = await slot.current().submit(trajectories)
        return web.json_response({"accepted": result.accepted, "duplicates": result.duplicates})

    @routes.post("/v1/leases")
    @_errors
    async def lease(request: web.Request) -> web.Response:
        body = await read_json(request)
        pool = _field(body, "pool", str)
        region = _field(body, "region", str, "")
        if not 0 < len(pool) <= 256 or len(region) > 256:
            raise web.HTTPBadRequest(reason="pool must be 1..256 characters, region at most 256")
        require_name(request, pool)
        gpus = _field(body, "gpus", int, 1, minimum=0)
        max_tasks = _field(body, "max_tasks", int, 1, minimum=1)
        served = _field(body, "served", dict, {})
        if len(served) > 256 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                        for v in served.values()):
            raise web.HTTPBadRequest(reason="served must map model ids to versions (ints >= 0)")
        who = identity(request)
        broker = slot.current()
        try:
            # A pool token's leases under every name it may use (NAME.SUFFIX too) share its in-flight bound.
            leases = await broker.lease(pool, region, gpus, max_tasks, who.name if who is not None else None, served)
        except HeldBack as e:  # not an error: the pool waits for the version named, then asks again
            return web.json_response({"leases": [], "tasks": broker.status()["tasks"], "reason": str(e),
                                      "held_back": e.training_versions})
        return web.json_response({"leases": leases, "tasks": broker.status()["tasks"]})

    @routes.get("/v1/leases")
    @_errors
    async def list_leases(request: web.Request) -> web.Response:
        broker = slot.current()
        who = identity(request)
        pool = who.name if who is not None and who.role == "pool" else request.query.get("pool")
        return web.json_response({"leases": broker.leases(pool)})

    @routes.post("/v1/models/{model_id}/version")
    @_errors
    async def version(request: web.Request) -> web.Response:
        body = await read_json(request)
        v = _field(body, "version", int, minimum=0)
        if v >= MAX_VERSION:
            raise web.HTTPBadRequest(reason=f"version must be below 2**53, got {v}")
        return web.json_response(await slot.current().report_version(request.match_info["model_id"], v))

    @routes.post("/v1/models/{model_id}/steps")
    @_errors
    async def steps(request: web.Request) -> web.Response:
        body = await read_json(request)
        wait_s = _field(body, "wait_s", float, minimum=0)
        step_s = _field(body, "step_s", float, minimum=0)
        if wait_s > step_s:
            raise web.HTTPBadRequest(reason="wait_s cannot exceed step_s")
        return web.json_response(slot.current().report_step(request.match_info["model_id"], wait_s, step_s))

    @routes.post("/v1/models/{model_id}/batch")
    @_errors
    async def batch(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        size = _field(body, "size", int, minimum=1)
        v = _field(body, "version", int, None, minimum=0)
        timeout_s = min(_field(body, "timeout_s", float, 30.0, minimum=0), config.max_poll_s)
        ack, held = _batch_ids(body, "ack", []), _batch_ids(body, "held", [])
        # A poller that has gone away (its connection closed) takes no batch it could never receive.
        served = await slot.current().next_batch(request.match_info["model_id"], size, v, timeout_s, ack=ack, held=held,
                                         alive=lambda: request.transport is not None)
        if served is None:
            return web.Response(status=204)
        batch_id, data = served
        return web.Response(body=data, content_type=BATCH_CONTENT_TYPE, headers={"X-Batch-Id": batch_id})

    @routes.post("/v1/models/{model_id}/acks")
    @_errors
    async def acks(request: web.Request) -> web.Response:
        body = await read_json(request)
        result = await slot.current().ack(request.match_info["model_id"], _batch_ids(body, "batch_ids"))
        return web.json_response(result.as_json())

    @routes.get("/v1/status")
    @_errors
    async def status(request: web.Request) -> web.Response:
        return web.json_response(slot.current().status())

    @routes.get("/v1/balance")
    @_errors
    async def balance(request: web.Request) -> web.Response:
        return web.json_response(slot.current().balance())

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, **slot.role()})

    @routes.get("/metrics")
    async def prometheus(request: web.Request) -> web.Response:
        try:
            slot.current().balance()  # refresh the report's gauges
        except Standby:
            pass  # a standby still shows its own counters and that it is not active
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.add_routes(routes)
    return app
