"""Measuring the link to one remote gateway from the client side, with nothing but HTTP (`deltamesh bench link`).

Four figures, each from requests any pool may make, in this order: the first authenticated call
(`GET /v1/models`, which also picks the model and stops everything on a refused token), the RTT (a
series of small `GET .../head` requests on one kept-open connection: p50 and p95), the throughput
of ranged reads (`Range: bytes=A-B` on `GET .../pieces/{i}`) of one stored version (the head's full
snapshot when there is one, else the largest complete version) over one connection and over N in
parallel, each on fresh connections, capped at `sample_bytes`, and the time a pool would take to
fetch the current head version whole, for each kind stored (delta, full): manifest and every piece
through the pools' own `Fetcher`, each piece checked against the manifest's hash. The manifest's
signature is not checked (no trusted key is needed to measure a link); nothing fetched is kept.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from deltamesh.delta.manifest import Manifest, load_manifest_unverified
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.links import _percentile
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import bearer, client_session, request_bytes
from deltamesh.tls import TlsSettings

PEER = "bench/link"
"""What the measuring requests call themselves (X-Deltamesh-Peer): not a pool, so no link is booked for them."""


class BenchError(Exception):
    """The gateway offers nothing to measure (no model, several without --model, no complete version)."""


@dataclass(frozen=True)
class LinkBenchSettings:
    """What to measure and how much (the command's flags)."""

    gateway: str
    token: str = ""
    model: str = ""
    connections: int = 8
    rtt_samples: int = 20
    sample_bytes: int = 64_000_000
    range_bytes: int = 4 * 1024 * 1024
    tls: TlsSettings = field(default_factory=TlsSettings)
    timeout_s: float = 300.0


def _rate(nbytes: int, seconds: float) -> dict[str, Any]:
    return {"bytes": nbytes, "seconds": round(seconds, 4),
            "mbit_per_s": round(nbytes * 8 / seconds / 1e6, 2) if seconds > 0 else None}


def _session(s: LinkBenchSettings, connections: int) -> aiohttp.ClientSession:
    headers = bearer(s.token) if s.token else None
    return client_session(connections=connections, timeout_s=s.timeout_s, headers=headers, tls=s.tls)


def _spans(manifest: Manifest, sample_bytes: int, range_bytes: int) -> list[tuple[int, int, int]]:
    """(piece, start, end) ranges of the version's pieces in order, until `sample_bytes` are covered."""
    spans, total = [], 0
    for index, piece in enumerate(manifest.pieces):
        for start in range(0, piece.length, range_bytes):
            end = min(start + range_bytes, piece.length, start + sample_bytes - total)
            spans.append((index, start, end))
            total += end - start
            if total >= sample_bytes:
                return spans
    return spans


async def _ranged_reads(s: LinkBenchSettings, url: str, spans: list[tuple[int, int, int]], connections: int) -> dict:
    """Read `spans` with `connections` requests in flight over as many fresh connections; bytes and seconds."""
    queue = list(reversed(spans))
    received = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal received
        while queue:
            index, start, end = queue.pop()
            body = await request_bytes(session, "GET", f"{url}/pieces/{index}", limit=end - start,
                                       headers={"Range": f"bytes={start}-{end - 1}"}, timeout_s=s.timeout_s)
            if len(body) != end - start:
                raise BenchError(f"piece {index} bytes {start}-{end - 1}: {len(body)} bytes came back")
            received += len(body)

    async with _session(s, connections) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(min(connections, len(spans)))))
        seconds = time.monotonic() - t0
    return {"connections": connections, **_rate(received, seconds)}


async def _fetch_whole(s: LinkBenchSettings, model: str, version: int, kind: str) -> dict:
    """Fetch one version's manifest and every piece as a pool does; bytes, pieces and seconds."""
    async def accept(raw: bytes) -> Manifest:
        return load_manifest_unverified(raw)[0]

    received = 0

    async def keep(index: int, data: bytearray) -> None:
        nonlocal received
        received += len(data)  # checked against the manifest's hash by the fetcher

    async with _session(s, s.connections + 2) as session:
        fetcher = Fetcher(session, [Source(s.gateway)], PEER, give_up_s=s.timeout_s, max_requests=s.connections)
        t0 = time.monotonic()
        manifest = await fetcher.manifest_bytes(model, version, kind, accept, prefetch=s.connections)
        await fetcher.pieces(manifest, range(len(manifest.pieces)), s.connections, keep)
        seconds = time.monotonic() - t0
    return {"pieces": len(manifest.pieces), "payload_bytes": manifest.payload_bytes, **_rate(received, seconds)}


def _pick_model(s: LinkBenchSettings, models: dict[str, Any]) -> str:
    if s.model:
        if s.model not in models:
            raise BenchError(f"model {s.model!r} is not served by {s.gateway} (it serves: {sorted(models) or 'none'})")
        return s.model
    if len(models) != 1:
        raise BenchError(f"{s.gateway} serves {len(models)} models ({', '.join(sorted(models)) or 'none'}): "
                         f"name one with --model")
    return next(iter(models))


async def measure_link(s: LinkBenchSettings) -> dict[str, Any]:
    """Every figure of the link to `s.gateway`, as one JSON-ready dict (see the module's docstring)."""
    async with _session(s, 1) as session:
        client = GatewayClient(s.gateway, session, peer=PEER, insecure=s.tls.insecure, timeout_s=s.timeout_s)
        t0 = time.monotonic()
        listing = await client.models()  # a refused token stops here, before anything else is asked
        first_ms = (time.monotonic() - t0) * 1000
        model = _pick_model(s, listing["models"])
        rtts = []
        for _ in range(max(1, s.rtt_samples)):
            t0 = time.monotonic()
            await client.head(model)
            rtts.append((time.monotonic() - t0) * 1000)
        versions = await client.versions(model)
    head = versions["head"]
    complete = [v for v in versions["versions"] if v["complete"]]
    at_head = {v["kind"]: v for v in complete if v["version"] == head}
    if not complete:
        raise BenchError(f"{s.gateway} holds no complete version of {model}")
    source = at_head.get("full") or max(complete, key=lambda v: v["payload_bytes"])
    url = client.version_url(model, source["version"], source["kind"])
    async with _session(s, 1) as session:
        raw = await request_bytes(session, "GET", f"{url}/manifest", timeout_s=s.timeout_s)
    spans = _spans(load_manifest_unverified(raw)[0], s.sample_bytes, s.range_bytes)
    one = await _ranged_reads(s, url, spans, 1)
    many = await _ranged_reads(s, url, spans, s.connections)
    fetched = {kind: {**await _fetch_whole(s, model, head, kind), "base_version": at_head[kind]["base_version"]}
               for kind in ("delta", "full") if kind in at_head}
    return {
        "gateway": s.gateway, "region": listing.get("region"), "model": model,
        "first_request_ms": round(first_ms, 3),
        "rtt_ms": {"p50": round(_percentile(rtts, 50), 3), "p95": round(_percentile(rtts, 95), 3),
                   "samples": len(rtts)},
        "throughput": {"version": source["version"], "kind": source["kind"], "range_bytes": s.range_bytes,
                       "one": one, "parallel": many},
        "head": {"version": head, "kinds": fetched},
    }
