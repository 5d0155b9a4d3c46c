"""Reading a version-plane request before it touches the store: path parts (model ids matching the
manifest's pattern, versions and piece indices as plain decimal integers, kinds `delta` or `full`),
query parameters, the stored version a path names, who the caller says it is, and the refusal
(`Reject`) a handler raises for the routes of `deltamesh.gateway.server.routes_versions` to answer.
"""

from __future__ import annotations

import re

from aiohttp import web

from deltamesh.delta.manifest import MODEL_ID_RE
from deltamesh.gateway.server.service import Gateway
from deltamesh.gateway.server.stored_version import KINDS, StoredVersion
from deltamesh.gateway_client import PEER_HEADER

INT_RE = re.compile(r"^[0-9]{1,12}$")


class Reject(Exception):
    """A request refused (or answered with an expected miss): the status and reason its route answers."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None, *, expected: bool = False):
        self.status, self.reason, self.headers = status, reason, headers or {}
        self.expected = expected  # an answer the client expects (a read-ahead's wait ran out): not a refusal


def int_param(request: web.Request, name: str, default: int | None = None) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"-?[0-9]{1,12}", raw):
        raise Reject(400, f"query parameter {name} must be an integer, got {raw[:40]!r}")
    return int(raw)


def float_param(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise Reject(400, f"query parameter {name} must be a number") from None
    if not value >= 0:
        raise Reject(400, f"query parameter {name} must be >= 0")
    return value


def model_of(request: web.Request) -> str:
    model = request.match_info["model"]
    if not MODEL_ID_RE.match(model):
        raise Reject(400, f"invalid model id {model[:80]!r}")
    return model


def version_kind(request: web.Request) -> tuple[str, int, str]:
    model = model_of(request)
    version, kind = request.match_info["version"], request.match_info["kind"]
    if not INT_RE.match(version):
        raise Reject(400, f"invalid version {version[:40]!r}: a decimal integer")
    if kind not in KINDS:
        raise Reject(400, f"invalid kind {kind[:40]!r}: one of {list(KINDS)}")
    return model, int(version), kind


def entries_of(gw: Gateway, request: web.Request) -> tuple[str, list[StoredVersion]]:
    """The model the path names and its stored versions (404 when it has none here)."""
    model = model_of(request)
    entries = gw.store.entries(model)
    if not entries:
        raise Reject(404, f"model {model} is not in this gateway's store")
    return model, entries


def entry_of(gw: Gateway, request: web.Request) -> StoredVersion:
    model, version, kind = version_kind(request)
    entry = gw.store.get(model, version, kind)
    if entry is None:
        raise Reject(404, f"{model} v{version} {kind} is not in this gateway's store")
    return entry


def index_of(request: web.Request, entry: StoredVersion) -> int:
    raw = request.match_info["index"]
    if not INT_RE.match(raw):
        raise Reject(400, f"invalid piece name {raw[:40]!r}: pieces are named by integer index")
    index = int(raw)
    if index >= len(entry.manifest.pieces):
        raise Reject(404, f"piece {index} out of range ({len(entry.manifest.pieces)} pieces)")
    return index


def peer_role(request: web.Request) -> tuple[str, str]:
    """('pool'|'downstream'|'anonymous', name) from the peer header a client sends."""
    kind, _, name = request.headers.get(PEER_HEADER, "").partition("/")
    if kind == "pool" and name:
        return "pool", name[:64]
    if kind == "gateway" and name:
        return "downstream", name[:64]
    return "anonymous", ""


def wants_manifests(request: web.Request) -> bool:
    return request.query.get("manifests") in ("1", "true")
