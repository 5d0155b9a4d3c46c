"""HTTP routes of the version plane: heads (long poll), listings, plans, manifests, pieces, and parts
of the newest whole version (for a fetcher that does not know it yet).

Publishing (origin only) is `PUT .../manifest` with the signed envelope, then `PUT .../pieces/{i}`
with raw bytes; or, for a version built in parts, its pieces staged first (routes_staging.py) and then
`PUT .../manifest?staged=1`, accepted only with every piece staged. The version is announced as soon
as its manifest is stored; a `GET` of a piece that
is announced but not yet here waits (bounded) for it, so consumers downstream see pieces the moment
they land; with `?wait=S`, a manifest or piece of a version not yet announced is waited for too. On
a relay, plans also use what the upstream can serve, and a manifest or piece of a version that is
not here but upstream is fetched on demand (`Relay.demand`) and served as it arrives.
Every path part is validated before it touches the store (`deltamesh.gateway.server.version_requests`). See
docs/api/gateway.md.
"""

from __future__ import annotations

import re
import time

from aiohttp import web

from deltamesh.delta.errors import CorruptError, SignatureError
from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.plan import NoPlanError, PlanStep, make_plan
from deltamesh.gateway.server.disk import DiskFullError
from deltamesh.gateway.server.ledger import ConflictError
from deltamesh.gateway.server.service import Gateway
from deltamesh.gateway.server.staging import StagingIncomplete
from deltamesh.gateway.server.stored_version import KINDS, StoredVersion
from deltamesh.gateway.server.validators import not_modified, not_modified_response, piece_etag, range_applies
from deltamesh.gateway.server.version_requests import (
    INT_RE,
    Reject,
    entries_of,
    entry_of,
    float_param,
    index_of,
    int_param,
    model_of,
    peer_role,
    version_kind,
    wants_manifests,
)
from deltamesh.gateway.version_parts import (
    MAX_PARTS,
    SPAN_HEADER,
    VERSION_HEADER,
    newest_whole,
    part_span,
    piece_spans,
    span_header,
    total_bytes,
)
from deltamesh.http import JSON_LIMIT, error_response, parse_range, read_body
from deltamesh.peer_json import parse_json

INLINE_MANIFEST_BYTES = 256 * 1024
"""Largest signed envelope a head answer carries inline (`?manifests=1`): a small version's (a delta's)
manifest is a few KiB, and with it inline a follower starts on its pieces without asking for it."""
_HEX_SIG = re.compile(r"^[0-9a-f]{128}$")


def inline_manifests(gw: Gateway, model: str, version: int) -> dict[str, str]:
    """The signed envelopes of `version` (per kind, byte for byte) small enough to ride a head answer.
    They are as untrusted as any relay's answer: the receiver verifies the trainer's signature."""
    out = {}
    for kind in KINDS:
        entry = gw.store.get(model, version, kind)
        if entry is not None and len(entry.manifest_bytes) <= INLINE_MANIFEST_BYTES:
            out[kind] = entry.manifest_bytes.decode()
    return out


BASE = "/v1/models/{model}"
ONE = BASE + "/versions/{version}/{kind}"


