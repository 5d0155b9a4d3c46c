"""The pool's own small HTTP server: `/healthz`, `/v1/status` (JSON) and Prometheus `/metrics`.

It is what operators and tests look at (which version each engine serves, whether the pool may
lease, what it has submitted), and the endpoint the gateway probes for the pool's RTT.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deltamesh.gateway.http import json_errors, parse_listen


def status_app(status: Callable[[], dict[str, Any]], registry: CollectorRegistry) -> web.Application:
    app = web.Application(middlewares=[json_errors])
    routes = web.RouteTableDef()

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    @routes.get("/v1/status")
    async def status_json(request: web.Request) -> web.Response:
        return web.json_response(status())

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.add_routes(routes)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application, listen: str) -> AsyncIterator[str]:
    """Serve `app` on `listen` (HOST:PORT, port 0 for any) inside the running loop; yields its base URL."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        shown = "127.0.0.1" if bound_host in ("0.0.0.0", "::") else bound_host
        yield f"http://{shown}:{bound_port}"
    finally:
        await runner.cleanup()
