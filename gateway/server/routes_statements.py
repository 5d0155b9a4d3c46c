"""HTTP routes of head statements: the trainer's signed word on a model's newest version, kept and served.

`PUT /v1/models/{model}/statement` (origin only, role trainer) takes a signed statement
(`deltamesh.delta.statement`) and keeps it if it is the newest valid one (`deltamesh.gateway.server.statements`);
`GET` serves the kept one as the exact signed bytes, with an entity tag so a pool that asks every
round mostly gets a 304. See docs/api/gateway.md.
"""

from __future__ import annotations

from aiohttp import web

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.manifest import MODEL_ID_RE
from deltamesh.delta.statement import MAX_STATEMENT_BYTES
from deltamesh.gateway.server.service import Gateway
from deltamesh.gateway.server.statements import StatementConflict
from deltamesh.gateway.server.validators import not_modified, not_modified_response
from deltamesh.http import error_response, read_body

STATEMENT = "/v1/models/{model}/statement"


class StatementRoutes:
    """The head statement's handlers, one named method each, over one gateway; `table` routes them."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.config

    def table(self) -> list[web.RouteDef]:
        return [web.get(STATEMENT, self.get_statement), web.put(STATEMENT, self.put_statement)]

    def refuse(self, status: int, reason: str) -> web.Response:
        self.gw.metrics.rejected.labels(str(status)).inc()
        return error_response(status, reason)

    async def get_statement(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not MODEL_ID_RE.match(model):
            return self.refuse(400, f"invalid model id {model[:80]!r}")
        kept = self.gw.statements.get(model)
        if kept is None:
            return error_response(404, f"no head statement of {model} here")
        if not_modified(request, kept.etag):
            return not_modified_response(kept.etag)
        return web.Response(body=kept.raw, content_type="application/json", headers={"ETag": kept.etag})

    async def put_statement(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not MODEL_ID_RE.match(model):
            return self.refuse(400, f"invalid model id {model[:80]!r}")
        if not self.cfg.is_origin:
            return self.refuse(405, f"gateway {self.cfg.region} relays from upstreams; send statements to the origin "
                                    "gateway")
        try:
            raw = await read_body(request, limit=MAX_STATEMENT_BYTES)
        except web.HTTPException as e:
            self.gw.metrics.rejected.labels(str(e.status)).inc()
            raise
        try:
            new = await self.gw.statements.put(raw, published=True, model=model)
        except SignatureError as e:
            return self.refuse(403, f"signature refused: {e}")
        except CorruptError as e:
            return self.refuse(400, str(e))
        except StatementConflict as e:
            return self.refuse(409, str(e))
        kept = self.gw.statements.get(model)
        return web.json_response({"stored": new, "version": kept.statement.version,
                                  "issued_ms": kept.statement.issued_ms}, status=201 if new else 200)
