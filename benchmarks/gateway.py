"""Gateway benchmark on loopback: serving throughput to N concurrent pullers, and the cost of a relay hop.

Runs real `deltamesh gateway` processes (an origin, and a relay following it) and, side by side in
the same run, the baselines:

* serving: N pullers each fetch a whole version (every piece verified by the puller, 2 connections
  each) from the origin gateway; the baseline is a plain aiohttp static file server (sendfile, no
  hashing) serving the same piece files.
* serving over TLS: the same pullers against a second origin gateway serving the same version over
  mTLS (certificates from `deltamesh.certs`, ECDSA P-256; each puller presents a `pool/` client
  certificate, which is also its credential), measured in the same repeats, interleaved with the
  plain runs; `tls_ratio` is TLS over plain throughput.
* relay hop: seconds from the start of a publish until a puller has the whole version bit-exact,
  pulling directly from the origin (`direct`), through the relay as soon as the relay announces the
  version (`cut_through`), or through the relay only once the relay holds the whole version, as a
  store-and-forward relay would serve it (`store_and_forward`). The added latency of the hop is the
  difference to `direct`.

Versions are random bytes in pieces of 4 MiB (gateways never decode pieces, so the codec does not
matter here). Each figure is the median of --repeats runs. The plain gateways run `--anonymous`.
`--json` prints {"serve_gbps": {"<N>": x}, "serve_tls_gbps": {"<N>": x}, "tls_ratio": {"<N>": x},
"baseline_static_gbps": {"<N>": x}, "relay_hop_seconds": {"cut_through": x, "store_and_forward": x,
"direct": x}}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, piece_digest, stop_processes, wait_healthy

from deltamesh.certs import issue, make_ca
from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.delta.manifest import Manifest, PieceEntry, TensorEntry
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.sources import Source
from deltamesh.http import client_session, request_json
from deltamesh.mesh.demo.processes import free_port
from deltamesh.tls import TlsSettings
from deltamesh.trainer.upload import upload_version

MODEL = "bench"
PIECE = 4 * 1024 * 1024
STATIC_SERVER = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_static("/", sys.argv[1])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


def make_version(key, version: int, pieces: list[bytes]) -> tuple[Manifest, bytes]:
    m = Manifest(model_id=MODEL, version=version, base_version=None, kind="full", codec="bench",
                 tensors=(TensorEntry("w", "U8", (sum(len(p) for p in pieces),), "0" * 32),),
                 pieces=tuple(PieceEntry(len(p), piece_digest(p), (0,)) for p in pieces))
    return m, m.signed(key)


async def pull(url: str, manifest: Manifest, connections: int, session) -> float:
    """Fetch every piece of `manifest` from `url` (verified); returns seconds."""
    t0 = time.perf_counter()
    fetcher = Fetcher(session, [Source(url)], "pool/bench", stall_timeout_s=30, give_up_s=120)

    async def drop(index: int, data: bytes) -> None:
        return None

    await fetcher.pieces(manifest, range(len(manifest.pieces)), connections, drop)
    return time.perf_counter() - t0


async def pull_static(url: str, files: list[str], connections: int, session) -> float:
    t0 = time.perf_counter()
    queue = list(files)

    async def worker() -> None:
        while queue:
            name = queue.pop()
            async with session.get(f"{url}/{name}") as r:
                async for _ in r.content.iter_chunked(256 * 1024):
                    pass

    await asyncio.gather(*(worker() for _ in range(connections)))
    return time.perf_counter() - t0


async def serve_throughput(urls: dict[str, str], tls: TlsSettings, manifest: Manifest, files: list[str],
                           n: int) -> tuple[float, float, float]:
    """GB/s of N pullers from the plain gateway, the static server and the TLS gateway, one after the other."""
    total = manifest.payload_bytes * n
    async with client_session(connections=4 * n, timeout_s=None) as s, \
            client_session(connections=4 * n, timeout_s=None, tls=tls) as secure:
        t0 = time.perf_counter()
        await asyncio.gather(*(pull(urls["origin"], manifest, 2, s) for _ in range(n)))
        gw = total / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        await asyncio.gather(*(pull_static(urls["static"], files, 2, s) for _ in range(n)))
        st = total / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        await asyncio.gather(*(pull(urls["origin_tls"], manifest, 2, secure) for _ in range(n)))
        secured = total / (time.perf_counter() - t0) / 1e9
    return gw, st, secured


async def relay_hop(origin: str, relay: str, key, version: int, pieces: list[bytes], mode: str) -> float:
    """Seconds from the start of publishing `version` until a puller holds all of it."""
    manifest, raw = make_version(key, version, pieces)
    async with client_session(connections=32, timeout_s=None) as s:
        source = origin if mode == "direct" else relay
        t0 = time.perf_counter()
        publish = asyncio.create_task(upload_version(s, origin, manifest, raw, pieces, connections=4))
        head = await request_json(s, "GET", f"{source}/v1/models/{MODEL}/head", params={"after": version - 1, "wait": 60})
        assert head["head"] == version, head
        if mode == "store_and_forward":
            while True:
                listing = await request_json(s, "GET", f"{relay}/v1/models/{MODEL}/versions")
                if any(v["version"] == version and v["complete"] for v in listing["versions"]):
                    break
                await asyncio.sleep(0.005)
        await pull(source, manifest, 4, s)
        elapsed = time.perf_counter() - t0
        await publish
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--size-mb", type=float, default=200.0, help="version size in MB")
    ap.add_argument("--pullers", default="1,4,16", help="comma-separated numbers of concurrent pullers")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    counts = [int(x) for x in args.pullers.split(",")]
    n_pieces = max(1, round(args.size_mb * 1e6 / PIECE))
    base = os.urandom(PIECE)
    # Distinct pieces (so nothing can be deduplicated), made cheaply from one random block.
    pieces = [i.to_bytes(8, "little") + base[8:] for i in range(n_pieces)]
    procs: list[subprocess.Popen] = []
    deltamesh = str(Path(sys.executable).with_name("deltamesh"))
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        key = generate_key()
        pub = save_keypair(key, Path(tmp) / "trainer.key")
        ca = make_ca(Path(tmp) / "pki")
        server = issue(ca, Path(tmp) / "pki", "gateway/origin-tls", hosts=["127.0.0.1"])
        puller = issue(ca, Path(tmp) / "pki", "pool/bench")
        trainer = issue(ca, Path(tmp) / "pki", "trainer/bench")
        tls = {"pool": TlsSettings(cert=str(puller.cert), key=str(puller.key), ca=str(ca.cert)),
               "trainer": TlsSettings(cert=str(trainer.cert), key=str(trainer.key), ca=str(ca.cert))}
        try:
            urls = {}
            for region, ups in (("origin", []), ("relay", ["origin"]), ("origin_tls", [])):
                port = free_port()
                secure = region == "origin_tls"
                urls[region] = f"{'https' if secure else 'http'}://127.0.0.1:{port}"
                cmd = [deltamesh, "--log-level", "WARNING", "gateway", "--region", region.replace("_", "-"),
                       "--listen", f"127.0.0.1:{port}", "--store", f"{tmp}/{region}", "--trusted-key", str(pub),
                       "--keep-fulls", "2", "--relay-connections", "4"]
                # mTLS identifies every caller by its certificate; the plain gateways take anyone.
                cmd += (["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--client-ca", str(ca.cert)]
                        if secure else ["--anonymous"])
                for u in ups:
                    cmd += ["--upstream", urls[u]]
                procs.append(subprocess.Popen(cmd, start_new_session=True))
            static_port = free_port()
            urls["static"] = f"http://127.0.0.1:{static_port}"
            static_dir = f"{tmp}/origin/models/{MODEL}/1/full/pieces"
            Path(static_dir).mkdir(parents=True, exist_ok=True)
            procs.append(subprocess.Popen([sys.executable, "-c", STATIC_SERVER, static_dir, str(static_port)],
                                          start_new_session=True))
            for proc, name in zip(procs, ("origin", "relay", "origin_tls", "static")):
                wait_healthy(urls[name], proc, "/healthz" if name != "static" else "/", tls["pool"])
            results = asyncio.run(run_all(urls, tls, key, pieces, counts, args.repeats))
        finally:
            stop_processes(procs)
    results["version_mb"] = round(n_pieces * PIECE / 1e6, 1)
    emit(results, args, print_table)
    return 0


async def run_all(urls: dict[str, str], tls: dict[str, TlsSettings], key, pieces: list[bytes], counts: list[int],
                  repeats: int) -> dict:
    manifest, raw = make_version(key, 1, pieces)
    async with client_session(timeout_s=None) as s:
        await upload_version(s, urls["origin"], manifest, raw, pieces, connections=4)
    async with client_session(timeout_s=None, tls=tls["trainer"]) as s:
        await upload_version(s, urls["origin_tls"], manifest, raw, pieces, connections=4)
    files = [str(i) for i in range(len(pieces))]
    serve, static, secure, ratio = {}, {}, {}, {}
    for n in counts:
        runs = [await serve_throughput(urls, tls["pool"], manifest, files, n) for _ in range(repeats)]
        serve[str(n)] = round(statistics.median(r[0] for r in runs), 3)
        static[str(n)] = round(statistics.median(r[1] for r in runs), 3)
        secure[str(n)] = round(statistics.median(r[2] for r in runs), 3)
        ratio[str(n)] = round(statistics.median(r[2] for r in runs) / statistics.median(r[0] for r in runs), 2)
    hop: dict[str, list[float]] = {"direct": [], "cut_through": [], "store_and_forward": []}
    version = 2
    for _ in range(repeats):
        for mode in hop:
            hop[mode].append(await relay_hop(urls["origin"], urls["relay"], key, version, pieces, mode))
            version += 1
    return {
        "serve_gbps": serve,
        "serve_tls_gbps": secure,
        "tls_ratio": ratio,
        "baseline_static_gbps": static,
        "relay_hop_seconds": {mode: round(statistics.median(v), 3) for mode, v in hop.items()},
    }


def print_table(r: dict) -> None:
    print(f"Gateway serving a {r['version_mb']} MB version on loopback (median of runs)")
    print(f"{'pullers':>8} {'deltamesh GB/s':>15} {'over mTLS GB/s':>15} {'TLS/plain':>10} {'static server GB/s':>19}")
    for n, v in r["serve_gbps"].items():
        print(f"{n:>8} {v:>15.3f} {r['serve_tls_gbps'][n]:>15.3f} {r['tls_ratio'][n]:>10.2f} "
              f"{r['baseline_static_gbps'][n]:>19.3f}")
    hop = r["relay_hop_seconds"]
    print(f"\nPublish-to-pulled seconds for a {r['version_mb']} MB version")
    print(f"{'path':>20} {'seconds':>9} {'added by hop':>13}")
    for mode in ("direct", "cut_through", "store_and_forward"):
        print(f"{mode:>20} {hop[mode]:>9.3f} {hop[mode] - hop['direct']:>13.3f}")


if __name__ == "__main__":
    sys.exit(main())
