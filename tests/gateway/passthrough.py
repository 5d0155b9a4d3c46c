"""Passing a request on to a real gateway, for the test doubles that stand in front of one
(`hostile.py`, `relay_double.py`): what a client sends that a gateway reads goes on, and what a
gateway answers that a client reads comes back."""

from __future__ import annotations

import aiohttp
from aiohttp import web

FORWARDED = ("Range", "If-Range", "If-None-Match", "X-Deltamesh-Peer", "Authorization", "Content-Type")
"""Request headers a gateway reads."""
ANSWERED = ("Content-Type", "Content-Range", "ETag", "Retry-After", "X-Deltamesh-Version", "X-Deltamesh-Span")
"""Answer headers a client reads."""


async def pass_through(session: aiohttp.ClientSession, base: str, request: web.Request) -> tuple[bytes, int, dict]:
    """Send `request` to the gateway at `base`: its answer's body, status and the headers a client reads."""
    headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
    body = await request.read() if request.can_read_body else None
    async with session.request(request.method, f"{base}{request.path_qs}", headers=headers, data=body) as upstream:
        data = await upstream.read()
        return data, upstream.status, {k: upstream.headers[k] for k in ANSWERED if k in upstream.headers}
