"""vLLM over tensor-parallel ranks: each rank taking its own share of a version, beside a reload from disk.

vLLM's CPU build runs with `--tp` tensor-parallel worker processes (`VLLMRanksEngine`) on a synthetic
model with Qwen3-0.6B's shapes and `--layers` layers (seeded random bf16 weights; each version moves ~1%
of the words by one or two ulps, alternating between two weight sets). A trainer publishes through a
real gateway (in this process, on loopback) with the cuts of the engine's layout: a full snapshot, then
`--deltas` deltas. For each delta, side by side in one run on the same engine:

- ranks: `take_step`: every rank fetches from the gateway only the pieces that reach its share, verifies
  them against the signed manifest, applies them to its host copy, and once all ranks agree loads the
  layers that changed through vLLM's in-place reload;
- disk: what a pool does for an engine without that: fetch the whole version (verified), apply it to
  the synced model directory (atomic, fsynced), then every rank reloads from it (`load_version`: each
  rank re-reads and checks its share, vLLM reads the files and reprocesses every layer).

Both move the engine to the same version; after each, the greedy logprobs of fixed prompts must be
bit-equal. Reported: vLLM's start-up, per-delta medians of each way and of its phases (fetch, apply,
inside vLLM), and the bytes each rank fetched against the whole delta. Prints a table, or with --json
one object `{"model", "tp", "startup_seconds", "ranks_seconds_median", "disk_seconds_median",
"reload_seconds_median", "fetch_fraction_per_rank", "bit_equal", "deltas": [...]}`.

    .venv/bin/python benchmarks/vllm_ranks.py [--quick] [--json] [--tp 2] [--layers 4] [--deltas 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import bench_parser, emit, parse_bench_args, stdout_to_stderr
from swap import synthetic_input

from deltamesh.delta import apply_to_dir, generate_key, save_keypair
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.plan_steps import fetch_verified
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import PlanStep
from deltamesh.gateway.server.app import create_app
from deltamesh.http import client_session, serving
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.engines.vllm_ranks import VLLMRanksConfig, VLLMRanksEngine
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.trainer.publisher import Publisher

log = logging.getLogger("benchmarks.vllm_ranks")

MODEL = "synthetic"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ("The capital of France is", "def main():")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="2 layers and 3 deltas", repeats="unused")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-0.6B-shaped model")
    p.add_argument("--deltas", type=int, default=5, help="deltas measured")
    args = parse_bench_args(p, argv)
    if args.quick:
        args.layers, args.deltas = 2, 3
    return args


async def probe(engine: VLLMRanksEngine) -> list[list[float]]:
    gens = await engine.generate([engine.encode(p) for p in PROMPTS], GREEDY)
    return [g.logprobs for g in gens]


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = synthetic_input(workdir, args.layers)
    key = generate_key()
    public = save_keypair(key, workdir / "trainer.key")
    started = time.perf_counter()
    engine = await asyncio.to_thread(VLLMRanksEngine, VLLMRanksConfig(
        model_id=MODEL, model_dir=str(model.model_dir), tensor_parallel_size=args.tp, kv_cache_bytes=64 << 20))
    startup = time.perf_counter() - started
    gateway = GatewayConfig(store=str(workdir / "store"), trusted_keys=[str(public)], anonymous=True)
    synced = workdir / "synced"
    deltas: list[dict[str, Any]] = []
    try:
        async with serving(create_app(gateway), "127.0.0.1:0") as url, \
                client_session(connections=8, timeout_s=None) as session:
            sync = WeightSyncSettings(gateways=[url], token="t", trusted_keys=[str(public)])
            pub = Publisher(url, key, MODEL, full_every=0, layouts=[engine.layout])
            fetcher = Fetcher(session, [Source(url)], "pool/bench")
            for version in range(args.deltas + 1):
                published = await pub.publish(model.new if version % 2 else model.old, version)
                manifest = published.manifests[0]
                step = PlanStep(version, manifest.kind, manifest.base_version, manifest.payload_bytes,
                                len(manifest.pieces))
                t0 = time.perf_counter()
                reports = await engine.take_step(step, sync, "pool/bench")
                t1 = time.perf_counter()
                by_ranks = await probe(engine)
                t2 = time.perf_counter()
                whole = await fetch_verified(fetcher, MODEL, step, [key.public_key()], sync.connections)
                await asyncio.to_thread(apply_to_dir, synced, [whole])
                t3 = time.perf_counter()
                await engine.load_version(synced, version)
                t4 = time.perf_counter()
                from_disk = await probe(engine)
                if version == 0:
                    continue  # the full snapshot sets the scene: deltas are measured
                deltas.append({
                    "version": version, "payload_bytes": manifest.payload_bytes,
                    "ranks_seconds": t1 - t0, "disk_seconds": t4 - t2,
                    "fetch_and_dir_seconds": t3 - t2, "reload_seconds": t4 - t3,
                    "ranks_fetch_seconds": max(r.fetch_s for r in reports),
                    "ranks_apply_seconds": max(r.apply_s for r in reports),
                    "ranks_vllm_seconds": max(r.load_s for r in reports),
                    "fetched_bytes": [r.fetched_bytes for r in reports],
                    "bit_equal": by_ranks == from_disk,
                })
                log.info("v%d: ranks %.3f s, disk %.3f s", version, t1 - t0, t4 - t2)
    finally:
        await engine.close()
    payload = statistics.median(d["payload_bytes"] for d in deltas)
    return {
        "model": model.name, "model_bytes": model.model_bytes, "tp": args.tp, "layout": engine.layout.name,
        "threads": torch.get_num_threads(), "startup_seconds": startup,
        "ranks_seconds_median": statistics.median(d["ranks_seconds"] for d in deltas),
        "disk_seconds_median": statistics.median(d["disk_seconds"] for d in deltas),
        "reload_seconds_median": statistics.median(d["reload_seconds"] for d in deltas),
        "ranks_fetch_seconds_median": statistics.median(d["ranks_fetch_seconds"] for d in deltas),
        "ranks_apply_seconds_median": statistics.median(d["ranks_apply_seconds"] for d in deltas),
        "ranks_vllm_seconds_median": statistics.median(d["ranks_vllm_seconds"] for d in deltas),
        "payload_bytes_median": payload,
        "fetch_fraction_per_rank": [statistics.median(d["fetched_bytes"][r] / d["payload_bytes"] for d in deltas)
                                    for r in range(args.tp)],
        "bit_equal": all(d["bit_equal"] for d in deltas), "deltas": deltas,
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"{result['model']} ({result['model_bytes'] / 1e6:.0f} MB bf16), vLLM {result['layout']}: "
                  f"start-up {result['startup_seconds']:.1f} s; deltas of {result['payload_bytes_median'] / 1e6:.2f} MB "
                  f"(median); bit-equal after each: {result['bit_equal']}")
    table = Table(title="per delta (s)")
    for col in ("version", "ranks", "ranks: fetch / apply / in vLLM", "disk", "disk: fetch+dir / reload",
                "fetched per rank / delta"):
        table.add_column(col, justify="right")
    for d in result["deltas"]:
        table.add_row(str(d["version"]), f"{d['ranks_seconds']:.3f}",
                      f"{d['ranks_fetch_seconds']:.3f} / {d['ranks_apply_seconds']:.3f} / {d['ranks_vllm_seconds']:.3f}",
                      f"{d['disk_seconds']:.3f}", f"{d['fetch_and_dir_seconds']:.3f} / {d['reload_seconds']:.3f}",
                      " ".join(f"{b / d['payload_bytes']:.2f}" for b in d["fetched_bytes"]))
    table.add_row("median", f"{result['ranks_seconds_median']:.3f}",
                  f"{result['ranks_fetch_seconds_median']:.3f} / {result['ranks_apply_seconds_median']:.3f} / "
                  f"{result['ranks_vllm_seconds_median']:.3f}", f"{result['disk_seconds_median']:.3f}",
                  f"- / {result['reload_seconds_median']:.3f}",
                  " ".join(f"{f:.2f}" for f in result["fetch_fraction_per_rank"]))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    with stdout_to_stderr(args.json), tempfile.TemporaryDirectory(prefix="vllm-ranks-") as tmp:
        result = asyncio.run(measure(args, Path(tmp)))
    emit(result, args, print_table)
    return 0 if result["bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