class VersionRoutes:
    """The version plane's handlers, one named method each, over one gateway; `table` routes them."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.config

    def table(self) -> list[web.RouteDef]:
        """Every route of the version plane, each behind `guarded` (a `Reject` becomes its answer)."""
        g = self.guarded
        return [
            web.get("/v1/heads", g(self.heads)),
            web.get("/v1/models", g(self.models)),
            web.get(BASE + "/head", g(self.head)),
            web.get(BASE + "/versions", g(self.versions)),
            web.get(BASE + "/traffic", g(self.traffic)),
            web.get(BASE + "/plan", g(self.plan)),
            web.get(ONE + "/manifest", g(self.get_manifest)),
            web.put(ONE + "/manifest", g(self.put_manifest)),
            web.put(ONE + "/pieces/{index}", g(self.put_piece)),
            web.get(ONE + "/pieces/{index}", g(self.get_piece)),
            web.get(BASE + "/newest/{kind}/parts/{part}", g(self.get_part)),
        ]

    def guarded(self, handler):
        """`handler` with a `Reject` turned into its error answer and every refusal counted."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except web.HTTPException as e:  # from the shared body readers (413)
                self.gw.metrics.rejected.labels(str(e.status)).inc()
                raise
            except Reject as r:
                if r.status != 503 and not r.expected:
                    self.gw.metrics.rejected.labels(str(r.status)).inc()
                resp = error_response(r.status, r.reason)
                resp.headers.update(r.headers)
                if r.status == 503:
                    resp.headers["Retry-After"] = "1"
                return resp
        return wrapped

    async def heads(self, request: web.Request) -> web.Response:
        since = int_param(request, "since", -1)
        wait = min(float_param(request, "wait", 0.0), self.cfg.head_wait_max_s)
        if request.query.get("instance") != self.gw.instance:
            since = -1  # a follower of an earlier life of this gateway: answer at once
        epoch = await self.gw.store.wait_change(since, wait)
        heads = self.gw.store.heads()
        answer = {"region": self.cfg.region, "instance": self.gw.instance, "epoch": epoch, "heads": heads}
        if wants_manifests(request):
            inline = {m: inline_manifests(self.gw, m, v) for m, v in heads.items()}
            answer["manifests"] = {m: kinds for m, kinds in inline.items() if kinds}
        return web.json_response(answer)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"region": self.cfg.region, "models": self.gw.store.heads()})

    async def head(self, request: web.Request) -> web.Response:
        model = model_of(request)
        after = int_param(request, "after")
        wait = min(float_param(request, "wait", 0.0), self.cfg.head_wait_max_s)
        h = await self.gw.store.wait_head(model, after, wait)
        answer = {"model": model, "head": h, "region": self.cfg.region}
        if h is not None and wants_manifests(request):
            answer["manifests"] = inline_manifests(self.gw, model, h)
        return web.json_response(answer)

    def reachable(self, model: str) -> list[PlanStep]:
        """What this gateway does not hold but can fetch from its upstreams on demand."""
        return self.gw.relay.reachable(model) if self.gw.relay is not None else []

    async def versions(self, request: web.Request) -> web.Response:
        model, entries = entries_of(self.gw, request)
        return web.json_response({"model": model, "head": self.gw.store.head(model),
                                  "versions": [e.describe() for e in entries],
                                  "reachable": [s.to_json() for s in self.reachable(model)]})

    async def traffic(self, request: web.Request) -> web.Response:
        model = model_of(request)
        return web.json_response({"model": model, "region": self.cfg.region, "versions": self.gw.traffic.describe(model)})

    async def plan(self, request: web.Request) -> web.Response:
        model, entries = entries_of(self.gw, request)
        head_v = self.gw.store.head(model)
        frm = int_param(request, "from")
        to = int_param(request, "to", head_v)
        since_full = int_param(request, "since_full")
        full_every = int_param(request, "full_every", 0)
        available = [PlanStep.of(e.manifest) for e in entries] + self.reachable(model)
        try:
            p = make_plan(model, available, frm, to, since_full=since_full, full_every=full_every)
        except NoPlanError as e:
            raise Reject(409, str(e)) from None
        for s in p.steps:
            entry = self.gw.store.get(model, s.version, s.kind)
            if entry is not None:
                self.gw.store.lease([entry], self.cfg.lease_s)
            elif self.gw.relay is not None:  # named from upstream: have it on its way before it is asked for
                self.gw.relay.fetch_soon(model, s.version, s.kind)
        return web.json_response(p.to_json())

    async def announced(self, request: web.Request) -> tuple[StoredVersion, float]:
        """The version a GET names, and when the wait for its pieces starts.

        With `wait=S`, one not announced yet is waited for (a follower that holds the head asks for
        the next version before it exists, and gets it the moment it is); its pieces' wait starts
        then. On a relay, one that is not here but upstream is fetched on demand; the request's one
        wait of `piece_wait_s` (which clients' stall timeouts allow for) covers its manifest and piece.
        """
        asked = time.monotonic()
        wait = min(float_param(request, "wait", 0.0), self.cfg.head_wait_max_s)
        named = version_kind(request)
        if wait > 0 and self.gw.store.get(*named) is None:
            await self.gw.store.wait_version(*named, wait)
            if self.gw.store.get(*named) is None and not (self.gw.relay is not None and self.gw.relay.can_fetch(*named)):
                model, version, kind = named  # a follower's read-ahead of a version not made yet
                raise Reject(404, f"{model} v{version} {kind} is not in this gateway's store", expected=True)
        if self.gw.store.get(*named) is None and self.gw.relay is not None and self.gw.relay.can_fetch(*named):
            if await self.gw.relay.demand(*named, self.cfg.piece_wait_s) is None:
                model, version, kind = named
                raise Reject(503, f"{model} v{version} {kind} is on its way from upstream; ask again")
            return entry_of(self.gw, request), asked
        return entry_of(self.gw, request), time.monotonic()

    async def get_manifest(self, request: web.Request) -> web.Response:
        entry, _ = await self.announced(request)
        self.gw.store.lease([entry], self.cfg.lease_s)
        if not_modified(request, entry.manifest_etag):
            return not_modified_response(entry.manifest_etag)
        return web.Response(body=entry.manifest_bytes, content_type="application/json",
                            headers={"ETag": entry.manifest_etag})

    async def put_manifest(self, request: web.Request) -> web.Response:
        if not self.cfg.is_origin:
            raise Reject(405, f"gateway {self.cfg.region} relays from upstreams; publish to the origin gateway")
        model, version, kind = version_kind(request)
        if request.content_length is not None and request.content_length > JSON_LIMIT:
            raise Reject(413, f"manifest of {request.content_length} bytes exceeds {JSON_LIMIT}")
        raw = await read_body(request, limit=JSON_LIMIT)
        _check_envelope(raw)
        try:
            m = load_manifest(raw, self.gw.trusted_keys)
        except SignatureError as e:
            raise Reject(403, f"signature refused: {e}") from None
        except CorruptError as e:
            raise Reject(400, str(e)) from None
        if (m.model_id, m.version, m.kind) != (model, version, kind):
            raise Reject(400, f"manifest is {m.model_id} v{m.version} {m.kind}, URL says {model} v{version} {kind}")
        if any(p.length > self.cfg.max_piece_bytes for p in m.pieces):
            raise Reject(413, f"manifest declares a piece over {self.cfg.max_piece_bytes} bytes")
        staged = request.query.get("staged") in ("1", "true")
        try:
            entry, new = await self.gw.store.put_manifest(raw, published=True, staged=staged)
        except StagingIncomplete as e:
            raise Reject(409, str(e)) from None
        except ConflictError as e:
            raise Reject(409, str(e)) from None
        except DiskFullError as e:
            raise Reject(507, str(e)) from None
        return web.json_response({"stored": new, "missing": entry.missing}, status=201 if new else 200)

    async def put_piece(self, request: web.Request) -> web.Response:
        if not self.cfg.is_origin:
            raise Reject(405, f"gateway {self.cfg.region} relays from upstreams; publish to the origin gateway")
        entry = entry_of(self.gw, request)
        index = index_of(request, entry)
        expected = entry.manifest.pieces[index].length
        if request.content_length is not None and request.content_length > expected:
            raise Reject(413, f"piece {index} is {expected} bytes, body says {request.content_length}")
        data = await read_body(request, limit=expected)
        with self.gw.store.using(entry):
            try:
                stored = await self.gw.store.put_piece(entry, index, data)
            except CorruptError as e:
                self.gw.metrics.corrupt_pieces.labels("upload").inc()
                raise Reject(400, str(e)) from None
            except DiskFullError as e:
                raise Reject(507, str(e)) from None
        if stored:
            self.gw.metrics.bytes_in.labels(entry.kind, "publish").inc(len(data))
        return web.json_response({"stored": stored, "complete": entry.complete}, status=201 if stored else 200)

    async def get_piece(self, request: web.Request) -> web.StreamResponse:
        entry, t0 = await self.announced(request)
        index = index_of(request, entry)
        self.gw.store.lease([entry], self.cfg.lease_s)
        etag = piece_etag(entry.manifest.pieces[index].hash)
        if not_modified(request, etag):  # the signed manifest fixes the bytes: no need to read them
            return not_modified_response(etag)
        with self.gw.store.using(entry):
            data = await _wait_and_read(self.gw, entry, index, t0 + self.cfg.piece_wait_s)
        try:
            asked = request.headers.get("Range") if range_applies(request, etag) else None
            span = parse_range(asked, len(data))
        except ValueError as e:
            raise Reject(416, str(e), {"Content-Range": f"bytes */{len(data)}"}) from None
        start, end = span if span is not None else (0, len(data))
        headers = {"Accept-Ranges": "bytes", "X-Deltamesh-Piece-Hash": entry.manifest.pieces[index].hash,
                   "ETag": etag, "Content-Type": "application/octet-stream"}
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        resp = web.StreamResponse(status=206 if span is not None else 200, headers=headers)
        resp.content_length = end - start
        await resp.prepare(request)
        t_send = time.monotonic()
        await resp.write(memoryview(data)[start:end])
        await resp.write_eof()
        done = time.monotonic()
        self.gw.metrics.piece_seconds.labels("serve").observe(done - t0)
        _served(self.gw, request, entry, end - start, done - t_send)
        return resp

    async def get_part(self, request: web.Request) -> web.StreamResponse:
        """Part `part` of `of` of the newest version of a kind, for a fetcher that asks before it knows
        the version (`deltamesh.gateway.version_parts`); 404 unless it is whole here."""
        model, kind, raw = model_of(request), request.match_info["kind"], request.match_info["part"]
        if kind not in KINDS:
            raise Reject(400, f"invalid kind {kind[:40]!r}: one of {list(KINDS)}")
        of = int_param(request, "of")
        if not INT_RE.match(raw) or of is None or not 0 <= int(raw) < of <= MAX_PARTS:
            raise Reject(400, f"ask for part K of N: 0 <= K < N <= {MAX_PARTS} (?of=N)")
        entry = newest_whole(self.gw.store.entries(model), self.reachable(model), kind)
        if entry is None:
            raise Reject(404, f"the newest {kind} version of {model} is not whole in this gateway's store",
                         expected=True)
        total = total_bytes(entry.manifest)
        start, end = part_span(total, int(raw), of)
        self.gw.store.lease([entry], self.cfg.lease_s)
        resp = web.StreamResponse(headers={VERSION_HEADER: str(entry.version), SPAN_HEADER: span_header(start, end, total),
                                           "Content-Type": "application/octet-stream"})
        resp.content_length = end - start
        t0 = time.monotonic()
        await resp.prepare(request)
        with self.gw.store.using(entry):
            for index, a, b in piece_spans(entry.manifest, start, end):
                try:
                    data = await self.gw.store.read_piece(entry, index)
                except CorruptError:  # dropped by the store; the fetcher sees a short part and asks for pieces
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                await resp.write(memoryview(data)[a:b])
        await resp.write_eof()
        _served(self.gw, request, entry, end - start, time.monotonic() - t0)
        return resp



