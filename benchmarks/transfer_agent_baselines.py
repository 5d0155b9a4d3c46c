"""The baselines' agents of the transfer benchmark (run through benchmarks/transfer_agent.py inside
emulated hosts): a plain HTTP file server of one file (`serve`, optionally one transfer at a time, as
AstraFlow's weight sender does) and a client that downloads it over one TCP connection (`get`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from transfer_protocol import Progress, add_sync_args, ready_then_wait, write_json


def serve(args: argparse.Namespace) -> int:
    """A plain aiohttp file server of one file (sendfile), optionally one transfer at a time.

    `--serial` makes the server send to one client at a time, in arrival order, as AstraFlow's weight
    sender does; `/stats` tells how many body bytes it has served.
    """
    from aiohttp import web

    from deltamesh.http import serve as serve_app

    path = Path(args.file)
    size = path.stat().st_size
    lock = asyncio.Lock() if args.serial else None
    stats = {"bytes_served": 0, "requests": 0}

    async def send(request: web.Request) -> web.StreamResponse:
        resp = web.FileResponse(path, chunk_size=1024 * 1024)
        await resp.prepare(request)
        await resp.write_eof()
        stats["bytes_served"] += size
        stats["requests"] += 1
        return resp

    async def version(request: web.Request) -> web.StreamResponse:
        if lock is None:
            return await send(request)
        async with lock:
            return await send(request)

    async def show_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application()
    app.router.add_get("/version.bin", version)
    app.router.add_get("/stats", show_stats)
    serve_app(app, "0.0.0.0", args.port)
    return 0


def get(args: argparse.Namespace) -> int:
    """One HTTP GET of the whole version over one TCP connection, hashed as it arrives."""
    import aiohttp
    import xxhash

    async def fetch_once(session, t_go: float) -> dict:
        h, received, t_first = xxhash.xxh3_128(), 0, None
        async with session.get(args.url) as resp:
            resp.raise_for_status()
            progress = Progress(resp.content_length or 0)
            async for chunk in resp.content.iter_chunked(1024 * 1024):
                if t_first is None:
                    t_first = time.time()
                h.update(chunk)
                received += len(chunk)
                progress.add(len(chunk))
        return {"t_go": t_go, "t_first_byte": t_first, "t_done": time.time(), "bytes": received,
                "hash": h.hexdigest(), "progress": progress.marks}

    async def main() -> dict:
        # One connection, kept open between requests (as a client following versions would).
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=600)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            t_go = ready_then_wait(args)
            if not args.warm:
                return await fetch_once(session, t_go)
            warm = await fetch_once(session, t_go)  # untimed; then idle, then the timed fetch
            await asyncio.sleep(args.idle_s)
            result = await fetch_once(session, time.time())
            result["t_start"] = result["t_go"]
            result["warm_seconds"] = round(warm["t_done"] - warm["t_go"], 3)
            return result

    write_json(args.out, asyncio.run(main()))
    return 0


def add_baseline_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one file over plain HTTP")
    p.add_argument("--file", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--serial", action="store_true", help="one transfer at a time")
    p.set_defaults(run=serve)

    p = sub.add_parser("get", help="download a URL over one TCP connection")
    p.add_argument("--url", required=True)
    p.add_argument("--warm", action="store_true", help="download it once untimed first, then idle")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle time between the warm-up and the timed fetch")
    add_sync_args(p)
    p.set_defaults(run=get)
