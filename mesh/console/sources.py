"""One read of each kind of service the console shows: a gateway, a pool's status server, the broker,
a trainer's metrics. Each returns a plain dict (its `error` says why a part is missing) and never
raises for a service that does not answer: the page shows what is known.

Credentials go only where the operator sent them: the console's gateway token to the gateways it was
given, its broker token to the broker. Pools' status servers and trainers' metrics take no token
(docs/CONFIG.md) and get none; their answers are read up to `MAX_OPEN_BODY` bytes, since a pool's
endpoint is a URL a pool registered, not one the operator chose.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from deltamesh.broker_client import BrokerClient
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError, bearer, request_bytes, request_json
from deltamesh.mesh.console import prom

MAX_OPEN_BODY = 1024 * 1024
"""Largest answer read from a pool's status server or a trainer's metrics."""


def refusal(e: HttpError, what: str) -> str:
    if e.status == 401:
        return f"{what}: the console's token was refused (401)"
    if e.status == 403:
        return f"{what}: the console's token may not read this (403; an admin token may)"
    return f"{what}: {e}"


async def read_gateway(url: str, session: aiohttp.ClientSession, *, token: str, insecure: bool,
                       timeout_s: float) -> dict[str, Any]:
    """A gateway's health, heads, pools, links and version listings (`access` "admin"), or, where its
    token is refused those routes, what its /metrics carry (`access` "metrics")."""
    out: dict[str, Any] = {"url": url, "ok": False, "error": "", "region": "", "origin": False, "upstreams": [],
                           "heads": {}, "pools": [], "links": [], "versions": {}, "access": ""}
    try:
        health = await request_json(session, "GET", f"{url}/healthz", timeout_s=timeout_s)
    except HttpError as e:
        out["error"] = f"not answering: {e.reason}"
        return out
    out.update(ok=True, region=str(health.get("region", "")), origin=bool(health.get("origin")),
               upstreams=[str(u) for u in health.get("upstreams") or []],
               disk_full=bool((health.get("disk") or {}).get("full")))
    client = GatewayClient(url, session, token=token or None, insecure=insecure, timeout_s=timeout_s)
    try:
        pools, links, models = await asyncio.gather(client.pools(), client.links(), client.models())
    except HttpError as e:
        if e.status != 403:
            out["error"] = refusal(e, "pools and links")
            return out
        return await _from_metrics(out, url, session, token, timeout_s)
    out.update(access="admin", pools=pools["pools"], links=links["links"], heads=dict(models["models"]))
    listings = await asyncio.gather(*(client.versions(m) for m in out["heads"]), return_exceptions=True)
    for model, listing in zip(out["heads"], listings):
        if isinstance(listing, dict):
            out["versions"][model] = listing["versions"]
    return out


async def _from_metrics(out: dict[str, Any], url: str, session: aiohttp.ClientSession, token: str,
                        timeout_s: float) -> dict[str, Any]:
    try:
        raw = await request_bytes(session, "GET", f"{url}/metrics", headers=bearer(token) if token else None,
                                  timeout_s=timeout_s)
    except HttpError as e:
        out["error"] = refusal(e, "metrics")
        return out
    samples = prom.parse_metrics(raw.decode(errors="replace"))
    out.update(access="metrics", pools=prom.gateway_pools(samples), links=prom.gateway_links(samples),
               heads=prom.gateway_heads(samples))
    return out


async def read_open_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, Any] | None:
    """A JSON object from a server that takes no token (a pool's status), or None."""
    raw = await read_open(session, url, timeout_s)
    try:
        answer = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


async def read_open(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bytes | None:
    """At most MAX_OPEN_BODY bytes of a 200 answer from a server that takes no token, or None."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.content.read(MAX_OPEN_BODY + 1)
            return raw if resp.status == 200 and len(raw) <= MAX_OPEN_BODY else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def read_broker(client: BrokerClient, session: aiohttp.ClientSession, *, token: str,
                      timeout_s: float) -> dict[str, Any]:
    """The broker's buffers (status), counters (metrics) and balance report (admin only)."""
    out: dict[str, Any] = {"url": client.base, "ok": False, "error": "", "status": None, "samples": {},
                           "balance": None, "balance_error": ""}
    try:
        out["status"] = await client.status()
    except HttpError as e:
        out["error"] = f"not answering: {e.reason}" if e.status == 0 else refusal(e, "status")
        return out
    out["ok"] = True
    try:
        raw = await request_bytes(session, "GET", f"{client.base}/metrics",
                                  headers=bearer(token) if token else None, timeout_s=timeout_s)
        out["samples"] = prom.parse_metrics(raw.decode(errors="replace"))
    except HttpError as e:
        out["error"] = refusal(e, "metrics")
    try:
        out["balance"] = await client.balance()
    except HttpError as e:
        out["balance_error"] = refusal(e, "balance report")
    return out


async def read_trainer(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[tuple[str, str], dict]:
    """A trainer's mismatch readings: (model_id, pool) -> {"abs", "k3", "flagged"}."""
    raw = await read_open(session, f"{url}/metrics", timeout_s)
    samples = prom.parse_metrics(raw.decode(errors="replace")) if raw is not None else {}
    out: dict[tuple[str, str], dict] = {}
    for series, key in (("deltamesh_trainer_mismatch", "abs"), ("deltamesh_trainer_mismatch_k3", "k3"),
                        ("deltamesh_trainer_mismatch_flagged", "flagged")):
        for labels, value in samples.get(series, []):
            out.setdefault((labels.get("model_id", ""), labels.get("pool", "")), {})[key] = value
    return out
