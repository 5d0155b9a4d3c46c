"""The console's reader: every `poll_s` it reads the mesh (gateways, their pools' status servers, the
broker, trainers' metrics: mesh/console/sources.py), folds the answers into what it remembers
(mesh/console/history.py), and makes one snapshot, the JSON the page shows (mesh/console/panels.py).

The snapshot is encoded once per round and handed to every browser as it is, so a page costs the
console a dictionary look-up, whatever the mesh's size. Pools are remembered by name: one whose
gateway stops answering stays listed, flagged stale, with what was last known of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from deltamesh.broker_client import STATUS_PATH, BrokerClient
from deltamesh.http import client_session
from deltamesh.mesh.console import panels, sources
from deltamesh.mesh.console.config import ConsoleConfig
from deltamesh.mesh.console.history import Rates, VersionHistory
from deltamesh.signals import sleep_or_stop
from deltamesh.tls import TlsSettings

log = logging.getLogger(__name__)

MAX_POOLS = 4096
"""Pools remembered at most (the oldest seen is forgotten first)."""


class Collector:
    """Reads the mesh as `config` says; `snapshot_json` is the newest round's snapshot, encoded."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.history = VersionHistory(config.keep_versions)
        self.rates = Rates()
        self.snapshot: dict[str, Any] = {"generated_at": None, "poll_s": config.poll_s}
        self.snapshot_json = json.dumps(self.snapshot).encode()
        self._pools: dict[str, dict[str, Any]] = {}
        self._behind_since: dict[str, float] = {}
        self._seen_version: dict[str, int] = {}
        self._regions: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._open: aiohttp.ClientSession | None = None
        self._broker: BrokerClient | None = None

    async def open(self) -> None:
        """Open the connections it reads with (inside the event loop that runs it)."""
        tls = self.config.tls
        self._session = client_session(connections=32, timeout_s=self.config.timeout_s, tls=tls)
        # Pools and trainers take no token and need no client certificate: none is presented to them.
        self._open = client_session(connections=32, timeout_s=self.config.timeout_s, tls=TlsSettings(ca=tls.ca))
        if self.config.broker:
            self._broker = BrokerClient(self.config.broker, token=self.config.broker_token, tls=tls,
                                        timeout_s=self.config.timeout_s, failover_s=0)

    async def close(self) -> None:
        for session in (self._session, self._open):
            if session is not None:
                await session.close()
        if self._broker is not None:
            await self._broker.close()

    async def __aenter__(self) -> "Collector":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self, stop: asyncio.Event) -> None:
        """Read the mesh every `poll_s` until `stop`; a round that fails is logged and the next one tried."""
        while not stop.is_set():
            try:
                await self.read()
            except Exception:  # a bug in one round must not end the console: the next round may pass
                log.exception("console: reading the mesh failed")
            await sleep_or_stop(stop, self.config.poll_s)

    async def read(self) -> dict[str, Any]:
        cfg = self.config
        started = time.perf_counter()
        gateways = await asyncio.gather(*(sources.read_gateway(url, self._session, token=cfg.token,
                                                               insecure=cfg.tls.insecure, timeout_s=cfg.timeout_s)
                                          for url in cfg.gateways))
        now = time.time()
        for g in gateways:  # a gateway that stops answering keeps the region it had
            if g["region"]:
                self._regions[g["url"]] = g["region"]
            else:
                g["region"] = self._regions.get(g["url"], "")
        self._remember_pools(gateways, now)
        statuses, broker, trainers = await asyncio.gather(self._read_pools(), self._read_broker(), self._read_trainers())
        self._note_versions(gateways, statuses, now)
        heads = self._heads(gateways)
        pools = self._pool_rows(gateways, statuses, trainers, heads)
        origin = next((g["region"] for g in gateways if g["ok"] and g["origin"]), "")
        graph = panels.mesh_graph(gateways, pools, self.rates)
        parents = {e["to"]: e["from"] for e in graph["links"]}
        self.snapshot = {
            "generated_at": now, "poll_s": cfg.poll_s, "stale_after_s": cfg.stale_after_s,
            "gateways": [{k: g[k] for k in ("url", "region", "origin", "ok", "error", "access", "heads")}
                         for g in gateways],
            "graph": graph, "pools": pools,
            "models": {m: self._model_panel(m, heads.get(m), origin, parents, graph, pools)
                       for m in sorted(set(heads) | set(self.history.models()))},
            "broker": panels.broker_panel(broker, self.rates),
        }
        self.snapshot["read_s"] = round(time.perf_counter() - started, 4)
        self.snapshot_json = json.dumps(self.snapshot).encode()
        return self.snapshot

    def _model_panel(self, model: str, head: int | None, origin: str, parents: dict[str, str],
                     graph: dict[str, Any], pools: list[dict[str, Any]]) -> dict[str, Any]:
        """The model's head and version timelines; the head's names the places it has not reached yet."""
        versions = self.history.describe(model, origin, parents)
        places = [n["id"] for n in graph["nodes"] if n["kind"] == "gateway"]
        places += [f"pool:{p['name']}" for p in pools if p["model"] == model]
        for v in versions:
            if v["version"] == head:
                v["missing"] = sorted(set(places) - set(v["after_s"]))
        return {"head": head, "versions": versions}

    def _remember_pools(self, gateways: list[dict[str, Any]], now: float) -> None:
        for g in gateways:
            for p in self._pools.values():
                if p["gateway"] == g["url"]:
                    p["gateway_ok"] = g["ok"] and g["error"] == ""
            if not g["ok"] or g["error"]:
                continue
            links = {link["peer"]: link for link in g["links"] if link["role"] == "pool"}
            listed = {p["name"] for p in g["pools"]}
            for name in [n for n, p in self._pools.items() if p["gateway"] == g["url"] and n not in listed]:
                del self._pools[name]  # deregistered (or forgotten by its gateway): gone
            for p in g["pools"]:
                self._pools[p["name"]] = {"record": p, "region": g["region"], "gateway": g["url"], "gateway_ok": True,
                                          "link": links.get(p["name"]), "seen_at": now}
        while len(self._pools) > MAX_POOLS:
            del self._pools[min(self._pools, key=lambda n: self._pools[n]["seen_at"])]

    async def _read_pools(self) -> dict[str, dict[str, Any]]:
        """Each pool endpoint's status (pools of several policies register one stream each, one endpoint)."""
        if not self.config.read_pools:
            return {}
        endpoints = sorted({p["record"].get("endpoint", "") for p in self._pools.values()} - {""})
        answers = await asyncio.gather(*(sources.read_open_json(self._open, f"{e.rstrip('/')}{STATUS_PATH}",
                                                                self.config.timeout_s) for e in endpoints))
        return {e: a for e, a in zip(endpoints, answers) if a is not None}

    async def _read_broker(self) -> dict[str, Any] | None:
        if self._broker is None:
            return None
        return await sources.read_broker(self._broker, self._session, token=self.config.broker_token,
                                         timeout_s=self.config.timeout_s)

    async def _read_trainers(self) -> dict[tuple[str, str], dict]:
        out: dict[tuple[str, str], dict] = {}
        for found in await asyncio.gather(*(sources.read_trainer(self._open, url, self.config.timeout_s)
                                            for url in self.config.trainers)):
            out.update(found)
        return out

    def _note_versions(self, gateways: list[dict[str, Any]], statuses: dict[str, dict[str, Any]], now: float) -> None:
        for g in gateways:
            for model, listing in g["versions"].items():
                for entry in listing:
                    if entry.get("stored_at") is not None:
                        self.history.stored(model, int(entry["version"]), g["region"], float(entry["stored_at"]))
        for name, p in self._pools.items():
            model, status = p["record"].get("model", ""), statuses.get(p["record"].get("endpoint", ""))
            timeline = (((status or {}).get("models") or {}).get(model) or {}).get("timeline")
            if isinstance(timeline, dict):
                for version, stages in timeline.items():
                    if isinstance(stages, dict) and stages.get("serving") is not None and str(version).isdigit():
                        self.history.serving(model, int(version), name, float(stages["serving"]))
                continue
            version = self._version_of(p, status)
            seen = self._seen_version.get(name)
            if version is not None and seen is not None and version > seen:
                # No timeline from this pool (`pool sync`): the round that first saw it there.
                self.history.serving(model, version, name, now, replace=False)
            if version is not None:
                self._seen_version[name] = version

    @staticmethod
    def _version_of(pool: dict[str, Any], status: dict[str, Any] | None) -> int | None:
        """The version a pool serves: its own status's word where read, else its last heartbeat's."""
        model = pool["record"].get("model", "")
        if status is not None:
            entry = (status.get("models") or {}).get(model)
            if isinstance(entry, dict) and isinstance(entry.get("engine_version"), int):
                return entry["engine_version"]
            if status.get("model") == model and isinstance(status.get("version"), int):
                return status["version"]
        version = pool["record"].get("version")
        return version if isinstance(version, int) else None

    @staticmethod
    def _heads(gateways: list[dict[str, Any]]) -> dict[str, int]:
        heads: dict[str, int] = {}
        for g in gateways:
            for model, head in g["heads"].items():
                if isinstance(head, int):
                    heads[model] = max(head, heads.get(model, head))
        return heads

    def _pool_rows(self, gateways: list[dict[str, Any]], statuses: dict[str, dict[str, Any]],
                   trainers: dict[tuple[str, str], dict], heads: dict[str, int]) -> list[dict[str, Any]]:
        rows, now = [], time.monotonic()
        for name, p in sorted(self._pools.items()):
            record, status = p["record"], statuses.get(p["record"].get("endpoint", ""))
            model = record.get("model", "")
            version, head = self._version_of(p, status), heads.get(model)
            behind = None if version is None or head is None else max(0, head - version)
            if behind:
                since = self._behind_since.setdefault(name, now)
            else:
                self._behind_since.pop(name, None)
                since = now
            up = bool(record.get("up", True))
            state, why = panels.pool_state(behind, now - since, gateway_ok=p["gateway_ok"], up=up,
                                           stale_after_s=self.config.stale_after_s)
            worker = (status or {}).get("worker") or {}
            endpoint = record.get("endpoint", "")
            self.rates.add(f"leased:{endpoint}", worker.get("leased"))
            self.rates.add(f"reported:{endpoint}", worker.get("submitted"))
            pool_name = (status or {}).get("name") or name
            rows.append({
                "name": name, "region": p["region"], "model": model, "version": version, "head": head,
                "behind": behind, "state": state, "why": why, "up": up, "gateway_ok": p["gateway_ok"],
                "engine": record.get("engine", ""),
                "last_seen_s": None if record.get("last_seen_s") is None
                else record["last_seen_s"] + time.time() - p["seen_at"],
                "status_read": status is not None, "proof": panels.proof(status, model),
                "mismatch": trainers.get((model, pool_name)),
                "leased_per_min": self.rates.per_minute(f"leased:{endpoint}") if worker else None,
                "reported_per_min": self.rates.per_minute(f"reported:{endpoint}") if worker else None,
                "link": p["link"],
            })
        return rows
