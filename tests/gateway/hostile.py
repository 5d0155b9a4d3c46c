"""A hostile upstream for tests: an HTTP proxy in front of a real gateway that misbehaves on demand.

Everything is passed through to the real gateway, except that piece bodies (and the bodies of parts
of a version) can be trickled, stalled mid-piece, cut short or have a byte flipped, parts can claim
another version, control-plane answers (heads, listings, plans, pool
registration) can be slowed down, and the answers of any stage (`ENDLESS`) can go on for ever: the
honest body, then filler bytes, with no declared length, until the client hangs up. What it does can change while a test runs (`mode`), and it counts
every piece request it got, so a test can bound how often a bad source is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import deltamesh_test_passthrough as passthrough  # a helper module of this folder, loaded by its conftest.py
from aiohttp import web

from deltamesh.http import serving

PIECE_PATH = re.compile(r"^/v1/models/([^/]+)/versions/([0-9]+)/(delta|full)/pieces/([0-9]+)$")
PART_PATH = re.compile(r"^/v1/models/([^/]+)/newest/(delta|full)/parts/([0-9]+)$")
HEAD_PATH = re.compile(r"^/v1/models/([^/]+)/head$")
MANIFEST_PATH = re.compile(r"^/v1/models/([^/]+)/versions/([0-9]+)/(delta|full)/manifest$")
ENDLESS = ("parts", "pieces", "manifest", "control")
"""The stages whose answers `Mode.endless` can make endless: parts of a newest version, pieces, manifests,
and everything else (heads, plans, statements, listings, pool registration, health)."""
FILLER = b"\xa5" * (256 * 1024)


@dataclass
class Mode:
    """How the proxy misbehaves; every field off is an honest pass-through."""

    trickle_bps: float = 0.0
    """Send piece bodies at this many bytes per second."""
    stall_after: int | None = None
    """Send this many bytes of a piece body, then nothing more (the connection stays open)."""
    short_after: int | None = None
    """Send this many bytes of a piece body, then close the connection."""
    flip: bool = False
    """Flip one byte in the middle of every piece body."""
    control_delay_s: float = 0.0
    """Delay every answer that is neither a manifest nor a piece by this long."""
    versions: set[int] | None = None
    """Misbehave on the pieces of these versions only (None: all)."""
    part_version: int | None = None
    """Say that parts are of this version."""
    endless: frozenset[str] = frozenset()
    """The stages (of ENDLESS) whose successful answers never end. With "manifest", head answers carry
    no manifests inline (so that the client asks for them)."""
    endless_sent: int = 0
    """Filler bytes sent so far by endless answers."""


@dataclass
class Hostile:
    real: str
    mode: Mode = field(default_factory=Mode)
    piece_requests: Counter = field(default_factory=Counter)
    """(version, kind, index) -> requests received."""
    ranges: list[tuple[int, str, int, str | None]] = field(default_factory=list)
    """(version, kind, index, Range header) of every piece request, in order."""
    part_requests: Counter = field(default_factory=Counter)
    """Part index -> requests received for parts of a newest version."""
    control_requests: int = 0
    """Requests that were neither for a manifest nor for a piece (heads, listings, plans, ...)."""
    url: str = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        piece, part = PIECE_PATH.match(request.path), PART_PATH.match(request.path)
        manifest = MANIFEST_PATH.match(request.path)
        if piece is None and part is None and not manifest:
            self.control_requests += 1
            await asyncio.sleep(self.mode.control_delay_s)
        data, status, out = await passthrough.pass_through(self._session, self.real, request)
        mode = self.mode
        stage = "parts" if part else "pieces" if piece else "manifest" if manifest else "control"
        if "manifest" in mode.endless and HEAD_PATH.match(request.path) and status == 200:
            data = json.dumps({k: v for k, v in json.loads(data).items() if k != "manifests"}).encode()
        if stage in mode.endless and status in (200, 206):
            return await self._endless(request, status, out, data)
        if part is not None:
            self.part_requests[int(part.group(3))] += 1
            if mode.part_version is not None and "X-Deltamesh-Version" in out:
                out["X-Deltamesh-Version"] = str(mode.part_version)
            version = int(out.get("X-Deltamesh-Version", -1))
        elif piece is None:
            return web.Response(body=data, status=status, headers=out)
        else:
            version, kind, index = int(piece.group(2)), piece.group(3), int(piece.group(4))
            self.piece_requests[(version, kind, index)] += 1
            self.ranges.append((version, kind, index, request.headers.get("Range")))
        if status not in (200, 206) or (mode.versions is not None and version not in mode.versions):
            return web.Response(body=data, status=status, headers=out)
        if mode.flip and data:
            data = bytearray(data)
            data[len(data) // 2] ^= 0x40
            data = bytes(data)
        resp = web.StreamResponse(status=status, headers=out)
        resp.content_length = len(data)
        await resp.prepare(request)
        limit = min(x for x in (mode.stall_after, mode.short_after, len(data)) if x is not None)
        if mode.trickle_bps:
            for i in range(limit):
                await resp.write(data[i:i + 1])
                await asyncio.sleep(1 / mode.trickle_bps)
        else:
            await resp.write(data[:limit])
        if mode.stall_after is not None and limit < len(data):
            await self._closing.wait()  # hold the connection, send nothing (until the client gives up)
        if mode.short_after is not None and limit < len(data):
            request.transport.close()  # the body ends early: a short read at the client
            return resp
        await resp.write_eof()
        return resp

    async def _endless(self, request: web.Request, status: int, headers: dict, data: bytes) -> web.StreamResponse:
        """The honest answer, then filler for ever (no declared length), until the client hangs up."""
        resp = web.StreamResponse(status=status, headers=headers)
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            await resp.write(data)
            while not self._closing.is_set():
                await resp.write(FILLER)
                self.mode.endless_sent += len(FILLER)
        except (ConnectionError, RuntimeError, aiohttp.ClientError):
            pass  # the client hung up (aiohttp raises one of these, by when it noticed)
        return resp

    @contextlib.asynccontextmanager
    async def serving(self, listen: str = "127.0.0.1:0", *, ssl_context: ssl.SSLContext | None = None
                      ) -> AsyncIterator["Hostile"]:
        """Serve on `listen` (HTTPS with `ssl_context`: standing in for a gateway at its own address)."""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._closing = asyncio.Event()
        try:
            async with serving(app, listen, ssl_context=ssl_context) as url:
                self.url = url
                try:
                    yield self
                finally:
                    # End stalled answers and the long polls passed through, so the server stops at once.
                    self._closing.set()
                    await self._session.close()
        finally:
            await self._session.close()
