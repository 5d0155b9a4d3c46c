"""The console's panels as plain data, built from one round of readings (mesh/console/sources.py) and
what the console remembers (mesh/console/history.py): the mesh graph with its links, the pools, the
broker. Pure functions: everything they show comes in as arguments, so each is tested on its own.

Health, as the page colours it: a link is `down` when its far end does not answer the console or its
gateway lists the pool down, `errors` when its error count grew within the last minute, `slow` when
its RTT p95 is over `SLOW_RTT_MS`, else `ok`. A pool is `current` at its model's head, `behind`
while it catches up, and `stale` once it has been behind for `stale_after_s`, or at once when its
gateway does not answer or lists it down: it gets no new version then.
"""

from __future__ import annotations

from typing import Any

from deltamesh.mesh.console import prom
from deltamesh.mesh.console.history import Rates

SLOW_RTT_MS = 250.0


def link_health(link: dict[str, Any], *, far_down: bool, errors_grew: bool) -> str:
    if far_down or link.get("up") is False:
        return "down"
    if errors_grew:
        return "errors"
    p95 = (link.get("rtt_ms") or {}).get("p95")
    return "slow" if p95 is not None and p95 > SLOW_RTT_MS else "ok"


def mesh_graph(gateways: list[dict[str, Any]], pools: list[dict[str, Any]], rates: Rates) -> dict[str, Any]:
    """Nodes (gateways, with their depth from the origin, and pools) and edges (upstream -> relay, gateway
    -> pool) with each link's figures, from every gateway's own links."""
    region_of = {g["url"]: g["region"] for g in gateways if g["region"]}
    for g in gateways:
        for link in g["links"]:
            if link["role"] == "downstream" and link.get("url"):
                region_of.setdefault(link["url"].rstrip("/"), link["peer"])
    answering = {g["region"] for g in gateways if g["ok"] and g["region"]}
    nodes: dict[str, dict[str, Any]] = {}
    for g in gateways:
        name = g["region"] or g["url"]
        nodes[name] = {"id": f"gateway:{name}", "kind": "gateway", "name": name, "url": g["url"], "ok": g["ok"],
                       "origin": g["origin"], "error": g["error"], "read": True, "access": g["access"]}
    edges: dict[tuple[str, str], dict[str, Any]] = {}
    for g in gateways:
        here = g["region"] or g["url"]
        for link in g["links"]:
            if link["role"] == "upstream":
                src, dst = region_of.get(link["peer"].rstrip("/"), link["peer"]), here
            elif link["role"] == "downstream":
                src, dst = here, link["peer"]
            else:
                continue
            for name in (src, dst):
                nodes.setdefault(name, {"id": f"gateway:{name}", "kind": "gateway", "name": name, "url": "",
                                        "ok": None, "origin": False, "error": "", "read": False, "access": ""})
            if (src, dst) in edges and link["role"] == "downstream":
                continue  # the relay's own view of its upstream link (bytes it received) wins
            key = f"{link['role']}:{here}:{link['peer']}"
            rates.add(key, link.get("errors"))
            far = dst if link["role"] == "downstream" else src
            edges[(src, dst)] = _edge(f"gateway:{src}", f"gateway:{dst}", "relay", link,
                                      link_health(link, far_down=far not in answering and nodes[far]["read"],
                                                  errors_grew=bool(rates.change(key))))
    for p in pools:
        link = p.get("link")
        nodes[f"pool:{p['name']}"] = {"id": f"pool:{p['name']}", "kind": "pool", "name": p["name"],
                                      "region": p["region"], "state": p["state"], "ok": p["up"]}
        key = f"pool:{p['region']}:{p['name']}"
        rates.add(key, (link or {}).get("errors"))
        edges[(p["region"], f"pool:{p['name']}")] = _edge(
            f"gateway:{p['region']}", f"pool:{p['name']}", "pool", link or {},
            link_health(link or {}, far_down=not p["up"] or not p["gateway_ok"], errors_grew=bool(rates.change(key))))
    depth = _depths(nodes, edges)
    for name, node in nodes.items():
        node["depth"] = depth.get(name, 0)
    return {"nodes": list(nodes.values()), "links": list(edges.values())}


def _edge(src: str, dst: str, kind: str, link: dict[str, Any], health: str) -> dict[str, Any]:
    rtt = link.get("rtt_ms") or {}
    return {"from": src, "to": dst, "kind": kind, "rtt_p50_ms": rtt.get("p50"), "rtt_p95_ms": rtt.get("p95"),
            "throughput_bps": link.get("throughput_bps"), "bytes_total": link.get("bytes_total"),
            "errors": link.get("errors", 0), "last_error": link.get("last_error", ""), "health": health}


