"""The latency budget at scale: from a trainer's step end to every pool serving, stage by stage and
rank by rank, for sharded publishing beside today's path where one host builds every version.

Sharded: each trainer rank casts, scans/encodes and hashes only its dim-0 shard on its own cores and
uploads its pieces over its own connections as soon as they are encoded; rank 0 gathers the ranks'
small descriptions (one LAN round trip), signs one manifest over them and uploads it; relays pull the
version cut-through; each pool rank fetches only the pieces covering its share (simulate_layouts.py),
checks the manifest, decodes and applies its share in place, then hashes its share. Today (rank 0):
rank 0 casts and encodes the whole model, signs, uploads the manifest and then the pieces; each pool
fetches the whole version into one process, which applies and checks all of it.

A stage's speed on a rank is one core's (benchmarks/stage_speeds.py, the synthetic case with a big
model's tensor sizes) times the threads it runs on: the rank's cores for torch's cast, and for the
codec's stages min(cores per rank, delta/parallel.py's MAX_WORKERS) threads. It is capped by the
rank's share of its node's host memory bandwidth over the bytes the stage moves through memory per
model byte. The manifest's signing and checking run on one core, at the measured cost per entry.
The network is simulate_model.py's, with TCP as calibrated. Stages are what each adds to the critical
path: pieces upload while the manifest is signed, and relays and pool fetches run cut-through, so
each counts only its tail beyond the stage before; the stages sum to the total. Beside each row, the
same with every stage's threads scaling as they did on the measuring machine's few cores (Amdahl's
law fitted there), and for sharded rows the cast and scan on a GPU at a stated, unmeasured speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from simulate_layouts import DenseLayout, Layout, MoeLayout
from simulate_model import Link, Path, Tcp, connections_for, fetch, relay_path
from simulate_scenarios import GB, Codec, Mesh

from deltamesh.delta.parallel import MAX_WORKERS

PIECE = 4 * 2**20
ARRIVED = Link(1e9, 0.0)

RECORDED_PER_CORE = {"cast": 0.98, "scan": 3.34, "encode": 1.55, "hash": 26.2, "decode": 20.95, "apply": 5.66,
                     "check": 29.75}
"""One core's GB of bf16 model per second per stage (BENCHMARKS.md, "The latency budget at scale")."""
RECORDED_SCALING = {"cast": 2.81, "scan": 1.46, "encode": 1.47, "hash": 1.10, "decode": 1.53, "apply": 1.93,
                    "check": 1.04}
"""The same stages on both cores of the machine they were measured on, over one core."""


@dataclass(frozen=True)
class CoreSpeeds:
    """One core's speed per stage and the manifest's costs per entry, as stage_speeds.py measures them."""

    per_core: dict[str, float] = field(default_factory=lambda: dict(RECORDED_PER_CORE))
    scaling: dict[str, float] = field(default_factory=lambda: dict(RECORDED_SCALING))
    """All `scaled_cores` cores of the measuring machine over one, per stage."""
    scaled_cores: int = 2
    sign_s_per_entry: float = 3.0e-6
    load_s_per_entry: float = 6.9e-6
    delta_ratio: float = 0.00366
    """Delta bytes per model byte of the case measured: decoding's work is in the delta's bytes."""
    source: str = "figures recorded in BENCHMARKS.md (benchmarks/stage_speeds.py has not run here)"


def speeds_from_report(report: dict[str, Any], source: str) -> CoreSpeeds:
    """CoreSpeeds from a stage_speeds.py `--json` report; a stage it lacks keeps the recorded figure."""
    synthetic = report["cases"][0]
    return CoreSpeeds(
        per_core={**RECORDED_PER_CORE, **pick(report["per_core"])},
        scaling={**RECORDED_SCALING, **pick(synthetic["scaling"])}, scaled_cores=int(report["cores"]),
        sign_s_per_entry=float(report["sign_s_per_entry"]), load_s_per_entry=float(report["load_s_per_entry"]),
        delta_ratio=float(report["delta_ratio"]),
        source=f"benchmarks/stage_speeds.py, {source} ({report['per_core_case']}; load average "
               f"{report['machine']['load_average']})")


