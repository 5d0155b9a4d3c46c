"""HTTP routes of the control plane: health, metrics, pool registry, links and downstream announcements.

Pools register and heartbeat with their region's bearer token (unknown tokens get 401); listings of
pools and links are open to read, like `/metrics`. See docs/api/gateway.md.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from deltamesh.http import error_response, read_json
from deltamesh.gateway.registry import POOL_NAME_RE, RegistryError
from deltamesh.gateway.service import Gateway

MAX_DOWNSTREAMS = 256
"""Announcements need no token, so their number is bounded."""


def _authorized(gw: Gateway, request: web.Request) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not token:
        return False
    # Compare against every token so the time taken says nothing about which one nearly matched.
    ok = False
    for known in gw.config.pool_tokens:
        ok |= hmac.compare_digest(token.encode(), known.encode())
    return ok


def add_control_routes(app: web.Application, gw: Gateway) -> None:
    cfg = gw.config
    routes = web.RouteTableDef()

    def unauthorized() -> web.Response:
        gw.metrics.rejected.labels("401").inc()
        return error_response(401, "unknown or missing pool token")

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "region": cfg.region, "origin": cfg.is_origin,
                                  "instance": gw.instance, "upstreams": cfg.upstreams})

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        body = gw.metrics.render(gw.store, gw.pools, gw.links)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.post("/v1/pools")
    async def register_pool(request: web.Request) -> web.Response:
        if not _authorized(gw, request):
            return unauthorized()
        body = await read_json(request, limit=64 * 1024)
        try:
            record = gw.pools.register(body)
        except RegistryError as e:
            return error_response(400, str(e))
        gw.links.link(record.name, "pool", record.endpoint)
        return web.json_response({"name": record.name, "region": cfg.region,
                                  "heartbeat_timeout_s": cfg.heartbeat_timeout_s}, status=201)

    @routes.post("/v1/pools/{name}/heartbeat")
    async def heartbeat(request: web.Request) -> web.Response:
        if not _authorized(gw, request):
            return unauthorized()
        name = request.match_info["name"]
        if not POOL_NAME_RE.match(name):
            return error_response(400, f"invalid pool name {name[:80]!r}")
        body = await read_json(request, limit=64 * 1024)
        try:
            record = gw.pools.heartbeat(name, body)
        except RegistryError as e:
            return error_response(400, str(e))
        if record is None:
            return error_response(404, f"pool {name} is not registered here; register again")
        head = gw.store.head(record.model)
        return web.json_response({"name": name, "head": head})

    @routes.get("/v1/pools")
    async def list_pools(request: web.Request) -> web.Response:
        return web.json_response({"region": cfg.region, "pools": gw.pools.describe(gw.store.heads())})

    @routes.get("/v1/links")
    async def links(request: web.Request) -> web.Response:
        return web.json_response({"region": cfg.region, "links": gw.links.describe()})

    @routes.post("/v1/gateways")
    async def announce(request: web.Request) -> web.Response:
        body = await read_json(request, limit=16 * 1024)
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        region, url = body.get("region"), body.get("url")
        if not isinstance(region, str) or not POOL_NAME_RE.match(region):
            return error_response(400, "region must be a name of letters, digits, '.', '_' and '-'")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 300:
            return error_response(400, "url must be an http(s) URL")
        if region not in gw.downstreams and len(gw.downstreams) >= MAX_DOWNSTREAMS:
            return error_response(429, f"this gateway already follows {MAX_DOWNSTREAMS} downstream gateways")
        gw.add_downstream(region, url.rstrip("/"))
        return web.json_response({"region": cfg.region})

    app.add_routes(routes)
