"""HTTP validators of what a gateway serves: entity tags and the conditional requests that use them.

A piece's entity tag is its digest from the signed manifest (BLAKE3-256), quoted, and a manifest's is the digest
of its envelope: both name the exact bytes, so they are strong validators and never change for a
(model, version, kind). `If-None-Match` with a matching tag answers 304 (a cache that holds the bytes
need not fetch them again); `If-Range` lets a Range apply only when the validator matches, so a
client continuing a piece it started elsewhere gets the whole piece (200) instead of a range of other
bytes when the tags differ (RFC 9110 13.1.2 and 13.1.5; a date there never matches, as these
answers carry no Last-Modified).
"""

from __future__ import annotations

from aiohttp import web


def piece_etag(piece_hash: str) -> str:
    return f'"{piece_hash}"'


def not_modified(request: web.Request, etag: str) -> bool:
    """Whether `If-None-Match` lists `etag` (or `*`): the answer is then 304 with no body. The weak
    comparison applies here (RFC 9110 13.1.2), so a `W/` prefix is ignored."""
    header = request.headers.get("If-None-Match")
    if header is None:
        return False
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or any(t.removeprefix("W/") == etag for t in tags)


def range_applies(request: web.Request, etag: str) -> bool:
    """Whether a Range header may be honoured: no `If-Range`, or one whose strong validator is `etag`."""
    header = request.headers.get("If-Range")
    return header is None or header.strip() == etag


def not_modified_response(etag: str) -> web.Response:
    return web.Response(status=304, headers={"ETag": etag})