def pick(by_stage: dict[str, float]) -> dict[str, float]:
    return {stage: float(by_stage[stage]) for stage in RECORDED_PER_CORE if stage in by_stage}


def threads_worth(stage: str, threads: int, speeds: CoreSpeeds) -> float:
    """How many cores' worth `threads` threads run `stage` at if it scales as measured: Amdahl's law,
    its parallel share fitted to the measured scaling on `scaled_cores` cores (a stage that scaled
    fully there scales fully)."""
    n, gain = speeds.scaled_cores, speeds.scaling[stage]
    if n < 2 or gain >= n:
        return float(threads)
    parallel = max(0.0, (1 - 1 / gain) / (1 - 1 / n))
    return 1 / ((1 - parallel) + parallel / threads)


@dataclass(frozen=True)
class Node:
    """The seed's hardware: H200 nodes of 8 GPUs and ~112 host cores (2 sockets of 56)."""

    gpus: int = 8
    cores: int = 112
    memory_gbps: float = 614.4
    """2 sockets x 8 DDR5-4800 channels x 38.4 GB/s: the peak, which no real pass reaches."""

    @property
    def cores_per_rank(self) -> int:
        return self.cores // self.gpus


MEMORY_TRAFFIC = {"cast": 3.0, "encode": 2.0, "decode": 0.0, "apply": 1.5, "check": 1.0}
"""Bytes a stage moves through host memory per byte of bf16 model: the cast reads fp32 and writes bf16;
the scan reads the old and the new copy; decoding touches only the delta; an in-place apply writes
the ~27% of cache lines that hold one of the ~1% changed words (read and written back) and hashes
every result; the check reads everything once."""


@dataclass(frozen=True)
class Scenario:
    setup: str
    layout: Layout
    trainer_ranks: int
    pool_ranks: int
    mesh: Mesh


SEED_LINKS = dict(wan_mbit=4000.0, hub_rtts_ms=(300.0, 300.0, 300.0))
SCENARIOS = (
    Scenario("seed cross-region: trainer 4 ranks; 3 regions, each one 4-rank tensor-parallel pool; "
             "4 Gbit/s x 300 ms links", DenseLayout(), 4, 4, Mesh(**SEED_LINKS, leaf_rtts_ms=(), pools_per_region=1)),
    Scenario("8 regions (origin -> 3 hubs -> 4 leaves), 4 Gbit/s x 300 ms links; trainer 256 ranks; 4 "
             "expert-parallel pools of 32 ranks per region", MoeLayout(), 256, 32,
             Mesh(**SEED_LINKS, leaf_rtts_ms=((0, 300.0), (1, 300.0), (1, 300.0), (2, 300.0)), pools_per_region=4)),
)
"""The 1T model's pools have 32 ranks: the fewest (a power of two) whose share, 87 GB of bf16, leaves
room for a KV cache in an H200's 141 GB."""

NOT_MODELLED = (
    "copies between GPU and host memory (today's gather of the model to rank 0, each rank's shard to its host, "
    "a pool's result into its engine and the check's read-back: no device run measured them, so every row is a "
    "lower bound, today's path most); the engine's own reload; the seed's CPUs' own per-core speeds (these are "
    "this machine's); scaling past the 2 cores measured here; a delta whose pieces decode while they arrive (decoding "
    "is counted after the fetch); a rank 0 host holding a 2 TB model twice, which no host does")

TARGETS_S = {"Qwen3-14B": 10.0, "1T": 60.0}
"""Step end to every pool serving that sharded publishing is to reach (by the model's name)."""


def target_of(model: str) -> float | None:
    return next((t for name, t in TARGETS_S.items() if name in model), None)


def rank_speed(stage: str, threads: int, speeds: CoreSpeeds, node: Node, sharing: int,
               as_measured: bool = False) -> tuple[float, str]:
    """(GB/s one rank runs `stage` at on `threads` threads, "cores" or "memory": what bounds it), with
    `sharing` ranks of the node doing the same at once; `as_measured`: threads scale as they did on
    the measuring machine (`threads_worth`), else linearly."""
    cores = speeds.per_core[stage] * (threads_worth(stage, threads, speeds) if as_measured else threads)
    traffic = MEMORY_TRAFFIC[stage]
    memory = node.memory_gbps / sharing / traffic if traffic else math.inf
    return (cores, "cores") if cores <= memory else (memory, "memory")


