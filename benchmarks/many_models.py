"""How long a new delta takes to reach a relay when the relay follows 1 model and when it follows many.

Runs real `deltamesh gateway` processes on loopback: an origin, and a relay following it. For each
model count N (a fresh origin and relay each time), N models are published (a full, then a delta
each) and mirrored; then, --repeats times, one model (in turn) gets a new delta, and the time from
the start of its publish until the relay holds it complete is measured (`reach_seconds`). A relay
whose cost grows with the number of models it follows (models listed one by one, long polls holding
the connections transfers need) shows here as a ratio above 1. Versions are random bytes, 4 pieces
of 256 KiB (gateways never decode pieces, so the codec does not matter).

`--json` prints {"models": {"<N>": {"reach_seconds_median": x, "reach_seconds_p90": x, "runs": n}},
"ratio": median(N max) / median(N=1)}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import piece_digest, stop_processes, wait_healthy

from deltamesh.delta.hashing import digest
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.delta.manifest import Manifest, PieceEntry, TensorEntry
from deltamesh.http import client_session, request_json
from deltamesh.mesh.demo.processes import free_port
from deltamesh.trainer.upload import upload_version

PIECE = 256 * 1024
PIECES = 4


def make_version(key, model: str, version: int) -> tuple[Manifest, bytes, list[bytes]]:
    pieces = [os.urandom(PIECE) for _ in range(PIECES)]
    kind = "full" if version == 0 else "delta"
    m = Manifest(model_id=model, version=version, base_version=None if version == 0 else version - 1, kind=kind,
                 codec="bench", base_hash=None if version == 0 else "1" * 32,
                 tensors=(TensorEntry("w", "U8", (PIECE * PIECES,), digest(f"{model} v{version}".encode())),),
                 pieces=tuple(PieceEntry(len(p), piece_digest(p), (0,)) for p in pieces))
    return m, m.signed(key), pieces


async def complete_at(s, relay: str, model: str, version: int) -> float:
    """When (perf_counter) the relay lists `version` of `model` complete; polled every 5 ms."""
    while True:
        try:
            listing = await request_json(s, "GET", f"{relay}/v1/models/{model}/versions")
            if any(v["version"] == version and v["complete"] for v in listing["versions"]):
                return time.perf_counter()
        except Exception:  # not listed there yet (404)
            pass
        await asyncio.sleep(0.005)


async def measure(origin: str, relay: str, key, n_models: int, repeats: int) -> list[float]:
    models = [f"model-{i:02d}" for i in range(n_models)]
    async with client_session(connections=64, timeout_s=None) as s:
        for version in (0, 1):  # a full and a first delta of every model, all mirrored before timing
            await asyncio.gather(*(upload_version(s, origin, *make_version(key, m, version)) for m in models))
            await asyncio.gather(*(asyncio.wait_for(complete_at(s, relay, m, version), 120) for m in models))
        await asyncio.sleep(1.0)  # the relay is now waiting upstream for every model's next version
        reach = []
        for r in range(repeats):
            model, version = models[r % n_models], 2 + r // n_models
            manifest, raw, pieces = make_version(key, model, version)
            t0 = time.perf_counter()
            arrived = asyncio.create_task(complete_at(s, relay, model, version))
            await upload_version(s, origin, manifest, raw, pieces)
            reach.append(await asyncio.wait_for(arrived, 120) - t0)
            await asyncio.sleep(0.2)
    return reach


def run_pair(n_models: int, repeats: int) -> list[float]:
    deltamesh = str(Path(sys.executable).with_name("deltamesh"))
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        key = generate_key()
        pub = save_keypair(key, Path(tmp) / "trainer.key")
        try:
            urls = {}
            for region, ups in (("origin", []), ("relay", ["origin"])):
                port = free_port()
                urls[region] = f"http://127.0.0.1:{port}"
                cmd = [deltamesh, "--log-level", "WARNING", "gateway", "--region", region, "--anonymous",
                       "--listen", f"127.0.0.1:{port}", "--store", f"{tmp}/{region}", "--trusted-key", str(pub)]
                for u in ups:
                    cmd += ["--upstream", urls[u]]
                procs.append(subprocess.Popen(cmd, start_new_session=True))
            for proc, name in zip(procs, ("origin", "relay")):
                wait_healthy(urls[name], proc)
            return asyncio.run(measure(urls["origin"], urls["relay"], key, n_models, repeats))
        finally:
            stop_processes(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--models", default="1,10", help="comma-separated model counts (the first is the reference)")
    ap.add_argument("--repeats", type=int, default=10, help="new deltas timed per model count")
    args = ap.parse_args()
    counts = [int(x) for x in args.models.split(",")]
    results = {}
    for n in counts:
        reach = sorted(run_pair(n, args.repeats))
        results[str(n)] = {"reach_seconds_median": round(statistics.median(reach), 3),
                           "reach_seconds_p90": round(reach[int(0.9 * (len(reach) - 1))], 3), "runs": len(reach)}
    first, last = results[str(counts[0])], results[str(counts[-1])]
    out = {"models": results, "ratio": round(last["reach_seconds_median"] / first["reach_seconds_median"], 2)}
    if args.json:
        print(json.dumps(out))
    else:
        print("Publish-to-relayed seconds of a new delta (4 x 256 KiB) by models the relay follows")
        print(f"{'models':>7} {'median s':>9} {'p90 s':>7} {'runs':>5}")
        for n, r in results.items():
            print(f"{n:>7} {r['reach_seconds_median']:>9.3f} {r['reach_seconds_p90']:>7.3f} {r['runs']:>5}")
        print(f"ratio {counts[-1]} : {counts[0]} models = {out['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
