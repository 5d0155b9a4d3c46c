"""The regional gateway's HTTP server: builds the aiohttp application and runs it on uvloop.

`create_app(config)` wires a `Gateway` (store, registry, links, metrics, relay) to the version and
control routes and hooks its background tasks to the application's lifecycle; `run_gateway(config)`
serves it until SIGINT/SIGTERM. Tests and benchmarks may run `create_app` in-process or start
`deltamesh gateway` as a real process.
"""

from __future__ import annotations

from aiohttp import web

from deltamesh.gateway.config import GatewayConfig
from deltamesh.http import json_errors, parse_listen, serve
from deltamesh.gateway.routes_control import add_control_routes
from deltamesh.gateway.routes_versions import add_version_routes
from deltamesh.gateway.service import Gateway

GATEWAY_KEY = web.AppKey("gateway", Gateway)


def create_app(config: GatewayConfig) -> web.Application:
    gw = Gateway(config)
    # Piece bodies are read as streams with their own limits; this only bounds aiohttp's own reads.
    app = web.Application(middlewares=[json_errors], client_max_size=config.max_piece_bytes + 1024)
    app[GATEWAY_KEY] = gw
    add_version_routes(app, gw)
    add_control_routes(app, gw)

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


def run_gateway(config: GatewayConfig) -> None:
    host, port = parse_listen(config.listen)
    serve(create_app(config), host, port)
