"""What every deltamesh process exposes at `/metrics` beside its own figures.

Each service keeps its metrics in a `CollectorRegistry` of its own (several gateways, brokers or
pools may share a test process), so prometheus-client's default registry, which carries the process
metrics, is never scraped: `service_registry` adds them (`process_cpu_seconds_total`,
`process_resident_memory_bytes`, ...) and `deltamesh_build_info{version,role,python}` to a fresh one.

Importing this module also turns off the `_created` series prometheus-client adds next to every
counter and histogram: Prometheus derives resets itself, and the extra series doubled what each
scrape stored for nothing.

`status_app` is the small HTTP server of a process that has no API of its own (a pool, `pool sync`,
a trainer): `/healthz`, `/metrics` and, where given, `/v1/status` (JSON). It is what operators,
Prometheus and tests look at, and what a gateway probes for a pool's RTT; it serves no secret and
changes nothing, so it takes no token: bind it where the scraper can reach it.
"""

from __future__ import annotations

import platform
from typing import Any, Callable

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from deltamesh import __version__
from deltamesh.http import json_errors

disable_created_metrics()


def service_registry(role: str) -> CollectorRegistry:
    """A registry for one `role` (gateway, broker, pool, pool-sync) with process and build metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Gauge("deltamesh_build_info", "Always 1; the labels say what is running",
          ["version", "role", "python"], registry=registry).labels(__version__, role, platform.python_version()).set(1)
    return registry


def status_app(registry: CollectorRegistry, status: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    """`/healthz`, `/metrics` of `registry`, and `/v1/status` answering `status()` when given."""
    app = web.Application(middlewares=[json_errors])
    routes = web.RouteTableDef()

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    if status is not None:
        @routes.get("/v1/status")
        async def status_json(request: web.Request) -> web.Response:
            return web.json_response(status())

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.add_routes(routes)
    return app