def _depths(nodes: dict[str, dict[str, Any]], edges: dict[tuple[str, str], dict[str, Any]]) -> dict[str, int]:
    """Hops from an origin (gateways with no upstream edge count as roots); pools one below their gateway."""
    parents: dict[str, str] = {dst: src for (src, dst), e in edges.items() if e["kind"] == "relay"}
    out: dict[str, int] = {}
    for name in nodes:
        seen, at, hops = set(), name, 0
        while at in parents and at not in seen:
            seen.add(at)
            at, hops = parents[at], hops + 1
        out[name] = hops
    for (src, dst), e in edges.items():
        if e["kind"] == "pool":
            out[dst] = out.get(src, 0) + 1
    return out


def pool_state(behind: int | None, behind_for_s: float, *, gateway_ok: bool, up: bool,
               stale_after_s: float) -> tuple[str, str]:
    """(state, why) of a pool: current, behind or stale (see the module docstring)."""
    if not gateway_ok:
        return "stale", "its gateway does not answer"
    if not up:
        return "stale", "its gateway lists it down (no heartbeat)"
    if behind is None:
        return "unknown", "no version yet"
    if behind <= 0:
        return "current", ""
    if behind_for_s >= stale_after_s:
        return "stale", f"{behind} version(s) behind for {behind_for_s:.0f} s"
    return "behind", f"{behind} version(s) behind"


def proof(status: dict[str, Any] | None, model: str) -> dict[str, Any] | None:
    """The last check of what the pool's engine serves (docs/PROOF.md), from its status; None for a pool
    without an engine (`pool sync`) or whose status was not read."""
    entry = ((status or {}).get("models") or {}).get(model)
    if not isinstance(entry, dict):
        return None
    checks = entry.get("checks") or {}
    failed = bool(entry.get("drifted")) or (checks.get("failed", 0) > 0 and not checks.get("ok", 0))
    return {"text": str(entry.get("last_check", ""))[:300], "ok": not failed if entry.get("last_check") else None,
            "checks_ok": checks.get("ok", 0), "checks_failed": checks.get("failed", 0),
            "drifted": bool(entry.get("drifted"))}


def broker_panel(reading: dict[str, Any] | None, rates: Rates) -> dict[str, Any] | None:
    """Queue depths per policy, ingest rate, batch time, groups dropped as stale, and the balance report
    with the scaling it calls for."""
    if reading is None:
        return None
    samples = reading["samples"]
    status = reading["status"] or {}
    models = {}
    for model, buf in sorted((status.get("models") or {}).items()):
        ingested = prom.total(samples, "deltamesh_broker_trajectories_ingested_total", model_id=model)
        stale = prom.total(samples, "deltamesh_broker_groups_total", model_id=model, outcome="stale")
        batch = prom.histogram_mean(samples, "deltamesh_broker_batch_build_seconds", model_id=model)
        rates.add(f"broker:ingested:{model}", ingested)
        rates.add(f"broker:stale:{model}", stale)
        if batch is not None:
            rates.add(f"broker:batch_sum:{model}", batch[0])
            rates.add(f"broker:batch_count:{model}", batch[1])
        built, took = rates.change(f"broker:batch_count:{model}"), rates.change(f"broker:batch_sum:{model}")
        if built and took is not None:
            latency_ms = 1e3 * took / built  # over the last minute
        else:
            latency_ms = 1e3 * batch[0] / batch[1] if batch and batch[1] else None
        models[model] = {**{k: buf.get(k) for k in ("version", "fresh_groups", "fresh_samples", "replay_groups",
                                                    "replay_samples", "unacked_batches")},
                         "ingested_total": ingested, "ingest_per_min": rates.per_minute(f"broker:ingested:{model}"),
                         "batch_ms": latency_ms, "stale_dropped_total": stale,
                         "stale_per_min": rates.per_minute(f"broker:stale:{model}")}
    return {"url": reading["url"], "ok": reading["ok"], "error": reading["error"], "models": models,
            "tasks": status.get("tasks"), "balance": balance_summary(reading["balance"]),
            "balance_error": reading["balance_error"]}


def balance_summary(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The balance report as the autoscaler acts on it: rollout GPUs now, the target, and the move."""
    if report is None:
        return None
    gpus, target = report.get("gpus", 0), report.get("target_gpus", 0)
    move = "scale up" if target > gpus else "scale down" if target < gpus else "hold"
    return {"gpus": gpus, "target_gpus": target, "decision": f"{move}: {gpus} -> {target} GPUs" if move != "hold"
            else f"hold at {gpus} GPUs",
            "models": {m: {"wait_fraction": r.get("wait_fraction"), "target_gpus": r.get("target_gpus")}
                       for m, r in sorted((report.get("models") or {}).items())}}
