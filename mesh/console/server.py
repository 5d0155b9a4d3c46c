"""The console's HTTP server (aiohttp): the page, its own JavaScript and CSS, and the snapshot it polls.

Routes: `GET /` (the page), `GET /static/{name}` (the files in static/, nothing else), `GET
/api/snapshot` (the newest snapshot, JSON), `GET /healthz` (`{"ok": true}`, nothing else), and with a
login token `GET`/`POST /login` and the login form's `GET /login.css`. The browser only ever gets these: the tokens the console reads the
mesh with stay in this process.

With a login token set (required off loopback: mesh/console/config.py), every route but `/healthz`
and the login page needs a session: the login form takes the token once (compared in constant time)
and answers with a random session id in an HttpOnly, SameSite=Strict cookie (Secure over HTTPS); a
script may instead send the token as `Authorization: Bearer`. Without a session the page redirects
to the login form and the data routes answer 401 with nothing of the mesh. Every answer forbids
framing and inline script (Content-Security-Policy), and the data is never cached.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import parse_qs

from aiohttp import web

from deltamesh.http import error_response, json_errors, read_body
from deltamesh.mesh.console.collect import Collector
from deltamesh.tokens import bearer_token

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"console.js": "text/javascript", "console.css": "text/css"}
COOKIE = "deltamesh_console"
SESSION_S = 12 * 3600.0
MAX_SESSIONS = 1024
OPEN_PATHS = ("/healthz", "/login", "/login.css")
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
}
COLLECTOR_KEY = web.AppKey("collector", Collector)

LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>deltamesh console: log in</title>
<link rel="stylesheet" href="/login.css"></head>
<body class="login"><form method="post" action="/login"><h1>deltamesh console</h1>
<label>login token <input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">log in</button>{message}</form></body></html>
"""
LOGIN_CSS = "body.login{font:15px system-ui,sans-serif;background:#10151c;color:#e6edf3;display:flex;" \
            "justify-content:center;margin-top:15vh}form{display:flex;flex-direction:column;gap:.8em}" \
            "input{font:inherit;padding:.4em}p.refused{color:#ff7b72}"


class Sessions:
    """Logged-in browsers: random ids, each valid for SESSION_S, at most MAX_SESSIONS (oldest dropped)."""

    def __init__(self, login_token: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._digest = hashlib.sha256(login_token.encode()).digest() if login_token else b""
        self._clock = clock
        self._ids: dict[str, float] = {}

    @property
    def required(self) -> bool:
        return bool(self._digest)

    def token_matches(self, token: str) -> bool:
        return bool(self._digest) and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    def open(self) -> str:
        now = self._clock()
        self._ids = {sid: until for sid, until in self._ids.items() if until > now}
        while len(self._ids) >= MAX_SESSIONS:
            del self._ids[min(self._ids, key=self._ids.__getitem__)]
        sid = secrets.token_urlsafe(32)
        self._ids[sid] = now + SESSION_S
        return sid

    def valid(self, sid: str | None) -> bool:
        until = self._ids.get(sid or "")
        return until is not None and until > self._clock()

    def allows(self, request: web.Request) -> bool:
        if not self.required:
            return True
        token = bearer_token(request.headers.get("Authorization"))
        return self.token_matches(token) if token is not None else self.valid(request.cookies.get(COOKIE))


def build_app(collector: Collector, *, secure_cookie: bool) -> web.Application:
    sessions = Sessions(collector.config.login_token)

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path not in OPEN_PATHS and not sessions.allows(request):
            if request.path == "/" and request.method == "GET":
                resp: web.StreamResponse = see_other("/login")
            else:
                resp = error_response(401, "log in to the console first")
        else:
            resp = await handler(request)
        resp.headers.update(HEADERS)
        return resp

    app = web.Application(middlewares=[guard, json_errors])
    app[COLLECTOR_KEY] = collector
    routes = web.RouteTableDef()

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    @routes.get("/")
    async def page(request: web.Request) -> web.Response:
        return web.Response(body=(STATIC / "index.html").read_bytes(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    @routes.get("/static/{name}")
    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            return error_response(404, "no such file")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=STATIC_FILES[name], charset="utf-8")

    @routes.get("/api/snapshot")
    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=collector.snapshot_json, content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    @routes.get("/login")
    async def login_form(request: web.Request) -> web.Response:
        if not sessions.required:
            return see_other("/")
        return web.Response(text=LOGIN_PAGE.format(message=""), content_type="text/html")

    @routes.get("/login.css")
    async def login_css(request: web.Request) -> web.Response:
        return web.Response(text=LOGIN_CSS, content_type="text/css")

    @routes.post("/login")
    async def login(request: web.Request) -> web.Response:
        if not sessions.required:
            return see_other("/")
        body = await read_body(request, limit=4096)
        token = (parse_qs(body.decode(errors="replace")).get("token") or [""])[0]
        if not sessions.token_matches(token):
            return web.Response(status=401, content_type="text/html",
                                text=LOGIN_PAGE.format(message='<p class="refused">that token is not the login token</p>'))
        resp = see_other("/")
        resp.set_cookie(COOKIE, sessions.open(), max_age=int(SESSION_S), httponly=True, samesite="Strict",
                        secure=secure_cookie, path="/")
        return resp

    app.add_routes(routes)
    return app


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})
