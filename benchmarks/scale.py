"""Scale benchmark: versions built where the weights are, against today's path, in one run.

A synthetic Qwen3-shaped model of `--gb` GB of bf16 (default 3.0) is trained by 2 ranks (processes),
each holding half the rows of every tensor as FSDP2 shards them (scale_model.py: each step moves ~1%
of the words, on the small weights, as a real first Adam step does). Three emulated regions: an
origin gateway, a relay in eu-west behind a 1 Gbit/s +20 ms link and one in ap-south behind it at
500 Mbit/s +40 ms (emulated in the gateways, as the demo's regions are), one pool per region (an
in-memory pool: fetch, verify, apply in place, every result hash checked; scale_procs.py).

Two phases on the same gateways, each a cold start (a full snapshot) and `--steps` deltas:

- sharded: every rank encodes its own rows against its own last copy, stages its pieces on the origin
  over its own connections, and rank 0 signs one manifest from the ranks' descriptions
  (`deltamesh.trainer.shard_publisher`);
- rank 0 (today's path): the ranks' rows are gathered to rank 0 over gloo, which encodes, signs and
  uploads the whole model (`deltamesh.trainer.publisher`).

Per version it reports step end -> every pool serving and the stages (encoded, uploaded, the last
pool's fetch and serving) as medians over the deltas after the first; the peak resident memory that
publishing added on each rank over its live rows (base rows, new rows, pieces); and whether every
pool holds exactly the ranks' weights (each rank's rows compared by digest). Last, the expert-parallel
fetch: a synthetic mixture of experts (8 experts per layer) encoded for pools of 2 and 4
expert-parallel ranks, and the share of a delta's bytes one rank fetches (the most over its ranks),
each rank's slices applied and checked.

`--json` prints one object: "bit_identical", "ranks", "shard_bytes", "publish_peak_rss_over_shard",
"rank0_path_publish_peak_rss_over_shard", "all_pools_seconds_median", "rank0_path_all_pools_seconds_median",
"ep_fetch_fraction" ({"2": x, "4": y}), "stages", "versions", "model_bytes", "seconds".

    .venv/bin/python benchmarks/scale.py [--gb 3.0] [--steps 4] [--json] [--quick --gb 0.02 --steps 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import scale_fetch
import scale_model
import scale_procs
from common import emit, wait_healthy

from deltamesh.delta import generate_key, save_keypair
from deltamesh.mesh.demo.processes import Service, ServiceSet, end_process, free_port

RANKS = 2
REGIONS = (("us-east", None, 0, 0), ("eu-west", "us-east", 1000, 20), ("ap-south", "eu-west", 500, 40))
"""(region, upstream region, link Mbit/s, added ms) of each gateway."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=3.0, help="bf16 size of the synthetic model")
    p.add_argument("--steps", type=int, default=4, help="deltas per phase after its full snapshot")
    p.add_argument("--phases", nargs="+", choices=("sharded", "rank0"), default=["sharded", "rank0"])
    p.add_argument("--workdir", help="for the gateways' stores and logs (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a small model (hidden 256) for a smoke run: --gb still sets its size")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def start_gateways(services: ServiceSet, root: Path, public: Path) -> dict[str, str]:
    urls: dict[str, str] = {}
    for region, upstream, mbps, ms in REGIONS:
        port = free_port()
        args = ["gateway", "--region", region, "--listen", f"127.0.0.1:{port}", "--store", str(root / region),
                "--trusted-key", str(public), "--anonymous", "--keep-deltas", "8", "--keep-fulls", "2"]
        if upstream is not None:
            args += ["--upstream", urls[upstream], "--bandwidth-cap-mbps", str(mbps), "--link-delay-ms", str(ms)]
        urls[region] = f"http://127.0.0.1:{port}"
        service = services.start(Service(region, "gateway", args, root / f"{region}.log", url=urls[region]))
        wait_healthy(urls[region], service.proc)
    return urls


