"""The broker's HTTP API (aiohttp): pools lease tasks and submit trajectories, trainers report versions
and step timings and long-poll batches, operators read status, the balance report and /metrics.

Every route is authenticated (`ROUTES`: roles per route, enforced by `deltamesh.auth` before any
handler runs; 401 without a known credential, 403 for a wrong role, model or pool name) unless the
broker runs `anonymous`. Tokens come from a hashed tokens file that is re-read when it changes.

The handlers (routes.py, one named method a route) only parse, check and translate: the broker's
errors map to statuses (400 malformed or conflicting data, 403 a trajectory for another pool's lease,
404 unknown model or batch id, 409 a version going backwards, a trajectory claiming a version too far
ahead, or a trajectory id reused with other content, 413 body too large, 503 store unavailable),
always as `{"error": reason}`.
Several brokers may share one PostgreSQL database (slot.py, leadership.py): a standby answers every
`/v1/` route with 503, `Retry-After` and the active broker's URL in `X-Broker-Leader` (and in the body's
`leader`), so that clients fail over to it. Endpoints are documented in docs/api/broker.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path
from typing import Callable

from aiohttp import web

from deltamesh.auth import OPEN, Policy, auth_middleware
from deltamesh.http import json_errors, parse_listen
from deltamesh.http_guard import ConnectionGuard, ConnectionLimits
from deltamesh.mesh.broker.auth_tokens import broker_token_store
from deltamesh.mesh.broker.backends import is_postgres
from deltamesh.mesh.broker.backends import open_store as open_db
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.metrics import BrokerMetrics
from deltamesh.mesh.broker.routes import BrokerRoutes
from deltamesh.mesh.broker.service import Broker
from deltamesh.mesh.broker.slot import BrokerSlot
from deltamesh.mesh.broker.store_interface import (
    BrokerStore,
    LeaderTerm,
)
from deltamesh.tokens import TokenStore

log = logging.getLogger(__name__)

SLOT_KEY = web.AppKey("broker", BrokerSlot)
TOKENS_KEY = web.AppKey("tokens", TokenStore)

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

    app.add_routes(BrokerRoutes(config, slot, metrics).table())
    return app