def _served(gw: Gateway, request: web.Request, entry: StoredVersion, nbytes: int, seconds: float) -> None:
    """Book bytes served to the peer the request names: metrics, its link's rate and the traffic ledger."""
    role, name = peer_role(request)
    gw.metrics.bytes_out.labels(entry.kind, role).inc(nbytes)
    link = gw.links.find(name, role) if name else None
    if link is not None:  # only peers that registered or announced themselves get a link
        gw.links.record_transfer(link, nbytes, seconds)
    gw.traffic.served(role, name if link is not None else "", entry.model, entry.version, entry.kind, nbytes)


def _check_envelope(raw: bytes) -> None:
    """401 for a manifest that is not a signed envelope at all; the signature itself is checked later."""
    try:
        env = parse_json(raw)
    except ValueError as e:
        raise Reject(400, f"malformed JSON: {e}") from None
    if not isinstance(env, dict) or not isinstance(env.get("body"), str):
        raise Reject(400, "manifest must be a signed envelope {body, key_id, signature}")
    if not isinstance(env.get("key_id"), str) or not isinstance(env.get("signature"), str):
        raise Reject(401, "manifest is not signed")
    if not _HEX_SIG.match(env["signature"]):
        raise Reject(401, "malformed signature: expected 128 hex characters")


async def _wait_and_read(gw: Gateway, entry: StoredVersion, index: int, deadline: float) -> bytes:
    """The verified bytes of a piece, waiting until `deadline` for one that has not arrived (yet, or again)."""
    while True:
        left = deadline - time.monotonic()
        if await gw.store.wait_piece(entry, index, max(left, 0.0)):
            try:
                return await gw.store.read_piece(entry, index)
            except CorruptError:
                continue  # dropped by the store; a relay fetches it again, so wait for that
        raise Reject(503, f"piece {index} of {entry.model} v{entry.version} {entry.kind} has not arrived yet")