def run(phases: list[str], urls: dict[str, str], cfg: dict[str, Any], steps: int, root: Path) -> dict[str, dict]:
    """Both phases with the same ranks and pools: each phase `steps` + 1 versions (the first phase's first
    a full snapshot), then every pool's and rank's digests compared; the rank-0 path takes the stream
    over in deltas where the sharded one left it."""
    ctx = mp.get_context("spawn")
    reports, stop, first_lock = ctx.Queue(), ctx.Event(), ctx.Lock()
    digest_at = ctx.Value("i", -1)
    pools = [ctx.Process(target=scale_procs.pool, args=(f"pool-{region}", urls[region], cfg["public"], str(root),
                                                        reports, stop, first_lock, digest_at))
             for region, *_ in REGIONS]
    orders = [ctx.Queue() for _ in range(RANKS)]
    cfg = {**cfg, "store_port": free_port(), "gloo_port": free_port()}
    ranks = [ctx.Process(target=scale_procs.trainer_rank, args=(r, RANKS, cfg, orders[r], reports))
             for r in range(RANKS)]
    for p in pools + ranks:
        p.start()
    out: dict[str, dict] = {}
    version, early = 0, []
    try:
        for mode in phases:
            rows = []
            for _ in range(steps + 1):
                digest_at.value = version if len(rows) == steps else -1
                for q in orders:
                    q.put((mode, version))
                rows.append(_version_row(version, _reports_of(reports, pools + ranks, version, early)))
                version += 1
            out[mode] = {"mode": mode, "versions": rows,
                         "bit_identical": _identical(reports, orders, pools + ranks, early)}
        for q in orders:
            q.put(None)
    finally:
        stop.set()
        for p in ranks + pools:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def _reports_of(reports, processes: list, version: int, early: list) -> dict[str, dict]:
    """Every rank's and pool's report of `version` (pools' digests that come meanwhile go to `early`)."""
    wanted = {f"rank{r}" for r in range(RANKS)} | {f"pool-{region}" for region, *_ in REGIONS}
    got: dict[str, dict] = {}
    while wanted - set(got):
        report = _next_report(reports, processes)
        if "digests_of" in report:
            early.append(report)
        elif report.get("version") == version:
            got[report["who"]] = report
    return got


def _identical(reports, orders, processes: list, early: list) -> bool:
    """Whether every pool holds exactly every rank's rows (digests compared rank by rank)."""
    for q in orders:
        q.put(("digests", None))
    ranks, pools = {}, {}
    while len(ranks) < RANKS or len(pools) < len(REGIONS):
        report = early.pop() if early else _next_report(reports, processes)
        if "digests" in report:
            ranks[report["who"]] = report
        elif "digests_of" in report:
            pools[report["who"]] = report["digests_of"]
    return all(pool[name][f"{a}:{b}"] == rank["digests"][name] for pool in pools.values()
               for rank in ranks.values() for name, (a, b) in rank["rows"].items() if b > a)