def budget(sc: Scenario, sharded: bool, speeds: CoreSpeeds, node: Node, tcp: Tcp, codec: Codec,
           hop_s: float = 0.0, gpu_gbps: float | None = None, as_measured: bool = False) -> dict[str, Any]:
    """Step end to every pool serving for one scenario and path; with `gpu_gbps`, also what the cast and
    the scan would take on a GPU at that (stated, not measured) speed; `as_measured` as in `rank_speed`."""
    layout, mesh = sc.layout, sc.mesh
    model = layout.params * 2
    delta = mesh.changed_fraction * layout.params * codec.bytes_per_changed
    trainer_ranks = sc.trainer_ranks if sharded else 1
    shard = model / trainer_ranks
    codec_threads = min(node.cores_per_rank, MAX_WORKERS)
    fetched, held = layout.pool_share(sc.pool_ranks) if sharded else (1.0, 1.0)
    trainer_sharing = min(node.gpus, sc.trainer_ranks) if sharded else 1
    pool_sharing = min(node.gpus, sc.pool_ranks) if sharded else 1
    entries = layout.tensors * trainer_ranks + math.ceil(delta / PIECE)
    rates = {"cast": rank_speed("cast", node.cores_per_rank, speeds, node, trainer_sharing, as_measured),
             "encode": rank_speed("encode", codec_threads, speeds, node, trainer_sharing, as_measured)}
    rates.update({s: rank_speed(s, codec_threads, speeds, node, pool_sharing, as_measured)
                  for s in ("decode", "apply", "check")})
    egress = mesh.pools_per_region * (sc.pool_ranks if sharded else 1) * fetched * delta
    network = propagation(mesh, delta, egress, entries * speeds.sign_s_per_entry, sharded, tcp, hop_s)
    stages = {
        "cast": shard / (rates["cast"][0] * GB),
        "scan/encode": shard / (rates["encode"][0] * GB),
        **network,
        "verify + apply": entries * speeds.load_s_per_entry
                          + fetched * delta / (rates["decode"][0] * speeds.delta_ratio * GB)
                          + held * model / (rates["apply"][0] * GB),
        "check": held * model / (rates["check"][0] * GB),
    }
    total = sum(stages.values())
    path = "sharded publish, per-rank fetch and apply" if sharded else \
        "today: rank 0 builds every version, each pool applies it in one process"
    row = {
        "model": f"{layout.name} ({layout.params / 1e9:,.1f}B, {model / 1e9:,.1f} GB bf16)",
        "setup": f"{path}; {sc.setup}", "path": "sharded" if sharded else "rank 0",
        "total_s": total, "target_s": target_of(layout.name), "stages": stages,
        "dominant": max(stages, key=stages.get),
        "assumptions": {
            "node": f"{node.gpus} GPUs, {node.cores} host cores ({node.cores_per_rank} per rank), host memory "
                    f"{node.memory_gbps:g} GB/s peak",
            "trainer_ranks": trainer_ranks, "shard_bytes": shard, "model_bytes": model, "delta_bytes": delta,
            "pool": layout.describe(sc.pool_ranks) if sharded else "the whole version, one process per pool",
            "pool_ranks": sc.pool_ranks, "fetch_fraction": fetched, "held_fraction": held,
            "torch_threads_per_rank": node.cores_per_rank, "codec_threads_per_rank": codec_threads,
            "rank_gbps": {s: {"gbps": r[0], "bound": r[1]} for s, r in rates.items()},
            "manifest_entries": entries, "regions": len(mesh.paths()) + 1, "pools_per_region": mesh.pools_per_region,
            "links": f"{mesh.wan_mbit:g} Mbit/s x {mesh.hub_rtts_ms[0]:g} ms between regions; LAN "
                     f"{mesh.lan.mbit:g} Mbit/s x {mesh.lan.rtt_ms:g} ms", "gateway_egress_bytes": egress,
            "changed_fraction": mesh.changed_fraction, "bytes_per_changed": codec.bytes_per_changed,
            "hop_overhead_s": hop_s, "speeds": speeds.source,
        },
    }
    if gpu_gbps is not None and sharded:
        row["gpu_not_measured"] = on_gpu(row, speeds, codec_threads, gpu_gbps)
    return row


