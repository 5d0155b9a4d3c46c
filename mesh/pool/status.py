"""The pool's own small HTTP server: `/healthz`, `/v1/status` (JSON) and Prometheus `/metrics`.

It is what operators and tests look at (which version each engine serves, whether the pool may
lease, what it has submitted), and the endpoint the gateway probes for the pool's RTT.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deltamesh.http import json_errors


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
