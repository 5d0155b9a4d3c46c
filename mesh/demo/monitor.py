"""Polling the running mesh: every service's JSON endpoints and the trainers' step files, into `MeshState`.

One `poll` reads, concurrently: each model's version listing at every gateway (at the origin: payload
sizes and weights hashes; at each: when it held each version whole), each relay gateway's per-version
traffic (what came over its upstream link for each version), every gateway's link monitor (RTT of its upstream link, bytes served to each of its pools),
every pool's own status, the broker's status and balance report, the evaluator's results and status,
and the new lines of each trainer's metrics file. A service
that does not answer is skipped for this round (it may be busy or still starting); the view shows
what is known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp

from deltamesh.broker_client import BALANCE_PATH, EVALS_PATH, STATUS_PATH
from deltamesh.gateway_client import LINKS_PATH, model_path
from deltamesh.http import HttpError, request_json
from deltamesh.mesh.demo.launch import MeshPlan
from deltamesh.mesh.demo.state import LinkReading, MeshState, PoolReading

log = logging.getLogger(__name__)

TIMEOUT_S = 3.0


class StepFile:
    """Reads a trainer's metrics file line by line as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class Monitor:
    def __init__(self, plan: MeshPlan, session: aiohttp.ClientSession):
        self.plan = plan
        self.session = session
        cfg = plan.config
        self.state = MeshState(cfg.model_ids, upstreams={g.region: g.upstream for g in cfg.topology.gateways})
        self.upload_link = f"trainer->{cfg.topology.origin.region}"
        for spec in cfg.topology.relays():
            self.state.links[spec.link] = LinkReading(spec.link, spec.bandwidth_mbps, spec.delay_ms)
        for pool in cfg.topology.pools:
            self.state.pools[pool.name] = PoolReading(pool.name, pool.region)
        self.step_files = {m: StepFile(plan.metrics_file(m)) for m in cfg.model_ids}

    async def _get(self, url: str) -> Any:
        try:
            return await request_json(self.session, "GET", url, timeout_s=TIMEOUT_S)
        except HttpError as e:
            log.debug("poll %s: %s", url, e)
            return None

    async def poll(self) -> MeshState:
        plan, state = self.plan, self.state
        topo = plan.config.topology
        jobs: list[Any] = []
        for spec in topo.gateways:
            gw = plan.gateways[spec.region].url
            for model_id in plan.config.model_ids:
                jobs.append(self._version_facts(gw, model_id, spec.region, spec.link))
            jobs.append(self._links(gw, spec.region, spec.link))
        for name, service in plan.pools.items():
            jobs.append(self._pool(name, service.url))
        if plan.broker is not None:
            jobs.append(self._broker(plan.broker.url))
        if plan.evaluator is not None:
            jobs.append(self._evaluator(plan.evaluator.url))
        await asyncio.gather(*jobs)
        self.read_steps()
        return state

    def read_steps(self) -> None:
        """Take in the trainers' new step records (also after they stopped: their last ones)."""
        for model_id, steps in self.step_files.items():
            for record in steps.new_records():
                self.state.trainer_step(model_id, record, self.upload_link)

    async def _version_facts(self, gateway: str, model_id: str, region: str, link: str) -> None:
        listing = self._get(f"{gateway}{model_path(model_id, 'versions')}")
        if link:
            answer, listed = await asyncio.gather(self._get(f"{gateway}{model_path(model_id, 'traffic')}"), listing)
            if answer is not None:
                self.state.relay_traffic(model_id, link, answer["versions"])
        else:
            listed = await listing
            if listed is not None:
                self.state.origin_listing(model_id, listed["versions"])
        if listed is not None:
            self.state.gateway_listing(model_id, region, listed["versions"])

    async def _links(self, gateway: str, region: str, link: str) -> None:
        answer = await self._get(f"{gateway}{LINKS_PATH}")
        if answer is None:
            return
        for entry in answer["links"]:
            if entry["role"] == "upstream" and link:
                reading = self.state.links[link]
                reading.rtt_ms = entry["rtt_ms"]["p50"]
                reading.bytes_total = int(entry["bytes_total"])
                reading.throughput_bps = entry["throughput_bps"]
            elif entry["role"] == "pool":
                self._pool_link(region, entry)

    def _pool_link(self, region: str, entry: dict[str, Any]) -> None:
        for name, reading in self.state.pools.items():
            if reading.region != region:
                continue
            for model_id in self.plan.config.model_ids:
                if entry["peer"] == self.plan.registration(name, model_id):
                    reading.pulled[model_id] = int(entry["bytes_total"])
                    if len(self.plan.config.model_ids) == 1 or model_id == self.plan.config.model_ids[0]:
                        reading.rtt_ms = entry["rtt_ms"]["p50"]

    async def _pool(self, name: str, url: str) -> None:
        status = await self._get(f"{url}{STATUS_PATH}")
        if status is not None:
            self.state.pool_status(name, status, time.time())

    async def _evaluator(self, url: str) -> None:
        results, status = await asyncio.gather(self._get(f"{url}{EVALS_PATH}"), self._get(f"{url}{STATUS_PATH}"))
        if results is not None:
            self.state.evals = list(results["results"])
        if status is not None:
            self.state.eval_status = status

    async def request_eval(self, version: int) -> bool:
        """Ask the evaluator (as the run's admin) to score `version` too; False if it did not answer."""
        assert self.plan.evaluator is not None
        try:
            await request_json(self.session, "POST", f"{self.plan.evaluator.url}{EVALS_PATH}",
                               body={"version": version}, timeout_s=TIMEOUT_S)
        except HttpError as e:
            log.debug("asking the evaluator for v%d: %s", version, e)
            return False
        return True

    async def _broker(self, url: str) -> None:
        status, balance = await asyncio.gather(self._get(f"{url}{STATUS_PATH}"), self._get(f"{url}{BALANCE_PATH}"))
        if status is not None:
            self.state.broker["status"] = status
        if balance is not None:
            self.state.broker["balance"] = balance
