"""HTTP route of the staging area: a trainer rank's pieces of a version built in parts, before its manifest.

`PUT /v1/models/{model}/staged/{digest}` (origin only; role trainer, scoped to the model like every
publish route) takes one piece's raw bytes under its BLAKE3 digest, which the gateway checks; the
manifest that names the pieces then comes with `PUT .../manifest?staged=1` (routes_versions.py) and
is accepted only when all of them are staged, so the version is announced whole
(`deltamesh.gateway.server.staging`). Answers: 201 staged, 200 staged already, 400 for bytes that are not
the digest's, 413 past `max_piece_bytes`, 405 on a relay, 507 when staging or the disk is full.
"""

from __future__ import annotations

import re

from aiohttp import web

from deltamesh.delta.errors import CorruptError
from deltamesh.gateway.server.disk import DiskFullError
from deltamesh.gateway.server.service import Gateway
from deltamesh.gateway.server.staging import StagingFullError
from deltamesh.gateway.server.version_requests import Reject, model_of
from deltamesh.http import error_response, read_body

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class StagingRoutes:
    """The staging area's handler over one gateway; `table` routes it."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.config

    def table(self) -> list[web.RouteDef]:
        return [web.put("/v1/models/{model}/staged/{digest}", self.put_staged)]

    async def put_staged(self, request: web.Request) -> web.Response:
        if not self.cfg.is_origin:
            return error_response(405, f"gateway {self.cfg.region} relays from upstreams; publish to the origin gateway")
        try:
            model = model_of(request)
        except Reject as r:
            return error_response(r.status, r.reason)
        piece_hash = request.match_info["digest"]
        if not _DIGEST.match(piece_hash):
            return error_response(400, f"invalid piece digest {piece_hash[:80]!r}: 64 lowercase hex characters")
        if request.content_length is not None and request.content_length > self.cfg.max_piece_bytes:
            return error_response(413, f"piece of {request.content_length} bytes exceeds {self.cfg.max_piece_bytes}")
        data = await read_body(request, limit=self.cfg.max_piece_bytes)
        try:
            stored = await self.gw.store.staging.put(model, piece_hash, data)
        except CorruptError as e:
            self.gw.metrics.corrupt_pieces.labels("upload").inc()
            return error_response(400, str(e))
        except (StagingFullError, DiskFullError) as e:
            return error_response(507, str(e))
        if stored:
            self.gw.metrics.bytes_in.labels("staged", "publish").inc(len(data))
        return web.json_response({"stored": stored}, status=201 if stored else 200)