def _next_report(reports, processes: list, timeout_s: float = 1800.0) -> dict:
    """The next report; RuntimeError if a process died first or none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return reports.get(timeout=2.0)
        except queue.Empty:
            dead = [p.name for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead} ended with an error (its traceback is above)") from None
    raise RuntimeError(f"no report within {timeout_s:.0f} s")


def _version_row(version: int, got: dict[str, dict]) -> dict[str, Any]:
    ranks = [r for who, r in got.items() if who.startswith("rank")]
    pools = [r for who, r in got.items() if who.startswith("pool")]
    step_end = min(r["step_end"] for r in ranks)
    stages: dict[str, float] = {}
    for name in ("gathered", "encoded", "staged", "uploaded"):
        times = [r["stages"][name] for r in ranks if name in r["stages"]]
        if times:
            stages[name] = max(times) - step_end
    stages["first_pool_fetched"] = min(p["fetched"] for p in pools) - step_end
    stages["last_pool_fetched"] = max(p["fetched"] for p in pools) - step_end
    stages["all_pools_serving"] = max(p["serving"] for p in pools) - step_end
    return {"version": version, "stages": stages, "all_pools_seconds": stages["all_pools_serving"],
            "shard_bytes": max(r["shard_bytes"] for r in ranks), "added_peak": max(r["added_peak"] for r in ranks),
            "bytes": max(p["bytes"] for p in pools)}


def summary(phase: dict[str, Any]) -> dict[str, Any]:
    deltas = phase["versions"][2:] or phase["versions"][1:]
    stages = sorted({k for v in deltas for k in v["stages"]}, key=lambda k: statistics.median(
        v["stages"][k] for v in deltas if k in v["stages"]))
    return {"all_pools_seconds_median": statistics.median(v["all_pools_seconds"] for v in deltas),
            "stages": {k: statistics.median(v["stages"][k] for v in deltas if k in v["stages"]) for k in stages},
            "added_peak": max(v["added_peak"] for v in phase["versions"]),
            "shard_bytes": max(v["shard_bytes"] for v in phase["versions"])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    shapes = scale_model.dense_shapes(args.gb, quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.workdir) as tmp:
        root = Path(tmp)
        key = generate_key()
        public = save_keypair(key, root / "trainer.key")
        cfg = {"shapes": shapes, "key": str(root / "trainer.key"), "public": str(public)}
        services = ServiceSet()
        try:
            urls = start_gateways(services, root, public)
            cfg["gateway"] = urls["us-east"]
            phases = run(args.phases, urls, cfg, args.steps, root)
        finally:
            for s in services.services:
                if s.proc is not None:
                    end_process(s.proc)
    ep = scale_fetch.ep_fetch_fractions(quick=args.quick)
    result = report(phases, ep, scale_model.numel(shapes) * 2, time.monotonic() - started)
    emit(result, args, print_table)
    return 0 if result["bit_identical"] else 1


def report(phases: dict[str, dict], ep: dict[str, float], model_bytes: int, seconds: float) -> dict[str, Any]:
    sums = {mode: summary(p) for mode, p in phases.items()}
    sharded, rank0 = sums.get("sharded"), sums.get("rank0")
    out: dict[str, Any] = {
        "bit_identical": all(p["bit_identical"] for p in phases.values()),
        "ranks": RANKS, "model_bytes": model_bytes, "ep_fetch_fraction": ep, "seconds": seconds,
        "versions": {mode: p["versions"] for mode, p in phases.items()},
        "stages": {mode: s["stages"] for mode, s in sums.items()},
    }
    if sharded is not None:
        out.update(shard_bytes=sharded["shard_bytes"], all_pools_seconds_median=sharded["all_pools_seconds_median"],
                   publish_peak_rss_over_shard=sharded["added_peak"] / sharded["shard_bytes"])
    if rank0 is not None:
        out.update(rank0_path_all_pools_seconds_median=rank0["all_pools_seconds_median"],
                   rank0_path_publish_peak_rss_over_shard=rank0["added_peak"] / rank0["shard_bytes"])
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    modes = list(result["stages"])
    table = Table(title=f"step end -> stage (median s over the deltas), {result['model_bytes'] / 1e9:.2f} GB, "
                        f"{result['ranks']} trainer ranks, 3 regions")
    table.add_column("stage")
    for mode in modes:
        table.add_column(mode, justify="right")
    names = list(dict.fromkeys(k for m in modes for k in result["stages"][m]))
    for name in names:
        table.add_row(name, *(f"{result['stages'][m][name]:.2f}" if name in result["stages"][m] else "-" for m in modes))
    console.print(table)
    if "publish_peak_rss_over_shard" in result and "rank0_path_publish_peak_rss_over_shard" in result:
        console.print(f"peak RSS publishing added, over a rank's {result['shard_bytes'] / 1e9:.2f} GB of rows: "
                      f"sharded {result['publish_peak_rss_over_shard']:.2f}x, rank 0 path "
                      f"{result['rank0_path_publish_peak_rss_over_shard']:.2f}x")
    console.print(f"every pool bit-identical to the ranks: {result['bit_identical']}; expert-parallel fetch per "
                  f"rank: {result['ep_fetch_fraction']}; {result['seconds']:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
