"""Parts of a whole version: its pieces laid end to end in index order and cut into `of` equal byte
ranges, so that a fetcher that does not know the version yet can ask for a share of it on each of its
connections (`GET /v1/models/{model}/newest/{kind}/parts/{part}?of=N`, served by a gateway's version
routes, taken by `deltamesh.gateway.fetch.parts`). Both sides cut the same way with these functions;
the answer names its version and span in `VERSION_HEADER` and `SPAN_HEADER`.
"""

from __future__ import annotations

import re
from typing import Sequence

from deltamesh.delta.manifest import Manifest

VERSION_HEADER = "X-Deltamesh-Version"
SPAN_HEADER = "X-Deltamesh-Span"
"""`start-end/total`: the part's bytes [start, end) of the version's `total` piece bytes."""
MAX_PARTS = 4096
"""Most parts a version may be asked in: more than any fetcher's connections."""

_SPAN_RE = re.compile(r"^([0-9]{1,15})-([0-9]{1,15})/([0-9]{1,15})$")


def newest_whole(entries: Sequence, reachable: Sequence, kind: str):
    """The newest version of `kind` a gateway knows of, if it holds it whole: among its stored versions
    (`StoredVersion`s) and those it can fetch from upstream (`PlanStep`s); None when that one is not
    stored whole here. An older whole one would be no use to a first pull, which starts from the
    newest full, and its parts would be bytes sent for nothing."""
    newest = max((x.version for x in [*entries, *reachable] if x.kind == kind), default=None)
    return next((e for e in entries if (e.version, e.kind) == (newest, kind) and e.complete), None)


def total_bytes(manifest: Manifest) -> int:
    return sum(p.length for p in manifest.pieces)


def part_span(total: int, part: int, of: int) -> tuple[int, int]:
    """Bytes [start, end) of part `part` (0-based) when `total` bytes are cut into `of` parts."""
    return total * part // of, total * (part + 1) // of


def piece_spans(manifest: Manifest, start: int, end: int) -> list[tuple[int, int, int]]:
    """(piece, from, to) of the pieces that bytes [start, end) of the laid-out version cover, with
    `from`/`to` offsets inside each piece."""
    out, at = [], 0
    for i, piece in enumerate(manifest.pieces):
        lo, hi = max(start, at), min(end, at + piece.length)
        if lo < hi:
            out.append((i, lo - at, hi - at))
        at += piece.length
        if at >= end:
            break
    return out


def span_header(start: int, end: int, total: int) -> str:
    return f"{start}-{end}/{total}"


def parse_span(raw: str | None) -> tuple[int, int, int] | None:
    """(start, end, total) of a `SPAN_HEADER` value; None when it is missing or malformed."""
    match = _SPAN_RE.match(raw or "")
    if match is None:
        return None
    start, end, total = (int(g) for g in match.groups())
    return (start, end, total) if start <= end <= total else None
