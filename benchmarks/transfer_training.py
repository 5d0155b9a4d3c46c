"""The real_training transfer scenario: successive real SmolLM2-135M versions over the fan-out mesh.

The fan-out network of scenario 3 (origin, 3 regions over long links, 4 pools per region) runs an
origin gateway, one relay gateway per region and a real `deltamesh pool sync` agent in every pool
host, each keeping its own safetensors directory at the head. A publisher agent at the origin
(`deltamesh.trainer.publisher.Publisher`, a full snapshot every 10 versions) publishes version 0 (the
pretrained checkpoint, a full snapshot) and then one version every `step_seconds`, as a trainer does
after each step, without waiting for the pools. The benchmark watches the pools' directories (which
version each holds, read from its manifest file) and reports per version the bytes shipped, delta vs
full, the seconds from the start of its publish until every pool holds it (or a newer one), and the
pools' staleness: how many versions behind the newest published version each pool is, sampled over
the run from the first delta on.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from datetime import datetime
from pathlib import Path

from transfer_mesh import DELTAMESH, POOL_TOKEN, set_tcp_buffers
from transfer_runs import Scenario, Settings, build_topology, work_dir
from transfer_scenarios import REGIONS
from transfer_steps import load_costs, steps_dir
from wan import Wan, WanError

from deltamesh.delta import dir_manifest
from deltamesh.delta.errors import CodecError

log = logging.getLogger(__name__)

MODEL_ID = "smollm2-rl"
LR = 5e-6
FULL_EVERY = 10
POLL_S = 0.05
STALENESS_SAMPLE_S = 0.1


def real_training(settings: Settings, *, steps: int = 10, step_seconds: float = 6.0,
                  pools_per_region: int = 4, settle_s: float = 600.0) -> dict:
    folder = steps_dir(LR, 10)  # always the same 10 cached steps; a quick run uses the first few
    costs = load_costs(folder)[: steps + 1]
    with work_dir(settings) as work, Wan("txt") as wan:
        build_topology(wan, "fanout", settings.rtt_scale, settings.pool_rtt_ms)
        run = Scenario(wan, settings, work)
        origin = run.host("origin")
        pools = [run.host(f"pool{r[-1]}{i}") for r in REGIONS for i in range(1, pools_per_region + 1)]
        set_tcp_buffers(wan, settings.tcp_buffers, settings.congestion, settings.initcwnd)
        gateway = run.mesh.gateway(origin, "origin")
        relays = {r: run.mesh.gateway(run.host(r), r, [gateway], relay_connections=settings.connections)
                  for r in REGIONS}
        dirs = {}
        for pool in pools:
            dirs[pool.name] = run.mesh.work / "pools" / pool.name
            token = run.mesh.work / "pool.token"  # a token never goes on a command line: a private file
            if not token.exists():
                token.write_text(POOL_TOKEN + "\n")
                token.chmod(0o600)
            run.mesh.spawn_logged(pool, f"sync-{pool.name}", [
                DELTAMESH, "pool", "sync", "--gateway", relays[f"region{pool.name[4]}"], "--token-file", str(token),
                "--name", pool.name, "--dir", str(dirs[pool.name]), "--trusted-key", str(run.mesh.public_key),
                "--model", MODEL_ID, "--connections", "4", "--heartbeat-s", "1",
                # The emulated WAN is plain http between namespaces: the pools' token may travel in clear.
                "--insecure"])
        batch = run.mesh.batch()
        batch.add(origin, "publish", "publish-steps", "--gateway", gateway, "--steps-dir", str(folder),
                  "--count", str(steps + 1), "--model", MODEL_ID, "--key", str(run.mesh.private_key),
                  "--full-every", str(FULL_EVERY), "--step-seconds", str(step_seconds))
        t0 = batch.start(timeout_s=300)
        reached = watch_pools(batch, dirs, steps, settle_s)
        published = batch.finish(120)["publish"]["versions"]
        egress = run.mesh.gateway_bytes_out(origin)
        wan_link = origin.link_to(run.host("regionA"))
        stages = stage_times(work, published, [p.name for p in pools])
    out = training_json(costs, published, reached, t0, step_seconds, len(pools))
    for version in out["versions"]:
        version.update(stages.get(version["version"], {}))
    out["link"] = {"mbit": wan_link.mbit_ab, "rtt_ms": wan_link.rtt_ms}
    out["tcp_buffers"], out["connections"] = settings.tcp_buffers, settings.connections
    out["congestion"] = settings.congestion
    out["origin_egress_bytes"] = egress
    out["published_bytes"] = sum(sum(v["published_bytes"].values()) for v in out["versions"])
    out["methods"]["deltamesh"]["origin_egress_bytes"] = egress
    return out


def watch_pools(batch, dirs: dict[str, Path], last: int, settle_s: float) -> dict[str, dict[int, float]]:
    """Poll every pool's directory until all hold `last`; pool -> {version: first time held}."""
    reached: dict[str, dict[int, float]] = {name: {} for name in dirs}
    publisher = batch.agents[0]
    deadline = None
    while True:
        now = time.time()
        for name, path in dirs.items():
            version = held_version(path)
            if version is not None and version not in reached[name]:
                reached[name][version] = now
        if all(last in r or any(v > last for v in r) for r in reached.values()):
            return reached
        if publisher.proc.poll() is not None:
            if publisher.proc.returncode != 0:
                raise WanError(f"publisher failed:\n{publisher.log_tail()}")
            deadline = deadline or time.monotonic() + settle_s
        if deadline is not None and time.monotonic() > deadline:
            behind = {n: max(r, default=None) for n, r in reached.items() if last not in r}
            raise WanError(f"pools did not reach v{last} within {settle_s:g} s of the last publish: {behind}")
        time.sleep(POLL_S)