def propagation(mesh: Mesh, delta: float, egress: float, sign_s: float, sharded: bool, tcp: Tcp,
                hop_s: float) -> dict[str, float]:
    """The network's stages from the encodes' end, as critical-path increments: the manifest reaching
    the origin (sharded: the ranks' descriptions gathered at rank 0 first, one LAN round trip; then
    signed and uploaded), the origin holding every piece beyond that (sharded: every rank uploads at
    once from the encodes' end; today: after the manifest), every region's gateway holding them
    (relays pulling cut-through), and the pools' fetch from their region's gateway, whose LAN sends
    `egress` bytes in all."""
    lan = mesh.lan
    upload = fetch(delta, PIECE, lan, tcp, connections_for(lan, tcp), fresh=False, warm=True).seconds
    manifest_at = sign_s + (2 if sharded else 1) * lan.rtt
    ready = max(0.0, (upload if sharded else manifest_at + upload) - manifest_at)
    # The regional gateway's LAN sends `egress` bytes while its upstream brings `delta`: in the delta's
    # bytes, its link runs at delta / egress of its rate.
    pool_lan = Link(lan.mbit * delta / egress, lan.rtt_ms)
    regions = pools = 0.0
    for hops in mesh.paths():
        # Each inter-region hop ends at a relay gateway; the region's gateway holding everything is
        # the end of a last hop that costs nothing.
        links = (tuple(hops) + (ARRIVED,), tuple(hops) + (pool_lan,))
        ends = [relay_path(delta, PIECE, Path(k, tuple(connections_for(x, tcp) for x in k)), tcp,
                           origin_ready_s=ready, ahead=True) + len(hops) * hop_s for k in links]
        regions, pools = max(regions, ends[0]), max(pools, ends[1])
    return {"manifest": manifest_at, "upload": ready, "origin -> every region": regions - ready,
            "fetch": max(0.0, pools - regions)}


def on_gpu(row: dict[str, Any], speeds: CoreSpeeds, threads: int, gpu_gbps: float) -> dict[str, Any]:
    """The same row with the cast and the codec's dense scan on the trainer's GPUs at `gpu_gbps` (a
    stated speed, not measured) and the sparse changes coded on the host at the measured speed (one
    core's encode time per byte less its scan time)."""
    shard = row["assumptions"]["shard_bytes"]
    sparse_s_per_byte = max(0.0, 1 / speeds.per_core["encode"] - 1 / speeds.per_core["scan"]) / threads / GB
    stages = {**row["stages"], "cast": shard / (gpu_gbps * GB),
              "scan/encode": shard / (gpu_gbps * GB) + shard * sparse_s_per_byte}
    return {"gpu_gbps": gpu_gbps, "measured": False, "stages": stages, "total_s": sum(stages.values())}


def at_scale_rows(speeds: CoreSpeeds, tcp: Tcp, codec: Codec, changed_fraction: float, hop_s: float = 0.0,
                  node: Node = Node(), gpu_gbps: float | None = None) -> list[dict[str, Any]]:
    """Every scenario, sharded first, then today's path beside it; each also with its threads scaling
    as they did on the measuring machine's cores."""
    rows = []
    for sc in SCENARIOS:
        sc = replace(sc, mesh=replace(sc.mesh, changed_fraction=changed_fraction))
        for sharded in (True, False):
            row = budget(sc, sharded, speeds, node, tcp, codec, hop_s, gpu_gbps)
            slower = budget(sc, sharded, speeds, node, tcp, codec, hop_s, as_measured=True)
            row["scaling_as_measured"] = {"total_s": slower["total_s"], "stages": slower["stages"],
                                          "rank_gbps": slower["assumptions"]["rank_gbps"]}
            rows.append(row)
    return rows
