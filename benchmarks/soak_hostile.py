"""A malicious relay for the soak: a process that takes a relay gateway's address and lies to its clients.

The soak moves the real relay to a loopback port and starts this in its place, with the relay's own
certificate and token (what an attacker who owns the relay's host has). Its clients (the region's
pools and the downstream relay) talk to it as to their gateway; it passes everything through to the
real one except what its mode falsifies, with the test suite's hostile doubles (tests/gateway):

- `tamper` (hostile.py): flips one byte in the middle of every piece it serves;
- `rollback` (relay_double.py): announces an old head, and serves that old version's validly signed
  manifest and pieces under the URLs of every newer version (a rollback and a mix-and-match attack).

Every client must refuse what it is served and stay on what it holds; once the soak puts the real relay
back, they continue from there. Runs until SIGTERM or SIGINT; prints `ready` once it listens.

    python benchmarks/soak_hostile.py --mode tamper --listen 10.78.0.2:8700 --cert C --key K \\
        --honest http://127.0.0.1:8701 --token-file eu.token --model policy
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import sys
from pathlib import Path

from deltamesh.delta.manifest import load_manifest_unverified
from deltamesh.gateway_client import version_url
from deltamesh.http import HttpError, bearer, client_session, request_bytes, request_json
from deltamesh.tls import TlsSettings, server_context

log = logging.getLogger("soak_hostile")

HELPERS = Path(__file__).resolve().parents[1] / "tests" / "gateway"
AHEAD = 2000
"""How many versions past the current head the rollback mode answers with the old one."""


def load_helpers() -> None:
    """Import the test doubles as their tests do (`deltamesh_test_NAME`, see tests/gateway/conftest.py)."""
    for name in ("passthrough", "hostile", "relay_double"):
        spec = importlib.util.spec_from_file_location(f"deltamesh_test_{name}", HELPERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)


async def old_version(honest: str, token: str, model: str) -> tuple[int, int, str, bytes, list[bytes]]:
    """(head, old version, its kind, its signed manifest, its pieces): the oldest complete version held
    (asked again until the real relay, restarted beside this process, answers)."""
    async with client_session(headers=bearer(token)) as s:
        for attempt in range(120):
            try:
                listing = await request_json(s, "GET", f"{honest}/v1/models/{model}/versions")
                break
            except HttpError:
                if attempt == 119:
                    raise
                await asyncio.sleep(0.5)
        complete = sorted((v for v in listing["versions"] if v["complete"]), key=lambda v: v["version"])
        for old in complete:
            base = version_url(honest, model, old["version"], old["kind"])
            try:
                manifest = await request_bytes(s, "GET", f"{base}/manifest")
                parsed, _ = load_manifest_unverified(manifest)
                pieces = [await request_bytes(s, "GET", f"{base}/pieces/{i}") for i in range(len(parsed.pieces))]
            except HttpError as e:  # the oldest may be dropped by the store's retention while it is read
                log.info("v%d could not be read whole (%s): taking the next", old["version"], e)
                continue
            return int(listing["head"]), old["version"], old["kind"], manifest, pieces
        raise RuntimeError(f"none of the {len(complete)} complete versions of {model} could be read whole")


async def serve(args: argparse.Namespace) -> None:
    hostile, relay_double = sys.modules["deltamesh_test_hostile"], sys.modules["deltamesh_test_relay_double"]
    if args.mode == "tamper":
        double = hostile.Hostile(args.honest, hostile.Mode(flip=True))
    else:
        token = Path(args.token_file).read_text().strip()
        head, old, kind, manifest, pieces = await old_version(args.honest, token, args.model)
        double = relay_double.RelayDouble(args.honest, head=old)
        for version in range(old + 1, head + AHEAD):
            for k in ("delta", "full"):
                double.versions[(version, k)] = (manifest, pieces)
        log.info("rollback: announcing v%d (%s) and serving it as every version up to v%d", old, kind, head + AHEAD)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    context = server_context(TlsSettings(cert=args.cert, key=args.key))
    async with double.serving(args.listen, ssl_context=context):
        print("ready", flush=True)  # the handshake the injector waits for on stdout, not a log line
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("tamper", "rollback"), required=True)
    p.add_argument("--listen", required=True, help="HOST:PORT of the relay it stands in for")
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--honest", required=True, help="URL of the real relay behind it")
    p.add_argument("--token-file", required=True, help="the relay's own gateway token (reads the old version)")
    p.add_argument("--model", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
    load_helpers()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
