"""The evaluator's HTTP server: its results, requests for a version to be scored, status and `/metrics`.

Who may call what (`deltamesh.auth`, with the evaluator's tokens file or client certificates):

| route | roles | |
|---|---|---|
| `GET /healthz` | anyone | liveness |
| `GET /metrics` | metrics, admin | Prometheus |
| `GET /v1/status` | metrics, admin | the version held, the one being scored, requests waiting |
| `GET /v1/evals` | metrics, admin | every scored version: version, weights hash, avg@n, its parts |
| `POST /v1/evals` | admin | `{"version": N}`: score version N too (202; 200 when it is scored already) |

A route missing from `ROUTES` is refused (fail closed). Results are read-only here: only the evaluator
itself writes them, after the check of what its engine serves.
"""

from __future__ import annotations

from typing import Any, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deltamesh.auth import OPEN, Policy, auth_middleware
from deltamesh.http import error_response, json_errors, read_json
from deltamesh.mesh.eval.config import EvalConfig
from deltamesh.mesh.eval.store import EvalStore
from deltamesh.tokens import TokenStore

ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/healthz"): OPEN,
    ("GET", "/metrics"): ("metrics", "admin"),
    ("GET", "/v1/status"): ("metrics", "admin"),
    ("GET", "/v1/evals"): ("metrics", "admin"),
    ("POST", "/v1/evals"): ("admin",),
}


def eval_policy(config: EvalConfig) -> Policy:
    """The route policy: the tokens file and client certificates; none at all when `anonymous`."""
    if config.anonymous:
        return Policy(ROUTES, None, enabled=False)
    return Policy(ROUTES, TokenStore(config.tokens_file or None))


def eval_app(config: EvalConfig, store: EvalStore, registry: CollectorRegistry, *,
             status: Callable[[], dict[str, Any]], request: Callable[[int], bool], heldout: str) -> web.Application:
    """The server's application; `request(version)` asks for a version (False: it is scored already)."""
    app = web.Application(middlewares=[json_errors, auth_middleware(eval_policy(config))])
    routes = web.RouteTableDef()
    model_id = config.model_id

    @routes.get("/healthz")
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    @routes.get("/metrics")
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.get("/v1/status")
    async def status_json(_: web.Request) -> web.Response:
        return web.json_response(status())

    @routes.get("/v1/evals")
    async def results(_: web.Request) -> web.Response:
        return web.json_response({"model_id": model_id, "heldout": heldout,
                                  "results": [r.as_json() for r in store.results(model_id, heldout)]})

    @routes.post("/v1/evals")
    async def ask(req: web.Request) -> web.Response:
        body = await read_json(req)
        version = body.get("version") if isinstance(body, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return error_response(400, 'the body must be {"version": N} with N an integer >= 0')
        if request(version):
            return web.json_response({"version": version, "queued": True}, status=202)
        scored = [r.as_json() for r in store.results(model_id, heldout) if r.version == version]
        return web.json_response({"version": version, "queued": False, "result": scored[0] if scored else None,
                                  "skipped": not scored})

    app.add_routes(routes)
    return app