LOG_TIME = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
RELAYED = re.compile(LOG_TIME + r".*relay: \S+ v(\d+) (delta|full) complete")
PLANNED = re.compile(LOG_TIME + r".*pool \S+: plan v\S+ -> v(\d+):")
APPLIED = re.compile(LOG_TIME + r".*pool \S+: now at \S+ v(\d+)")


def _log_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def stage_times(work: Path, published: list[dict], pools: list[str]) -> dict[int, dict]:
    """Where each version's time went, from the gateways' and pool agents' logs (medians over hosts):
    seconds from its publish until a region gateway holds it, the same from the end of its publish
    (the origin holds it: `after_publish`, also the slowest region's), and a pool's fetch-and-apply
    seconds (from its plan to the version landing in its directory)."""
    starts = {p["version"]: p["t_start"] for p in published}
    ends = {p["version"]: p["t_done"] for p in published}
    relayed: dict[int, list[float]] = {}
    after: dict[int, list[float]] = {}
    for region in REGIONS:
        for line in _read(work / f"gateway-{region}.log"):
            m = RELAYED.match(line)
            if m and m.group(3) == "delta" or (m and int(m.group(2)) == 0):
                v = int(m.group(2))
                relayed.setdefault(v, []).append(_log_time(m.group(1)) - starts.get(v, 0.0))
                after.setdefault(v, []).append(_log_time(m.group(1)) - ends.get(v, 0.0))
    applying: dict[int, list[float]] = {}
    for pool in pools:
        planned: dict[int, float] = {}
        for line in _read(work / f"sync-{pool}.log"):
            if m := PLANNED.match(line):
                planned[int(m.group(2))] = _log_time(m.group(1))
            elif (m := APPLIED.match(line)) and int(m.group(2)) in planned:
                applying.setdefault(int(m.group(2)), []).append(_log_time(m.group(1)) - planned[int(m.group(2))])
    return {v: {"to_regions_seconds": round(statistics.median(relayed[v]), 3) if v in relayed else None,
                "to_regions_after_publish_seconds": round(statistics.median(after[v]), 3) if v in after else None,
                "to_last_region_after_publish_seconds": round(max(after[v]), 3) if v in after else None,
                "pool_fetch_apply_seconds": round(statistics.median(applying[v]), 3) if v in applying else None}
            for v in starts}


def _read(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def held_version(path: Path) -> int | None:
    try:
        manifest = dir_manifest(path) if path.exists() else None
    except (CodecError, OSError):  # caught mid-swap: look again next poll
        return None
    return None if manifest is None else manifest.version


def training_json(costs: list[dict], published: list[dict], reached: dict[str, dict[int, float]], t0: float,
                  step_seconds: float, pools: int) -> dict:
    def time_to_hold(pool: dict[int, float], version: int) -> float | None:
        times = [t for v, t in pool.items() if v >= version]
        return min(times) if times else None

    versions = []
    for cost, pub in zip(costs, published):
        v = cost["version"]
        holds = [time_to_hold(r, v) for r in reached.values()]
        done = [t - pub["t_start"] for t in holds if t is not None]
        versions.append({
            **cost, "published": "+".join(m["kind"] for m in pub["manifests"]),
            "published_bytes": {m["kind"]: m["payload_bytes"] for m in pub["manifests"]},
            "publish_seconds": round(pub["t_done"] - pub["t_start"], 3),
            "all_pools_seconds": round(max(done), 3) if len(done) == len(holds) else None,
            "first_pool_seconds": round(min(done), 3) if done else None,
        })
    deltas = [v["all_pools_seconds"] for v in versions[1:] if v["all_pools_seconds"] is not None]
    return {
        "name": "real_training", "model": "SmolLM2-135M (real pretrained weights)", "lr": LR,
        "step_seconds": step_seconds, "pools": pools, "full_every": FULL_EVERY, "versions": versions,
        "median_delta_seconds": round(statistics.median(deltas), 3) if deltas else None,
        "staleness": staleness(published, reached), "t0": t0,
        "methods": {"deltamesh": {
            "seconds": round(statistics.median(deltas), 3) if deltas else None, "utilization": None,
            "origin_egress_bytes": None,
            "payload_bytes": int(statistics.median(v["delta_bytes"] for v in versions[1:])) if len(versions) > 1 else None,
        }},
    }


def staleness(published: list[dict], reached: dict[str, dict[int, float]]) -> dict:
    """Versions behind the newest published one, per pool, sampled from the first delta's publish on."""
    done_at = [(p["t_done"], p["version"]) for p in published]
    start = done_at[1][0] if len(done_at) > 1 else done_at[0][0]
    end = max(max(r.values()) for r in reached.values() if r)
    samples = []
    t = start
    while t <= end:
        head = max(v for when, v in done_at if when <= t)
        for pool in reached.values():
            held = [v for v, when in pool.items() if when <= t]
            samples.append(head - max(held) if held else head + 1)
        t += STALENESS_SAMPLE_S
    samples.sort()
    return {"sample_s": STALENESS_SAMPLE_S, "mean": round(statistics.fmean(samples), 3) if samples else 0.0,
            "p95": samples[int(0.95 * (len(samples) - 1))] if samples else 0,
            "max": samples[-1] if samples else 0}
