"""The baselines' agents of the transfer benchmark (run through benchmarks/transfer_agent.py inside
emulated hosts): a plain HTTP file server of one file (`serve`, optionally one transfer at a time, as
AstraFlow's weight sender does) and a client that downloads it over one TCP connection (`get`).

A single stream over a long link can take minutes (its window grows slowly, or stays small on a
lossy link), so `get --cap-s S` stops a download after S seconds and reports what had arrived by
then, with the arrival marks (`marks`, every 0.25 s) that the benchmark extrapolates its time from
(transfer_baseline.py); the warm-up of `--warm` is capped the same way, as consecutive range
requests, so the connection it warmed stays open for the timed download.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from transfer_protocol import Progress, add_sync_args, ready_then_wait, results_then_linger

CHUNK = 1024 * 1024
MARK_S = 0.25
"""How often a capped download marks the bytes it has received."""


def serve(args: argparse.Namespace) -> int:
    """A plain aiohttp file server of one file (sendfile), optionally one transfer at a time.

    `--serial` makes the server send to one client at a time, in arrival order, as AstraFlow's weight
    sender does; `/stats` tells how many body bytes it has served.
    """
    from aiohttp import web

    from deltamesh.http import parse_range
    from deltamesh.http import serve as serve_app

    blob = memoryview(Path(args.file).read_bytes())
    size = len(blob)
    lock = asyncio.Lock() if args.serial else None
    stats = {"bytes_served": 0, "requests": 0}

    async def send(request: web.Request) -> web.StreamResponse:
        # Written by hand rather than as a FileResponse returned prepared, which aiohttp would prepare
        # (send) a second time and then drop the connection: a warm client would never be warm.
        try:
            start, end = parse_range(request.headers.get("Range"), size) or (0, size)
        except ValueError:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        resp = web.StreamResponse(status=206 if "Range" in request.headers else 200)
        resp.content_length = end - start
        resp.content_type = "application/octet-stream"
        if resp.status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        await resp.prepare(request)
        for at in range(start, end, CHUNK):
            await resp.write(blob[at:min(end, at + CHUNK)])
        await resp.write_eof()
        stats["bytes_served"] += end - start
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

    cap = args.cap_s or None

    async def fetch_once(session, t_go: float) -> dict:
        h, received, t_first = xxhash.xxh3_128(), 0, None
        marks, next_mark = [], t_go + MARK_S
        async with session.get(args.url) as resp:
            resp.raise_for_status()
            total = resp.content_length or 0
            progress = Progress(total)
            async for chunk in resp.content.iter_chunked(1024 * 1024):
                now = time.time()
                if t_first is None:
                    t_first = now
                while now >= next_mark:  # what had arrived at each mark: all but this chunk
                    marks.append([round(next_mark - t_go, 3), received])
                    next_mark += MARK_S
                h.update(chunk)
                received += len(chunk)
                progress.add(len(chunk))
                if cap and now - t_go >= cap and received < total:
                    resp.close()  # the download stops here; its time is extrapolated
                    break
        return {"t_go": t_go, "t_first_byte": t_first, "t_done": time.time(), "bytes": received, "total": total,
                "capped": received < total, "hash": h.hexdigest(), "progress": progress.marks, "marks": marks}

    async def warm_up(session, t_go: float) -> float:
        """Download (part of) the file over the connection, in ranges that each end, for up to `cap`."""
        start, size = 0, 1 << 20
        while True:
            async with session.get(args.url, headers={"Range": f"bytes={start}-{start + size - 1}"}) as resp:
                if resp.status == 416:  # the whole file came already
                    return time.time() - t_go
                resp.raise_for_status()
                got = len(await resp.read())
            start, size = start + got, size * 2
            if got < size // 2 or (cap and time.time() - t_go >= cap):
                return time.time() - t_go

    async def main() -> dict:
        # One connection, kept open between requests (as a client following versions would).
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=600)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            t_go = ready_then_wait(args)
            if not args.warm:
                return await results_then_linger(args, await fetch_once(session, t_go))
            warm_seconds = await warm_up(session, t_go)  # untimed; then idle, then the timed fetch
            await asyncio.sleep(args.idle_s)
            result = await fetch_once(session, time.time())
            result["t_start"] = result["t_go"]
            result["warm_seconds"] = round(warm_seconds, 3)
            return await results_then_linger(args, result)

    asyncio.run(main())
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
    p.add_argument("--cap-s", type=float, default=0.0, help="stop a download (and the warm-up) after this long "
                                                            "(0: never)")
    add_sync_args(p)
    p.set_defaults(run=get)
