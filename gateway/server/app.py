"""The regional gateway's HTTP server: builds the aiohttp application and runs it on uvloop.

`create_app(config)` wires a `Gateway` (store, registry, links, metrics, relay) to the version and
control routes behind the route policy (`deltamesh.gateway.server.auth_policy`: every caller identified
before a handler runs) and hooks its background tasks to the application's lifecycle;
`run_gateway(config)` serves it, over HTTPS when `config.tls` has a certificate, until
SIGINT/SIGTERM, its connections held to a header-read timeout and a per-address cap (`connection_guard`)
and sent with the congestion control its config names (`deltamesh.congestion`). Tests and benchmarks
may run `create_app` in-process (`ssl_context(config)` for their socket) or start `deltamesh gateway` as
a real process.
"""

from __future__ import annotations

import ssl

from aiohttp import web

from deltamesh.auth import auth_middleware
from deltamesh.congestion import set_congestion
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.auth_policy import gateway_policy
from deltamesh.gateway.server.routes_control import ControlRoutes
from deltamesh.gateway.server.routes_staging import StagingRoutes
from deltamesh.gateway.server.routes_statements import StatementRoutes
from deltamesh.gateway.server.routes_versions import VersionRoutes
from deltamesh.gateway.server.service import Gateway
from deltamesh.http import json_errors, listen_socket, parse_listen, serve
from deltamesh.http_guard import ConnectionGuard, ConnectionLimits
from deltamesh.tls import server_context

GATEWAY_KEY = web.AppKey("gateway", Gateway)


def route_table(gw: Gateway) -> list[web.RouteDef]:
    """Every route the gateway serves, each a named handler of its plane's routes class."""
    return VersionRoutes(gw).table() + StatementRoutes(gw).table() + ControlRoutes(gw).table() + \
        StagingRoutes(gw).table()


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway as an aiohttp application. Raises ValueError (TokenError, TlsError) when it could not
    serve safely: no credentials to check and not `anonymous`, or a tokens file that does not load."""
    gw = Gateway(config)
    policy = gateway_policy(config, denied=lambda status: gw.metrics.rejected.labels(str(status)).inc())
    # Piece bodies are read as streams with their own limits; this only bounds aiohttp's own reads.
    app = web.Application(middlewares=[json_errors, auth_middleware(policy)],
                          client_max_size=config.max_piece_bytes + 1024)
    app[GATEWAY_KEY] = gw
    app.add_routes(route_table(gw))

    async def start(_app: web.Application) -> None:
        await gw.start()

    async def stop(_app: web.Application) -> None:
        await gw.stop()

    async def release_waiters(_app: web.Application) -> None:
        gw.store.close()

    app.on_startup.append(start)
    app.on_shutdown.append(release_waiters)  # runs before aiohttp waits for in-flight requests
    app.on_cleanup.append(stop)
    return app


def ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """What the gateway's socket listens with: TLS (mTLS with a client CA) or, without a cert, plain HTTP."""
    return server_context(config.tls)


def run_gateway(config: GatewayConfig) -> int:
    """Serve until SIGINT/SIGTERM and return the exit status for it (130, 143); raises ValueError (as
    `create_app`) before listening when it cannot."""
    host, port = parse_listen(config.listen)
    sock = listen_socket(host, port)  # first: a port in use fails before the store or tokens are opened
    try:
        set_congestion(sock, config.congestion)  # accepted connections inherit it: every piece sent uses it
        app = create_app(config)
    except BaseException:
        sock.close()
        raise
    return serve(app, host, port, ssl_context=ssl_context(config), sock=sock, what=f"gateway {config.region}",
                 guard=connection_guard(config, app))


def connection_guard(config: GatewayConfig, app: web.Application) -> ConnectionGuard:
    """The limits the gateway's connections are held to (`deltamesh.http_guard`), its drops counted."""
    metrics = app[GATEWAY_KEY].metrics
    return ConnectionGuard(ConnectionLimits(config.header_timeout_s, config.max_connections_per_address),
                           on_drop=lambda reason: metrics.dropped.labels(reason).inc())
