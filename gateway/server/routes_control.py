"""HTTP routes of the control plane: health, metrics, pool registry, links and downstream announcements.

Who may call each route is decided before a handler runs (`deltamesh.gateway.server.auth_policy`); the
handlers here bind names: a pool registers, heartbeats and deregisters only as itself, and a gateway
announces only itself (`require_name`; an admin may deregister any pool). Bodies are checked field
by field (`deltamesh.gateway.server.registry`) and a refusal changes nothing. Announcements are bounded and
expire (`deltamesh.gateway.server.downstreams`). See docs/api/gateway.md.
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from deltamesh.auth import identity, require_name
from deltamesh.gateway.server.downstreams import TooManyDownstreams
from deltamesh.gateway.server.registry import MAX_ENDPOINT, POOL_NAME_RE, RegistryError
from deltamesh.gateway.server.service import Gateway
from deltamesh.http import error_response, read_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ControlRoutes:
    """The control plane's handlers, one named method each, over one gateway; `table` routes them."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.config

    def table(self) -> list[web.RouteDef]:
        """Every route of the control plane; those a caller may be refused by are counted."""
        return [
            web.get("/healthz", self.healthz),
            web.get("/metrics", self.metrics),
            web.post("/v1/pools", self.counted(self.register_pool)),
            web.post("/v1/pools/{name}/heartbeat", self.counted(self.heartbeat)),
            web.delete("/v1/pools/{name}", self.counted(self.deregister)),
            web.get("/v1/pools", self.list_pools),
            web.get("/v1/links", self.links),
            web.post("/v1/gateways", self.counted(self.announce)),
        ]

    def counted(self, handler: Handler) -> Handler:
        """Count every refusal of a handler (a 4xx it answers or raises) in the rejected-requests metric."""
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                self.gw.metrics.rejected.labels(str(e.status)).inc()
                raise
            if resp.status >= 400:
                self.gw.metrics.rejected.labels(str(resp.status)).inc()
            return resp
        return wrapped

    def pool_name(self, request: web.Request) -> str:
        name = request.match_info["name"]
        if not POOL_NAME_RE.match(name):
            raise web.HTTPBadRequest(text=json.dumps({"error": f"invalid pool name {name[:80]!r}"}),
                                     content_type="application/json")
        require_name(request, name)
        return name

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "region": self.cfg.region, "origin": self.cfg.is_origin,
                                  "instance": self.gw.instance, "upstreams": self.cfg.upstreams,
                                  "disk": self.gw.store.disk_state(),
                                  "relay": self.gw.relay.status() if self.gw.relay is not None else None})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.gw.metrics.render(self.gw.store, self.gw.pools, self.gw.links)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def register_pool(self, request: web.Request) -> web.Response:
        body = await read_json(request, limit=64 * 1024)
        who = identity(request)
        if isinstance(body, dict) and isinstance(body.get("name"), str) and POOL_NAME_RE.match(body["name"]):
            require_name(request, body["name"])
            model = body.get("model")
            if who is not None and isinstance(model, str) and model and not who.may_use(model):
                return error_response(403, f"{who.role} {who.name!r} may not act for model {model[:80]!r}")
        try:
            # Only an authenticated pool's endpoint is probed: the gateway connects to no address an
            # anonymous caller names.
            record = self.gw.pools.register(body, probe=who is not None)
        except RegistryError as e:
            return error_response(400, str(e))
        self.gw.links.link(record.name, "pool", record.endpoint)
        return web.json_response({"name": record.name, "region": self.cfg.region,
                                  "heartbeat_timeout_s": self.cfg.heartbeat_timeout_s}, status=201)

    async def heartbeat(self, request: web.Request) -> web.Response:
        name = self.pool_name(request)
        body = await read_json(request, limit=64 * 1024)
        try:
            record = self.gw.pools.heartbeat(name, body)
        except RegistryError as e:
            return error_response(400, str(e))
        if record is None:
            return error_response(404, f"pool {name} is not registered here; register again")
        head = self.gw.store.head(record.model)
        return web.json_response({"name": name, "head": head})

    async def deregister(self, request: web.Request) -> web.Response:
        name = self.pool_name(request)
        if not self.gw.pools.deregister(name):
            return error_response(404, f"pool {name} is not registered here")
        self.gw.links.forget(name, "pool")
        return web.json_response({"name": name, "deregistered": True})

    async def list_pools(self, request: web.Request) -> web.Response:
        return web.json_response({"region": self.cfg.region, "pools": self.gw.pools.describe(self.gw.store.heads())})

    async def links(self, request: web.Request) -> web.Response:
        return web.json_response({"region": self.cfg.region, "links": self.gw.links.describe()})

    async def announce(self, request: web.Request) -> web.Response:
        body = await read_json(request, limit=16 * 1024)
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        region, url = body.get("region"), body.get("url")
        if not isinstance(region, str) or not POOL_NAME_RE.match(region):
            return error_response(400, "region must be a name of letters, digits, '.', '_' and '-'")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_ENDPOINT:
            return error_response(400, f"url must be an http(s) URL of at most {MAX_ENDPOINT} characters")
        require_name(request, region, "gateway")
        try:
            self.gw.announce_downstream(region, url.rstrip("/"), probe=identity(request) is not None)
        except TooManyDownstreams as e:
            return error_response(429, str(e))
        return web.json_response({"region": self.cfg.region, "ttl_s": self.cfg.downstream_ttl_s})
