"""A lying relay for tests: it speaks the gateway API in front of an honest gateway, and lies on demand.

Everything it is not told to lie about is passed through to the honest gateway (so it serves the real
signed manifests and pieces, and registers pools there). It can announce another head (and hold a
long poll as a gateway would when nothing is newer), answer every plan with one it was given, serve
other signed manifests and pieces under a version's URLs (ranges too; then it serves no parts of a
newest version), and serve another head statement or none. What it does can change while a test runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import deltamesh_test_passthrough as passthrough  # a helper module of this folder, loaded by its conftest.py
from aiohttp import web

from deltamesh.http import parse_range, serving

HEAD_PATH = re.compile(r"^/v1/models/([^/]+)/head$")
PLAN_PATH = re.compile(r"^/v1/models/([^/]+)/plan$")
STATEMENT_PATH = re.compile(r"^/v1/models/([^/]+)/statement$")
VERSION_PATH = re.compile(r"^/v1/models/([^/]+)/versions/([0-9]+)/(delta|full)/(manifest|pieces/([0-9]+))$")
PARTS_PATH = re.compile(r"^/v1/models/([^/]+)/newest/(delta|full)/parts/([0-9]+)$")
PASS = object()
"""A `statement` that is passed through to the honest gateway."""


@dataclass
class RelayDouble:
    honest: str
    head: int | None = None
    """The head it announces (None: the honest gateway's)."""
    plan: dict | None = None
    """The plan it answers every plan request with (None: the honest gateway's)."""
    versions: dict[tuple[int, str], tuple[bytes, list[bytes]]] = field(default_factory=dict)
    """(version, kind) -> (signed manifest, pieces) it serves instead of the honest gateway's."""
    statement: object = PASS
    """The head statement it serves: PASS (the honest one), None (none: 404) or signed bytes."""
    url: str = ""
    served: list[str] = field(default_factory=list)
    """Paths it answered with a lie, in order."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if self.head is not None and HEAD_PATH.match(path):
            after = request.query.get("after")
            if after and self.head <= int(after):  # a long poll that nothing newer ends
                await asyncio.sleep(min(float(request.query.get("wait", "0")), 0.3))
            return self._lie(path, web.json_response({"model": HEAD_PATH.match(path).group(1), "head": self.head,
                                                      "region": "double"}))
        if self.plan is not None and PLAN_PATH.match(path):
            return self._lie(path, web.json_response(self.plan))
        if self.statement is not PASS and STATEMENT_PATH.match(path):
            if self.statement is None:
                return web.json_response({"error": "no head statement here"}, status=404)
            return self._lie(path, web.Response(body=self.statement, content_type="application/json"))
        if self.versions and PARTS_PATH.match(path):  # parts would be the honest bytes of the versions it lies about
            return web.json_response({"error": "no parts here"}, status=404)
        named = VERSION_PATH.match(path)
        if named is not None and (int(named.group(2)), named.group(3)) in self.versions:
            manifest, pieces = self.versions[(int(named.group(2)), named.group(3))]
            if named.group(5) is None:
                return self._lie(path, web.Response(body=manifest, content_type="application/json"))
            return self._lie(path, self._piece(request, pieces[int(named.group(5))]))
        data, status, headers = await passthrough.pass_through(self._session, self.honest, request)
        return web.Response(body=data, status=status, headers=headers)

    def _lie(self, path: str, response: web.StreamResponse) -> web.StreamResponse:
        self.served.append(path)
        return response

    @staticmethod
    def _piece(request: web.Request, data: bytes) -> web.Response:
        span = parse_range(request.headers.get("Range"), len(data))
        if span is None:
            return web.Response(body=data, content_type="application/octet-stream")
        start, end = span
        return web.Response(body=data[start:end], status=206, content_type="application/octet-stream",
                            headers={"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"})

    @contextlib.asynccontextmanager
    async def serving(self, listen: str = "127.0.0.1:0", *, ssl_context: ssl.SSLContext | None = None
                      ) -> AsyncIterator["RelayDouble"]:
        """Serve on `listen` (HTTPS with `ssl_context`: standing in for a gateway at its own address)."""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        try:
            async with serving(app, listen, ssl_context=ssl_context) as url:
                self.url = url
                yield self
        finally:
            await self._session.close()
