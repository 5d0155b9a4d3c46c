"""Codec benchmark: deltamesh's bf16 delta codec side by side with four baselines, in one run.

Every method encodes the same (old, new) bf16 versions and applies its own output to the old weights;
each result is checked bit for bit against the new weights. Inputs: real one-step Adam deltas of
SmolLM2-135M at three learning rates and a synthetic model with Qwen3-0.6B's shapes (1.19 GB). Sizes
count every byte a method sends (for deltamesh: the signed manifest and all pieces); speeds are GB/s
of model bytes (bf16 size of the weights), medians of `--repeats` runs. deltamesh's apply includes
all of its checks: the manifest signature, every piece hash and every result tensor hash. Its
encoder is given the base's weights hash, as a trainer knows it from the previous version, and so is
its headline apply, which writes in place into the receiver's weights (with rollback), as a rollout
pool applies each version onto the one it verified before; `apply_next_gbps` is that apply by a
receiver that applied the version before in place too, as a pool in its steady state does (its
small-word index, moved along with that version, spares a pass over the touched tensors' words;
`deltamesh.delta.small_index`); `apply_copy_gbps` is the apply into a
fresh copy that leaves the old weights untouched and re-hashes them to check the base. Also
measured: deltamesh's full snapshot against raw bf16 on SmolLM2, and the XOR of two large arrays
(GB/s of one array) as the memory-bandwidth reference. Prints a table, or with --json one object.

    .venv/bin/python benchmarks/codec.py [--quick] [--json] [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable

import torch
from baselines import BASELINES, Codec, encoded_size
from common import bench_parser, emit, parse_bench_args
from inputs import Case, adam_run_case, qwen3_shapes, real_cases, synthetic_case

log = logging.getLogger("benchmarks.codec")

GB = 1e9
GIB = 2**30
METHODS = ("deltamesh", "astraflow", "slime", "pulse", "full")
LRS = (1e-6, 5e-6, 1e-5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="one repeat, a 4-layer synthetic model, 256 MiB XOR",
                     repeats="timed runs per measurement")
    p.add_argument("--lrs", type=float, nargs="*", default=list(LRS), help="learning rates of the real deltas")
    p.add_argument("--run-steps", type=int, default=4,
                   help="also the delta of this step of one Adam run at lr 5e-6 (0: skip)")
    p.add_argument("--no-synthetic", action="store_true", help="skip the Qwen3-0.6B-shaped synthetic model")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    return parse_bench_args(p, argv)


def median_time(fn: Callable[..., Any], repeats: int, setup: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """Median wall time of `fn` over `repeats` calls, and the last call's result. With `setup`, each
    call is `fn(setup())` and only `fn` is timed."""
    wall, _, result = median_times(fn, repeats, setup)
    return wall, result


def median_times(fn: Callable[..., Any], repeats: int,
                 setup: Callable[[], Any] | None = None) -> tuple[float, float, Any]:
    """`median_time`, with the median CPU seconds of this process (all its threads) as well."""
    times, cpu, result = [], [], None
    for _ in range(repeats):
        result = None  # drop the previous result first, so two never coexist in memory
        gc.collect()
        args = () if setup is None else (setup(),)
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn(*args)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu), result


def deltamesh_codecs() -> tuple[Codec, Codec]:
    """deltamesh as a `Codec` (blobs = signed manifest + pieces), for deltas and for full snapshots.

    The delta encoder is given the base's `weights_hash`, as a trainer has it from the previous
    version's manifest; `prepare` computes it before the timed runs.
    """
    from deltamesh.delta import (
        SmallWordIndex,
        apply,
        encode_delta,
        encode_full,
        generate_key,
        load_manifest,
        weights_hash,
    )

    key = generate_key()
    trusted = [key.public_key()]
    known = {"base": None, "hash": None}

    def prepare(old):
        known.update(base=old, hash=weights_hash(old))

    def encode(old, new):
        base_hash = known["hash"] if known["base"] is old else None
        enc = encode_delta(old, new, model_id="bench", version=1, base_version=0, key=key, base_hash=base_hash)
        return [enc.manifest_bytes, *enc.pieces]

    def apply_delta(old, blobs):
        manifest = load_manifest(blobs[0], trusted)
        return apply(dict(old), manifest, blobs[1:])

    def apply_delta_in_place(live, blobs):
        manifest = load_manifest(blobs[0], trusted)
        return apply(live, manifest, blobs[1:], base_hash=known["hash"], in_place=True)

    def apply_next(old, new, blobs, repeats):
        # The version before is `new` -> `old` (untimed), so the timed one always lands on the same
        # weights; the index it moved is the receiver's state between versions.
        new_hash = weights_hash(new)
        back = encode_delta(new, old, model_id="bench", version=2, base_version=1, key=key, base_hash=new_hash)
        live, index, times, cpu = {k: v.clone() for k, v in new.items()}, SmallWordIndex(), [], []
        exact = True
        for _ in range(repeats):
            apply(live, back.manifest, back.pieces, base_hash=new_hash, in_place=True, small_index=index)
            start, start_cpu = time.perf_counter(), time.process_time()
            manifest = load_manifest(blobs[0], trusted)
            apply(live, manifest, blobs[1:], base_hash=known["hash"], in_place=True, small_index=index)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            exact = exact and same_weights(live, new)
        return statistics.median(times), statistics.median(cpu), exact

    def encode_snapshot(old, new):
        enc = encode_full(new, model_id="bench", version=1, key=key)
        return [enc.manifest_bytes, *enc.pieces]

    def apply_snapshot(old, blobs):
        return apply(None, load_manifest(blobs[0], trusted), blobs[1:])

    delta = Codec("deltamesh", "signed manifest + bit-diff pieces", encode, apply_delta, prepare,
                  apply_in_place=apply_delta_in_place, apply_next=apply_next)
    full = Codec("deltamesh-full", "signed full snapshot", encode_snapshot, apply_snapshot)
    return delta, full


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(x.dtype == b[k].dtype and x.shape == b[k].shape
               and torch.equal(x.contiguous().view(torch.int16), b[k].contiguous().view(torch.int16))
               for k, x in a.items())


def measure(codec: Codec, case: Case, repeats: int, changed: int, full_bytes: int | None) -> dict[str, Any]:
    if codec.prepare is not None:
        codec.prepare(case.old)
    encode_s, blobs = median_time(lambda: codec.encode(case.old, case.new), repeats)
    size = encoded_size(blobs)
    apply_s, result = median_time(lambda: codec.apply(case.old, blobs), repeats)
    exact = same_weights(result, case.new)
    del result
    copy_s = cpu_s = None
    if codec.apply_in_place is not None:
        copy_s = apply_s
        apply_s, cpu_s, result = median_times(lambda live: codec.apply_in_place(live, blobs), repeats,
                                              setup=lambda: {k: v.clone() for k, v in case.old.items()})
        exact = exact and same_weights(result, case.new)
        del result
    next_s = next_cpu_s = None
    if codec.apply_next is not None:
        next_s, next_cpu_s, next_exact = codec.apply_next(case.old, case.new, blobs, repeats)
        exact = exact and next_exact
    if not exact:
        log.error("%s on %s: applied weights differ from the new version", codec.name, case.name)
    full_bytes = full_bytes or size
    out = {
        "bytes": size,
        "bytes_per_changed": size / changed if changed else None,
        "ratio_vs_full": full_bytes / size,
        "encode_gbps": case.model_bytes / GB / encode_s,
        "apply_gbps": case.model_bytes / GB / apply_s,
        "exact": exact,
    }
    if copy_s is not None:
        out["apply_copy_gbps"] = case.model_bytes / GB / copy_s
    if next_s is not None:
        out["apply_next_gbps"] = case.model_bytes / GB / next_s
        out["apply_next_cpu_s"] = next_cpu_s
    if cpu_s is not None:
        out["apply_cpu_s"] = cpu_s
    return out


def measure_case(case: Case, codecs: dict[str, Codec], repeats: int) -> dict[str, Any]:
    changed = case.changed_words()
    log.info("%s: %.3f GB, %.4f%% of words changed", case.name, case.model_bytes / GB, 100 * changed / case.numel)
    results: dict[str, Any] = {}
    full_bytes = case.model_bytes
    # `full` first: the others' ratios are against its size (raw bf16 bytes without it).
    for name in sorted(codecs, key=lambda n: n != "full"):
        results[name] = measure(codecs[name], case, repeats, changed, full_bytes if name != "full" else None)
        if name == "full":
            full_bytes = results[name]["bytes"]
        log.info("  %-10s %12d bytes", name, results[name]["bytes"])
    return {
        "name": case.name,
        "note": case.note,
        "model_bytes": case.model_bytes,
        "changed_words": changed,
        "changed_fraction": changed / case.numel,
        "full_bytes": full_bytes,
        "order0_entropy_bytes": order0_entropy_bytes(case),
        "results": {name: results[name] for name in METHODS if name in results},
    }


def order0_entropy_bytes(case: Case) -> float:
    """Bytes needed if every word's changed-or-not and every change's move (new - old word) were
    independent draws: the floor for a coder that uses no context. Below it takes context."""
    moves: Counter[int] = Counter()
    for name, old in case.old.items():
        a, b = old.view(torch.int16).reshape(-1), case.new[name].view(torch.int16).reshape(-1)
        pos = torch.nonzero(a != b).reshape(-1)
        values, counts = torch.unique(b[pos].int() - a[pos].int(), return_counts=True)
        moves.update(dict(zip(values.tolist(), counts.tolist())))
    changed, total = sum(moves.values()), case.numel
    if changed == 0:
        return 0.0
    p = changed / total
    position_bits = total * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) if p < 1 else 0.0
    move_bits = -sum(c * math.log2(c / changed) for c in moves.values())
    return (position_bits + move_bits) / 8


def xor_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s (of one input) of `c = a ^ b` over two `nbytes` arrays: the memory-bandwidth reference."""
    a = torch.randint(-2**62, 2**62, (nbytes // 8,), dtype=torch.int64)
    b = torch.randint(-2**62, 2**62, (nbytes // 8,), dtype=torch.int64)
    out = torch.empty_like(a)
    seconds, _ = median_time(lambda: torch.bitwise_xor(a, b, out=out), max(repeats, 3))
    return nbytes / GB / seconds


def check(name: str, value: float | None, target: float, unit: str, measured: bool = True) -> dict[str, Any]:
    passed = None if value is None or not measured else value >= target
    return {"name": name, "value": value, "target": target, "unit": unit, "pass": passed}


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The codec's targets, each with its measured value and pass/fail (None when not measured)."""
    targets = []
    by_name = {c["name"]: c for c in report["cases"]}

    def dm(case_name: str) -> dict[str, Any] | None:
        case = by_name.get(case_name)
        return case["results"].get("deltamesh") if case else None

    for lr, ratio in ((5e-6, 150.0), (1e-6, 350.0)):
        r = dm(f"smollm2-135m adam lr={lr:g}")
        targets.append(check(f"lr {lr:g}: deltamesh smaller than full bf16", r and r["ratio_vs_full"], ratio, "x"))
    case = by_name.get("smollm2-135m adam lr=5e-06")
    if case and "deltamesh" in case["results"]:
        baselines = [v["bytes"] for k, v in case["results"].items() if k not in ("deltamesh", "full")]
        value = min(baselines) / case["results"]["deltamesh"]["bytes"] if baselines else None
        targets.append(check("lr 5e-06: deltamesh smaller than best baseline", value, 1.5, "x"))
    synth = next((c for c in report["cases"] if c["name"].startswith("qwen3")), None)
    big = bool(synth and synth["model_bytes"] >= GIB)
    r = synth["results"].get("deltamesh") if synth else None
    targets.append(check("encode speed, >= 1 GiB model", r and r["encode_gbps"], 1.5, "GB/s", big))
    targets.append(check("apply speed (in place, as a pool), >= 1 GiB model", r and r["apply_gbps"], 3.0, "GB/s", big))
    snap = report.get("full_snapshot")
    targets.append(check("full snapshot smaller than raw bf16", snap and snap["ratio_vs_raw"], 1.3, "x"))
    return targets


def full_snapshot(case: Case, codec: Codec, repeats: int) -> dict[str, Any]:
    raw = encoded_size(BASELINES["full"].encode(case.old, case.new))
    r = measure(codec, case, repeats, changed=0, full_bytes=raw)
    return {"case": case.name, "raw_bf16_bytes": raw, "bytes": r["bytes"], "ratio_vs_raw": raw / r["bytes"],
            "encode_gbps": r["encode_gbps"], "apply_gbps": r["apply_gbps"], "exact": r["exact"]}


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    for case in report["cases"]:
        table = Table(title=f"{case['name']}: {case['model_bytes'] / GB:.3f} GB, "
                            f"{100 * case['changed_fraction']:.2f}% of words changed")
        for col in ("method", "bytes", "bytes/changed", "x smaller than full", "encode GB/s", "apply GB/s",
                    "apply GB/s (next version)", "apply GB/s (copy)", "exact"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for name, r in case["results"].items():
            per = f"{r['bytes_per_changed']:.2f}" if r["bytes_per_changed"] is not None else "-"
            copy = r.get("apply_copy_gbps")
            table.add_row(name, f"{r['bytes']:,}", per, f"{r['ratio_vs_full']:.1f}", f"{r['encode_gbps']:.2f}",
                          f"{r['apply_gbps']:.2f}" + (" (in place)" if copy is not None else ""),
                          (f"{r['apply_next_gbps']:.2f} (CPU {r['apply_next_cpu_s']:.2f} s vs "
                           f"{r['apply_cpu_s']:.2f} s)") if "apply_next_gbps" in r else "-",
                          f"{(copy if copy is not None else r['apply_gbps']):.2f}", "yes" if r["exact"] else "NO")
        floor = case["order0_entropy_bytes"]
        if floor:
            table.add_row("(order-0 entropy)", f"{round(floor):,}", f"{floor / case['changed_words']:.2f}",
                          f"{case['full_bytes'] / floor:.1f}", "", "", "", "", "", style="dim")
        console.print(table)
    snap = report.get("full_snapshot")
    if snap:
        console.print(f"deltamesh full snapshot of {snap['case']}: {snap['bytes']:,} bytes vs raw bf16 "
                      f"{snap['raw_bf16_bytes']:,} ({snap['ratio_vs_raw']:.3f}x smaller), encode "
                      f"{snap['encode_gbps']:.2f} GB/s, apply {snap['apply_gbps']:.2f} GB/s, exact: {snap['exact']}")
    console.print(f"memory-bandwidth reference: XOR of two {report['xor_bytes'] / GIB:.2f} GiB arrays, "
                  f"{report['xor_gbps']:.2f} GB/s")
    rel = report.get("deltamesh_vs_xor")
    if rel:
        console.print(f"deltamesh on the synthetic model, as a fraction of that XOR speed: encode {rel['encode']:.2f}, "
                      f"apply {rel['apply']:.2f}; measured minutes apart, so only indicative")
    table = Table(title="targets (deltamesh)")
    for col in ("target", "measured", "needed", "result"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "not measured"}[t["pass"]]
        table.add_row(t["name"], value, f">= {t['target']:g} {t['unit']}", verdict)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    codecs = {name: BASELINES[name] for name in args.methods if name in BASELINES}
    snapshot_codec = None
    if "deltamesh" in args.methods:
        codecs["deltamesh"], snapshot_codec = deltamesh_codecs()

    report: dict[str, Any] = {"repeats": args.repeats, "quick": args.quick, "cases": []}
    cases = real_cases(args.lrs)
    for case in cases:
        report["cases"].append(measure_case(case, codecs, args.repeats))
    if snapshot_codec is not None and cases:
        report["full_snapshot"] = full_snapshot(cases[0], snapshot_codec, args.repeats)
    del cases
    if args.run_steps > 0:
        report["cases"].append(measure_case(adam_run_case(5e-6, args.run_steps), codecs, args.repeats))
    gc.collect()
    if not args.no_synthetic:
        case = synthetic_case(qwen3_shapes(layers=4 if args.quick else 28))
        report["cases"].append(measure_case(case, codecs, args.repeats))
        del case
        gc.collect()
    report["xor_bytes"] = (256 * 2**20) if args.quick else GIB
    report["xor_gbps"] = xor_bandwidth(report["xor_bytes"], args.repeats)
    synth = [c["results"]["deltamesh"] for c in report["cases"]
             if c["name"].startswith("qwen3") and "deltamesh" in c["results"]]
    if synth:
        report["deltamesh_vs_xor"] = {"encode": synth[0]["encode_gbps"] / report["xor_gbps"],
                                      "apply": synth[0]["apply_gbps"] / report["xor_gbps"]}
    report["targets"] = evaluate_targets(report)
    exact = all(r["exact"] for c in report["cases"] for r in c["results"].values())
    emit(report, args, print_report)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
