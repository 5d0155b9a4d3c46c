"""The processes of the transfer benchmark that run inside emulated hosts (network namespaces).

`benchmarks/transfer.py` starts one of these per role with `Host.spawn`: a publisher that uploads a
prepared version to the origin gateway, deltamesh pullers that fetch a version's pieces from a
gateway (parallel, verified, as a relay or pool agent does), a plain HTTP file server and single-stream
clients for the baselines (transfer_agent_baselines.py), and small probes (`--ca` verifies an https:// gateway, see transfer_tls.py).
Every timed agent follows the same protocol so that all agents of a run start at the same instant: it
does its set-up (imports, reading its input), creates its `--ready` file, waits for the `--go` file to
appear, does its work and writes one JSON object of wall-clock times (`time.time()`, one clock for
every namespace of the machine) to `--out` (transfer_protocol.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from transfer_agent_baselines import add_baseline_commands
from transfer_protocol import GO_POLL_S, Progress, add_sync_args, ready_then_wait, results_then_linger, write_json
from transfer_tls import add_ca_arg, client_tls, url_context

AHEAD_WAIT_S = 60.0
ARM_S = 1.0
"""How long a puller asking ahead gives its requests to reach the gateway before the publish starts."""


# --- probes -------------------------------------------------------------------------------------

def wait_http(args: argparse.Namespace) -> int:
    """Exit 0 once `url` answers at all (any HTTP status below 500), 1 after the timeout."""
    deadline, context = time.monotonic() + args.timeout, url_context(args)
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(args.url, timeout=2, context=context):
                return 0
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return 0
        except OSError:
            pass
        time.sleep(0.1)
    print(f"{args.url} did not answer within {args.timeout:g} s", file=sys.stderr)
    return 1


def fetch_text(args: argparse.Namespace) -> int:
    """Print the body of `url` (a gateway's /metrics or /v1/links, a file server's /stats)."""
    with urllib.request.urlopen(args.url, timeout=30, context=url_context(args)) as r:
        sys.stdout.write(r.read().decode())
    return 0


# --- deltamesh: publish and pull -----------------------------------------------------------------

def publish(args: argparse.Namespace) -> int:
    """Upload a prepared version (transfer_payload.py's layout) to the origin gateway as `--version`;
    with `--after PATH`, `--count` versions from `--version` on, each once `PATH.k` exists (a warm
    puller's `--armed`: its request for that version waits at the gateway)."""
    import dataclasses

    from deltamesh.delta import Manifest, load_private_key
    from deltamesh.http import client_session
    from deltamesh.trainer.upload import upload_version

    folder = Path(args.payload)
    body = Manifest.from_body((folder / "manifest.json").read_bytes())
    key = load_private_key(args.key)
    blob = (folder / "version.bin").read_bytes()
    view, pieces, offset = memoryview(blob), [], 0
    for entry in body.pieces:
        pieces.append(view[offset:offset + entry.length])
        offset += entry.length

    async def main() -> dict:
        async with client_session(connections=max(8, args.connections), timeout_s=None,
                                  tls=client_tls(args)) as session:
            t_go = ready_then_wait(args)
            done = []
            for k in range(args.count):
                t_start = t_go
                if args.after:
                    while not os.path.exists(f"{args.after}.{k}"):
                        await asyncio.sleep(GO_POLL_S)
                    t_start = time.time()
                manifest = dataclasses.replace(body, version=args.version + k, created_ms=int(time.time() * 1000))
                sent = await upload_version(session, args.gateway, manifest, manifest.signed(key), pieces,
                                            connections=args.connections)
                done.append({"version": manifest.version, "t_start": t_start, "t_done": time.time(), "bytes": sent})
            return {"t_start": done[0]["t_start"], "t_done": done[-1]["t_done"], "bytes": done[0]["bytes"],
                    "versions": done}

    write_json(args.out, asyncio.run(main()))
    return 0


def pull(args: argparse.Namespace) -> int:
    """Fetch every piece of one version from a gateway, verified against the signed manifest.

    With `--after-complete` the fetch starts only once the gateway holds the whole version, as a
    store-and-forward relay would serve it; otherwise it starts the moment the version is announced.
    With `--warm-version` it first fetches that version (untimed), then `--repeat` times idles and
    asks for the next version (`--version` on) ahead, before it is published, as a relay that holds
    the head does (its requests wait at the gateway); it creates `--armed`.k once they are there, for
    the publisher to start; its result lists those fetches under `runs`.
    """
    from deltamesh.delta import load_manifest, load_public_key
    from deltamesh.gateway.fetch.fetcher import Fetcher
    from deltamesh.gateway.fetch.plan_steps import inline_envelopes
    from deltamesh.gateway.fetch.sources import Source
    from deltamesh.http import client_session, request_json

    keys = [load_public_key(args.trusted_key)]
    base = args.gateway.rstrip("/")
    model = args.model

    def fetcher_of(session, progress=None) -> Fetcher:
        fetcher = Fetcher(session, [Source(base)], f"pool/{args.name}", stall_timeout_s=30, give_up_s=300)
        fetcher.on_bytes = progress.add if progress is not None else None  # bytes as they arrive, for the ramp
        return fetcher

    async def fetch_version(session, version: int, wait_s: float = 0.0, on_asked=None, inline=None,
                            parts=None, progress=None) -> dict:
        progress = progress or Progress()
        fetcher = fetcher_of(session, progress)
        asked = asyncio.ensure_future(fetcher.manifest_bytes(model, version, args.kind, _accept(load_manifest, keys),
                                                             prefetch=0 if parts else args.connections,
                                                             wait_s=wait_s, inline=inline))
        if on_asked is not None:
            await on_asked()
        manifest = await asked
        t_manifest = time.time()
        progress.total = manifest.payload_bytes
        verified = 0

        async def keep(index: int, data: bytearray) -> None:
            nonlocal verified
            verified += len(data)  # checked by the fetcher against the signed manifest

        await fetcher.pieces(manifest, range(len(manifest.pieces)), args.connections, keep, parts)
        return {"t_manifest": t_manifest, "t_done": time.time(), "bytes": verified, "pieces": len(manifest.pieces),
                "progress": progress.marks}

    async def pull_one(session, version: int, t_go: float) -> dict:
        # A cold puller asks for parts of the newest whole version on all its connections while its
        # first request (the head poll) is on its way, as a cold pool agent does (`Fetcher.ask_parts`);
        # without parts, it opens its connections then, as a relay does (`Fetcher.open_connections`).
        opening = parts = None
        progress = Progress()
        if args.parts and not args.after_complete:
            parts = fetcher_of(session, progress).ask_parts(model, args.kind, args.connections)
        elif args.open_ahead:
            opening = asyncio.ensure_future(fetcher_of(session).open_connections(args.connections))
        while True:  # long-poll until the version is announced
            answer = await request_json(session, "GET", f"{base}/v1/models/{model}/head",
                                        params={"after": version - 1, "wait": 30, "manifests": 1}, timeout_s=60)
            if answer["head"] is not None and answer["head"] >= version:
                break
        # The manifest rides the head answer, as a pool agent asks for it (`manifests=1`).
        inline = inline_envelopes(Source(base), answer["head"], answer.get("manifests")).get((version, args.kind))
        t_announced = time.time()
        if args.after_complete:
            while not await _complete_at(session, base, model, version, args.kind):
                await asyncio.sleep(0.02)
        if opening is not None:
            await opening  # answered with the head poll, or moments after
        t_fetch = time.time()
        return {"t_go": t_go, "t_announced": t_announced, "t_fetch": t_fetch,
                **await fetch_version(session, version, inline=None if args.after_complete else inline, parts=parts,
                                      progress=progress)}

    async def pull_ahead(session, version: int, armed: str) -> dict:
        async def arm() -> None:
            await asyncio.sleep(ARM_S)
            Path(armed).touch()

        t_asked = time.time()
        result = await fetch_version(session, version, wait_s=AHEAD_WAIT_S, on_asked=arm)
        return {"t_go": t_asked, "t_announced": result["t_manifest"], "t_fetch": result["t_manifest"], **result}

    async def main() -> dict:
        async with client_session(connections=2 * args.connections + 4, timeout_s=None,
                                  tls=client_tls(args)) as session:
            t_go = ready_then_wait(args)
            if args.warm_version is None:
                return await results_then_linger(args, await pull_one(session, args.version, t_go))
            # Steady state: the previous version came over these same connections, then they idled.
            warm = await pull_one(session, args.warm_version, t_go)
            runs = []
            for k in range(args.repeat):
                await asyncio.sleep(args.idle_s)
                runs.append(await pull_ahead(session, args.version + k, f"{args.armed}.{k}"))
            return await results_then_linger(args, {"warm_seconds": round(warm["t_done"] - warm["t_go"], 3),
                                                    "t_done": runs[-1]["t_done"], "runs": runs})

    asyncio.run(main())
    return 0


def publish_steps(args: argparse.Namespace) -> int:
    """Publish cached training versions with the trainer's publisher, one every `--step-seconds`."""
    from safetensors.torch import load_file

    from deltamesh.delta import load_private_key
    from deltamesh.trainer.publisher import Publisher

    folder = Path(args.steps_dir)
    publisher = Publisher(args.gateway, load_private_key(args.key), args.model, full_every=args.full_every)
    weights = [load_file(str(folder / f"v{i:02d}.safetensors")) for i in range(args.count)]

    async def main(t_go: float) -> list[dict]:
        out = []
        for version, w in enumerate(weights):
            # A trainer's cadence: the next version is due one step after the last was due, ready or not.
            await asyncio.sleep(max(0.0, t_go + version * args.step_seconds - time.time()))
            t_start = time.time()
            result = await publisher.publish(w, version)
            out.append({"version": version, "t_start": t_start, "t_done": time.time(),
                        "manifests": [{"kind": m.kind, "payload_bytes": m.payload_bytes} for m in result.manifests]})
        return out

    write_json(args.out, {"versions": asyncio.run(main(ready_then_wait(args)))})
    return 0


def _accept(load_manifest, keys):
    async def accept(raw: bytes):
        return load_manifest(raw, keys)
    return accept


async def _complete_at(session, base: str, model: str, version: int, kind: str) -> bool:
    from deltamesh.http import HttpError, request_json

    try:
        listing = await request_json(session, "GET", f"{base}/v1/models/{model}/versions", timeout_s=30)
    except HttpError as e:
        if e.status == 404:
            return False
        raise
    return any(v["version"] == version and v["kind"] == kind and v["complete"] for v in listing["versions"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("wait-http", help="wait until a URL answers")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=60.0)
    add_ca_arg(p)
    p.set_defaults(run=wait_http)

    p = sub.add_parser("fetch", help="print the body of a URL")
    p.add_argument("url")
    add_ca_arg(p)
    p.set_defaults(run=fetch_text)

    p = sub.add_parser("publish", help="upload a prepared version to an origin gateway")
    p.add_argument("--gateway", required=True)
    p.add_argument("--payload", required=True, help="folder with manifest.json (body) and version.bin")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--key", required=True, help="trainer private key (PEM)")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--after", help="publish version k once PATH.k exists (a warm puller's --armed)")
    p.add_argument("--count", type=int, default=1, help="versions to publish, from --version on")
    add_ca_arg(p)
    add_sync_args(p)
    p.set_defaults(run=publish)

    p = sub.add_parser("publish-steps", help="publish cached training versions on a cadence")
    p.add_argument("--gateway", required=True)
    p.add_argument("--steps-dir", required=True, help="folder of v00.safetensors, v01.safetensors, ...")
    p.add_argument("--count", type=int, required=True, help="how many versions, from v00")
    p.add_argument("--model", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--step-seconds", type=float, required=True)
    add_sync_args(p)
    p.set_defaults(run=publish_steps)

    p = sub.add_parser("pull", help="fetch a version's pieces from a gateway")
    p.add_argument("--gateway", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--kind", default="full", choices=("full", "delta"))
    p.add_argument("--trusted-key", required=True)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--name", default="bench")
    p.add_argument("--after-complete", action="store_true", help="start only once the gateway holds all of it")
    p.add_argument("--warm-version", type=int, default=None,
                   help="first fetch this version over the same connections (untimed), idle, then ask ahead")
    p.add_argument("--armed", help="with --warm-version: ARMED.k is created once the requests for the k-th timed "
                                   "version wait at the gateway")
    p.add_argument("--repeat", type=int, default=1, help="with --warm-version: timed versions, one after another")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle time between the warm-up and the timed fetch")
    p.add_argument("--no-parts", dest="parts", action="store_false",
                   help="pull: do not ask for parts of the newest version beside the head poll")
    p.add_argument("--no-open-ahead", dest="open_ahead", action="store_false",
                   help="open the parallel connections only when the pieces are asked for (the old cold path)")
    add_ca_arg(p)
    add_sync_args(p)
    p.set_defaults(run=pull)

    add_baseline_commands(sub)

    args = ap.parse_args(argv)
    from deltamesh.logs import setup_logging

    setup_logging(process_name=f"agent-{args.command}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
