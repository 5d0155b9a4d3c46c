"""Device check: the codec on a GPU (its dense passes where the weights are) against the CPU path, one synthetic model.

Makes a synthetic bf16 model on --device (Qwen3-shaped, seeded random weights, a version in which ~1%
of the words move by 1-2 ulps: benchmarks/inputs.synthetic_case) of about --gb GB, copies both
versions to the host, and measures, as GB/s of bf16 model bytes (medians of --repeats):

- encode: `encode_delta` on the device's tensors (delta/device_scan.py: compare, changed positions
  and small-word counts on the device, tensor digests streamed to the host, entropy coding on the
  host) against `encode_delta` on the host copies (the numpy path); each is given the base's hash,
  as a trainer has it from the previous manifest;
- apply: `apply_version` in place into a copy of the base on the device (delta/patch.py's torch
  path) against the same into a host copy (numpy path), each from a freshly decoded version;
- scan: an unchanged version (a copy of the new one) encoded either way, so nothing is
  entropy-coded: the dense passes and the tensor digests alone.

It checks that both encoders make the same bytes (pieces and manifest) and that both applies give
the new weights bit for bit (`bit_identical`). With `--device cpu` the device side is the torch path
on CPU tensors (`device_passes=True`, `torch_ops=True`): how a test runs this script (tiny), and how
the torch path compares with numpy on a CPU. Meant to be run by hand on a GPU machine, from a
checkout installed with `pip install -e .` (which builds the codec's C extension); never in CI, and
not part of run_all.py. The default (8 GB on cuda) holds both versions and one more copy on the GPU
(~24 GB) and on the host. Exit status 0 when bit-identical, 1 when not, 2 when --device cuda
finds no CUDA.

    python benchmarks/device_check.py [--device cuda|cpu] [--gb 8] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Any

import torch
from codec import median_time, same_weights
from common import bench_parser, emit, parse_bench_args
from inputs import Weights, qwen3_shapes, synthetic_case

log = logging.getLogger("benchmarks.device_check")

GB = 1e9
# Layer dimensions by model size: (below this many GB, qwen3_shapes' keywords); layers are added to fit.
FAMILIES = (
    (0.4, {"hidden": 256, "intermediate": 768, "q_heads": 4, "kv_heads": 2, "head_dim": 64, "vocab": 8192}),
    (2.0, {}),  # Qwen3-0.6B's
    (math.inf, {"hidden": 2560, "intermediate": 9728, "q_heads": 32, "kv_heads": 8, "head_dim": 128}),  # Qwen3-4B's
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick="one repeat", repeats="timed runs of each encode and apply")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the device side runs")
    p.add_argument("--gb", type=float, default=8.0, help="bf16 size of the synthetic model in GB (1e9 bytes)")
    p.add_argument("--changed", type=float, default=0.01, help="fraction of words a version moves")
    args = parse_bench_args(p, argv)
    if args.gb <= 0 or not 0 < args.changed <= 1:
        p.error("--gb must be positive and --changed in (0, 1]")
    return args


def model_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """Qwen3-like tensor shapes of about `gb` GB of bf16, with as many layers as that takes (one at least)."""
    dims = next(d for top, d in FAMILIES if gb < top)

    def size(layers: int) -> int:
        return 2 * sum(math.prod(s) for s in qwen3_shapes(layers=layers, **dims).values())

    per_layer = size(2) - size(1)
    layers = max(1, round((gb * GB - (size(1) - per_layer)) / per_layer))
    return qwen3_shapes(layers=layers, **dims)


def gbps(model_bytes: int, seconds: float) -> float:
    return model_bytes / GB / seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    from deltamesh.delta import apply_version, decode_version, encode_delta

    device = torch.device(args.device)
    started = time.perf_counter()
    case = synthetic_case(model_shapes(args.gb), changed=args.changed, device=args.device,
                          name=f"synthetic bf16, {args.gb:g} GB")
    dev_old, dev_new = case.old, case.new
    host_old: Weights = {k: t.cpu() for k, t in dev_old.items()}
    host_new: Weights = {k: t.cpu() for k, t in dev_new.items()}
    made_s = time.perf_counter() - started
    log.info("%s: %d tensors, %.3f GB, made on %s in %.1f s", case.name, len(dev_old), case.model_bytes / GB,
             device, made_s)

    def encode(old: Weights, new: Weights, on_device: bool, base_hash: str | None):
        enc = encode_delta(old, new, model_id="device-check", version=1, base_version=0, key=None,
                           base_hash=base_hash, device_passes=on_device)
        _sync(device)
        return enc

    first = min(dev_old, key=lambda k: dev_old[k].numel())
    encode({first: dev_old[first]}, {first: dev_new[first]}, True, None)  # kernels and pinned buffers warmed up
    base_hash = encode(host_old, host_old, False, None).manifest.weights_hash
    new_hash = encode(host_new, host_new, False, None).manifest.weights_hash

    r = args.repeats
    times: dict[str, float] = {}
    times["device_encode"], dev_enc = median_time(lambda: encode(dev_old, dev_new, True, base_hash), r)
    times["cpu_encode"], cpu_enc = median_time(lambda: encode(host_old, host_new, False, base_hash), r)
    same_encoding = dev_enc.pieces == cpu_enc.pieces and _bare(dev_enc.manifest) == _bare(cpu_enc.manifest)
    del cpu_enc

    def scan_seconds(weights: Weights, on_device: bool) -> float:
        # An unchanged version as a copy of its own, so that the scan reads two arrays, as a real one does.
        twin = {k: t.clone() for k, t in weights.items()}
        return median_time(lambda: encode(weights, twin, on_device, new_hash), r)[0]

    times["device_scan"], times["cpu_scan"] = scan_seconds(dev_new, True), scan_seconds(host_new, False)
    manifest, pieces = dev_enc.manifest, dev_enc.pieces

    def apply_to(base: Weights, torch_ops: bool) -> tuple[float, bool]:
        def setup():
            return {k: t.clone() for k, t in base.items()}, decode_version(manifest, pieces)

        def fn(made):
            live, decoded = made
            out = apply_version(decoded, live, base_hash=manifest.base_hash, in_place=True, torch_ops=torch_ops)
            _sync(device)
            return out

        seconds, result = median_time(fn, r, setup=setup)
        return seconds, same_weights(result, dev_new if torch_ops else host_new)

    times["device_apply"], device_exact = apply_to(dev_old, True)
    times["cpu_apply"], cpu_exact = apply_to(host_old, False)
    out: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model_bytes": case.model_bytes,
        "tensors": len(dev_old),
        "changed_fraction": case.changed_words() / case.numel,
        "delta_bytes": sum(map(len, pieces)),
        "repeats": r,
        "torch_threads": torch.get_num_threads(),
        "host_cores": os.cpu_count(),
    }
    out.update({f"{k}_gbps": gbps(case.model_bytes, s) for k, s in times.items()})
    out.update({f"{k}_ratio": times[f"cpu_{k}"] / times[f"device_{k}"] for k in ("encode", "apply", "scan")})
    out.update(same_encoding=same_encoding, device_apply_exact=device_exact, cpu_apply_exact=cpu_exact,
               bit_identical=same_encoding and device_exact and cpu_exact,
               made_s=made_s, total_s=time.perf_counter() - started)
    return out


def _bare(manifest):
    """A manifest without its creation time, the one field two encodes of the same weights differ in."""
    return dataclasses.replace(manifest, created_ms=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['device_name']}: {result['model_bytes'] / GB:.2f} GB bf16, "
                        f"{result['changed_fraction']:.2%} of words changed, medians of {result['repeats']}")
    device_side = "torch path on cpu" if result["device"] == "cpu" else f"{result['device']} path"
    for column in ("stage", f"{device_side} GB/s", "numpy path GB/s", "ratio"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage in ("encode", "apply", "scan"):
        table.add_row(stage, f"{result[f'device_{stage}_gbps']:.2f}", f"{result[f'cpu_{stage}_gbps']:.2f}",
                      f"{result[f'{stage}_ratio']:.2f}x")
    console = Console()
    console.print(table)
    console.print(f"bit-identical: {result['bit_identical']} (encodings {result['same_encoding']}, device apply "
                  f"{result['device_apply_exact']}, cpu apply {result['cpu_apply_exact']}); delta "
                  f"{result['delta_bytes']} bytes; {result['total_s']:.0f} s in all")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda: this torch (%s) sees no CUDA device", torch.__version__)
        return 2
    result = run(args)
    emit(result, args, print_table)
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
