"""The trainer's publish, stage by stage: this checkout against an older one, side by side in one run.

A real `deltamesh gateway` origin on loopback (this checkout's, for both sides: the publish protocol
is the same) receives N versions published back to back by the trainer's `Publisher`, as a trainer
makes them: fp32 master weights are cast to bf16 (`to(torch.bfloat16)` per tensor, as
`published_weights` does), then published. Cases: SmolLM2-135M (real pretrained weights; the
versions alternate between the base and its weights after one real Adam step at lr 5e-6, as
benchmarks/inputs.py builds them, so every delta is a real step's ~1 MB) and the 1.19 GB synthetic
model with Qwen3-0.6B's shapes (1% of words moved by 1-2 ulps). Version 0 is a full snapshot (not
timed); every `--full-every`-th version also carries a periodic full.

Both checkouts run the same harness in their own process (the older one through a package shim, as
benchmarks/swap_compare.py does), alternating `--rounds` times. Stages are timed from outside the
publisher, the same way for both: the harness wraps the publisher module's `encode_delta`,
`encode_full` and `upload_version`. Per version, seconds from the end of the optimizer step
("step_end") to: the bf16 cast done (`cast_s`), the delta encoded (`delta_encoded_s`), the origin
holding the delta (`delta_at_origin_s`), the publish call returning (`publish_s`); and the delta's
encode and upload durations (`delta_encode_s`, `delta_upload_s`: manifest and pieces, on the
publisher's connections); on versions with a periodic full, the full's encode and upload durations
(`full_encode_s`, `full_upload_s`). Medians over versions, split into delta-only versions and
versions with a periodic full. With `--tls` the origin speaks mTLS and the trainer presents its
certificate (what a new connection costs is then a TLS handshake too).

    .venv/bin/python benchmarks/publish.py --before /tmp/publish-before [--after PATH] [--versions 8]
        [--full-every 4] [--rounds 1] [--cases smollm2 synthetic] [--tls] [--json]
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

from common import emit, stop_processes, wait_healthy
from swap_compare import _env_for, commit_of

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "bench"
FIGURES = ("cast_s", "delta_encode_s", "delta_upload_s", "delta_encoded_s", "delta_at_origin_s", "publish_s")
FULL = ("full_encode_s", "full_upload_s")  # durations, on versions with a periodic full


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="checkout of the older commit (e.g. a git worktree)")
    p.add_argument("--after", type=Path, default=ROOT, help="checkout to compare it with (default: this one)")
    p.add_argument("--versions", type=int, default=8, help="versions timed per case and turn (default 8)")
    p.add_argument("--full-every", type=int, default=4, help="periodic full every N versions (default 4)")
    p.add_argument("--rounds", type=int, default=1, help="turns each checkout takes, alternating (default 1)")
    p.add_argument("--cases", nargs="+", default=["smollm2", "synthetic"], choices=["smollm2", "synthetic"])
    p.add_argument("--tls", action="store_true", help="the origin speaks mTLS; the trainer presents its certificate")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--worker", metavar="GATEWAY", help=argparse.SUPPRESS)  # one side's run, against GATEWAY
    args = p.parse_args(argv)
    if args.worker is None and args.before is None:
        p.error("--before is required")
    return args


# -- one side: runs in its own process, importing that side's deltamesh ------------------------------
def _cases(names: list[str]) -> dict[str, tuple[dict, dict]]:
    """name -> (base bf16 weights, stepped bf16 weights)."""
    from inputs import qwen3_shapes, real_cases, synthetic_case

    out = {}
    if "smollm2" in names:
        (case,) = real_cases([5e-6])
        out["smollm2"] = (case.old, case.new)
    if "synthetic" in names:
        case = synthetic_case(qwen3_shapes())
        out["synthetic"] = (case.old, case.new)
    return out


async def _publish_case(gateway: str, key, name: str, old: dict, new: dict, versions: int,
                        full_every: int) -> list[dict]:
    import torch

    import deltamesh.trainer.publisher as publisher_module

    calls: list[tuple[str, str, float, float]] = []  # (what, kind, start, end) of this version

    def timed(what: str, fn):
        async def run_async(*a, **kw):
            start = time.time()
            out = await fn(*a, **kw)
            calls.append((what, a[2].kind, start, time.time()))
            return out

        def run(*a, **kw):
            start = time.time()
            out = fn(*a, **kw)
            calls.append((what, "delta" if what == "encode_delta" else "full", start, time.time()))
            return out

        return run_async if asyncio.iscoroutinefunction(fn) else run

    for what in ("encode_delta", "encode_full", "upload_version"):
        setattr(publisher_module, what, timed(what, getattr(publisher_module, what)))
    tls = None
    if os.environ.get("PUBLISH_BENCH_CA"):
        from deltamesh.tls import TlsSettings

        tls = TlsSettings(cert=os.environ["PUBLISH_BENCH_CERT"], key=os.environ["PUBLISH_BENCH_CERT_KEY"],
                          ca=os.environ["PUBLISH_BENCH_CA"])
    pub = publisher_module.Publisher(gateway, key, f"{MODEL}-{name}", full_every=full_every, tls=tls)
    await pub.publish(old, 0)
    rows = []
    for v in range(1, versions + 1):
        target = new if v % 2 else old
        masters = {k: t.float() for k, t in target.items()}  # the trainer's fp32 masters after its step
        calls.clear()
        step_end = time.time()
        weights = {k: t.to(torch.bfloat16) for k, t in masters.items()}
        cast = time.time()
        published = await pub.publish(weights, v)
        done = time.time()
        del masters
        (enc,) = [c for c in calls if c[0] == "encode_delta"]
        (up,) = [c for c in calls if c[0] == "upload_version" and c[1] == "delta"]
        full = {f"full_{what.split('_')[0]}_s": end - start for what, kind, start, end in calls if kind == "full"}
        rows.append({**full,
            "version": v, "kinds": [m.kind for m in published.manifests],
            "delta_bytes": published.manifests[0].payload_bytes,
            "cast_s": cast - step_end, "delta_encode_s": enc[3] - enc[2], "delta_upload_s": up[3] - up[2],
            "delta_encoded_s": enc[3] - step_end, "delta_at_origin_s": up[3] - step_end, "publish_s": done - step_end,
            "stages": {k: s - step_end for k, s in getattr(published, "stages", {}).items()},
        })
    if hasattr(pub, "aclose"):
        await pub.aclose()
    return rows


def worker(args: argparse.Namespace) -> int:
    import deltamesh.delta as d
    from deltamesh.delta.keys import load_private_key

    key = load_private_key(os.environ["PUBLISH_BENCH_KEY"])
    out = {"code": str(Path(d.__file__).resolve().parent.parent), "cases": {}}
    cases = _cases(args.cases)
    for name, (old, new) in cases.items():
        out["cases"][name] = asyncio.run(_publish_case(args.worker, key, name, old, new, args.versions,
                                                       args.full_every))
    print(json.dumps(out))
    return 0


# -- the driver: one gateway, the two sides taking turns -------------------------------------------
def _turn(tree: Path, env: dict, gateway: str, args: argparse.Namespace, cwd: Path) -> dict:
    cmd = [sys.executable, str(HERE / "publish.py"), "--worker", gateway, "--versions", str(args.versions),
           "--full-every", str(args.full_every), "--cases", *args.cases]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"publish worker on {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["code"]).is_relative_to(tree.resolve()):
        raise RuntimeError(f"the worker ran {result['code']}, expected code from {tree}")
    return result["cases"]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for group, keep in (("delta", lambda r: r["kinds"] == ["delta"]), ("delta_full", lambda r: len(r["kinds"]) > 1)):
        chosen = [r for r in rows if keep(r)]
        if chosen:
            out[group] = {f: statistics.median(r[f] for r in chosen) for f in (*FIGURES, *FULL) if f in chosen[0]}
            out[group]["versions"] = len(chosen)
            out[group]["delta_bytes"] = statistics.median(r["delta_bytes"] for r in chosen)
    return out


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    for case, groups in result["cases"].items():
        for group in ("delta", "delta_full"):
            table = Table(title=f"{case}, {group.replace('_', ' + ')} versions: median seconds after the step ends")
            table.add_column("checkout")
            shown = FIGURES + (FULL if group == "delta_full" else ())
            for f in shown:
                table.add_column(f, justify="right")
            for side in ("before", "after"):
                g = groups[side].get(group)
                if g:
                    table.add_row(f"{side}: {result['commits'][side]}", *(f"{g[f]:.3f}" for f in shown))
            console.print(table)
    console.print(f"{'mTLS' if result['tls'] else 'plain HTTP'}; {result['rounds']} turn(s) per checkout of "
                  f"{result['versions']} versions per case, full every {result['full_every']}.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    from deltamesh.cache import cache_dir
    from deltamesh.delta.keys import generate_key, save_keypair
    from deltamesh.mesh.demo.processes import free_port
    from deltamesh.tls import TlsSettings

    base_env = dict(os.environ)
    base_env.setdefault("DELTAMESH_CACHE", str(cache_dir()))  # both sides use this checkout's built models
    rows: dict = {case: {"before": [], "after": []} for case in args.cases}
    with tempfile.TemporaryDirectory(prefix="publish-bench-") as tmp:
        tmp_path = Path(tmp)
        private = tmp_path / "trainer.key"
        public = save_keypair(generate_key(), private)
        base_env["PUBLISH_BENCH_KEY"] = str(private)
        serve, health = ["--anonymous"], None
        if args.tls:
            from deltamesh.certs import issue, make_ca

            ca = make_ca(tmp_path / "pki")
            server = issue(ca, tmp_path / "pki", "gateway/origin", hosts=["127.0.0.1"])
            trainer = issue(ca, tmp_path / "pki", f"trainer/{MODEL}")
            serve = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--client-ca", str(ca.cert)]
            health = TlsSettings(cert=str(trainer.cert), key=str(trainer.key), ca=str(ca.cert))
            base_env.update(PUBLISH_BENCH_CA=str(ca.cert), PUBLISH_BENCH_CERT=str(trainer.cert),
                            PUBLISH_BENCH_CERT_KEY=str(trainer.key))
        sides = {side: (tree, _env_for(tree, tmp_path / f"shim-{side}", base_env))
                 for side, tree in (("before", args.before), ("after", args.after))}
        for r in range(args.rounds):
            for side, (tree, env) in sides.items():
                port = free_port()
                url = f"{'https' if args.tls else 'http'}://127.0.0.1:{port}"
                with open(tmp_path / f"gateway-{side}-{r}.log", "wb") as log:
                    gw = subprocess.Popen(
                        [str(Path(sys.executable).with_name("deltamesh")), "gateway", "--region", "bench",
                         "--listen", f"127.0.0.1:{port}", "--store", str(tmp_path / f"store-{side}-{r}"),
                         "--trusted-keys", str(public), "--advertise", url, *serve],
                        stdout=log, stderr=subprocess.STDOUT, env=base_env)
                try:
                    wait_healthy(url, gw, tls=health)
                    for case, case_rows in _turn(tree, env, url, args, tmp_path).items():
                        rows[case][side] += case_rows
                finally:
                    stop_processes([gw])
    result = {
        "cases": {case: {side: summarize(r) for side, r in by_side.items()} for case, by_side in rows.items()},
        "runs": rows, "commits": {"before": commit_of(args.before), "after": commit_of(args.after)},
        "tls": args.tls, "rounds": args.rounds, "versions": args.versions, "full_every": args.full_every,
        "command": " ".join([".venv/bin/python", "benchmarks/publish.py", *(argv or sys.argv[1:])]),
    }
    emit(result, args, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
