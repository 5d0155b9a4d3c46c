"""Update time through vLLM's RL API with the deltamesh backend, against the same server reloading from disk.

One vLLM server (its CPU build, `python -m vllm.entrypoints.openai.api_server`) on SmolLM2-135M with
`--weight-transfer-config '{"backend": "deltamesh"}'`, an origin and a relay gateway, all real
processes on this machine (`deltamesh.mesh.vllm_plugin.local_mesh`). Each repeat takes one real RL
step's weights (Adam at lr 5e-6 on the previous version, alternating two versions so that every update
is a real delta) through the deltamesh trainer engine (vLLM's factory, vLLM's HTTP client):

- backend: the trainer's `send_weights()` call until it returns, which is when the server serves the
  version (`/finish_weight_update` answered): the bf16 cast, the delta's encode and signature, the upload
  to the origin, the relay's cut-through copy, the server's fetch from the relay, verification, the
  host-copy apply and vLLM's in-place reload of the layers that changed, and the read-back check;
  `publish` is the part until the origin holds the version, `server` the RL calls after it;
- reload from disk: the same server reloading the version it serves from a model directory already on
  its disk (`/collective_rpc reload_weights`, every layer read and reprocessed: what a server does when
  the new checkpoint is a directory, and the floor of that way, since writing the directory and copying
  it between regions are not counted).

vLLM's own `ipc` and `nccl` backends need CUDA (CUDA IPC handles; a NCCL process group), so neither runs
on this CPU build: the benchmark tries the `ipc` trainer engine and reports why it cannot start.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from common import bench_parser, emit, parse_bench_args


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, quick="one repeat", repeats="updates of each way")
    args = parse_bench_args(parser, argv)
    emit(run(args.repeats), args, print_table)


def run(repeats: int) -> dict[str, Any]:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from deltamesh.delta import read_weights
    from deltamesh.mesh.demo.models import smollm2_adam_versions, smollm2_model_dir, smollm2_version_dirs
    from deltamesh.mesh.vllm_plugin.local_mesh import LocalMesh, dict_source
    from deltamesh.mesh.vllm_plugin.trainer_engine import DeltameshTrainerInitInfo

    base = read_weights(smollm2_model_dir())
    step = smollm2_adam_versions([5e-6])[5e-6]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-backend-"))
    dirs = smollm2_version_dirs(work / "versions", {"base": base, "step": step})
    load_general_plugins()
    result: dict[str, Any] = {"model": "SmolLM2-135M", "repeats": repeats, "backend": [], "disk": []}
    with LocalMesh(work / "mesh", "smollm2") as mesh:
        server = mesh.start_vllm(smollm2_model_dir(), args=["--max-model-len", "512", "--no-enable-prefix-caching"])
        source = dict_source(base)
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltameshTrainerInitInfo(rank=0, publish=mesh.publish_table(full_every=0), engine_init=mesh.engine_init()),
            client=HTTPVLLMWeightSyncClient(server), source=source)
        engine.send_weights()  # v0: a full snapshot of the weights the server loaded
        served = "base"
        for _ in range(repeats):
            served = "step" if served == "base" else "base"
            source.weights = base if served == "base" else step
            started, wall = time.perf_counter(), time.time()
            published = engine.send_weights()
            result["backend"].append({"seconds": time.perf_counter() - started,
                                      "payload_bytes": published.manifests[0].payload_bytes,
                                      "uploaded_after_s": published.stages["uploaded"] - wall})
            started = time.perf_counter()
            answer = requests.post(f"{server}/collective_rpc", timeout=600, json={
                "method": "reload_weights", "kwargs": {"weights_path": str(dirs[served]), "is_checkpoint_format": True}})
            answer.raise_for_status()
            result["disk"].append({"seconds": time.perf_counter() - started})
        engine.shutdown()
    result["ipc"] = _try_ipc()
    result["backend_median_s"] = statistics.median(r["seconds"] for r in result["backend"])
    result["publish_median_s"] = statistics.median(r["uploaded_after_s"] for r in result["backend"])
    result["server_median_s"] = statistics.median(r["seconds"] - r["uploaded_after_s"] for r in result["backend"])
    result["disk_median_s"] = statistics.median(r["seconds"] for r in result["disk"])
    result["payload_bytes"] = result["backend"][0]["payload_bytes"]
    result["checkpoint_bytes"] = sum(t.numel() * t.element_size() for t in base.values())
    return result


def _try_ipc() -> str:
    """Why vLLM's `ipc` trainer engine cannot start here (its `nccl` one needs CUDA the same way)."""
    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    try:
        IPCTrainerWeightTransferEngine(client=None, source=None)
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"cannot start: {type(e).__name__}: {e} (torch.cuda.is_available() = {torch.cuda.is_available()})"
    return "started"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['model']}: trainer call -> server serving the version (median of {result['repeats']})")
    for col in ("way", "median s", "until the origin holds it", "then until serving", "bytes to the server",
                "runs (s)"):
        table.add_column(col, justify="left" if col == "way" else "right")
    table.add_row("deltamesh backend (delta, origin -> relay -> server)", f"{result['backend_median_s']:.2f}",
                  f"{result['publish_median_s']:.2f}", f"{result['server_median_s']:.2f}",
                  f"{result['payload_bytes']:,}", ", ".join(f"{r['seconds']:.2f}" for r in result["backend"]))
    table.add_row("reload from disk (directory already on the server's disk)", f"{result['disk_median_s']:.2f}",
                  "not counted", f"{result['disk_median_s']:.2f}", f"{result['checkpoint_bytes']:,}",
                  ", ".join(f"{r['seconds']:.2f}" for r in result["disk"]))
    table.add_row("vLLM ipc / nccl", "-", "-", "-", "-", result["ipc"])
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
