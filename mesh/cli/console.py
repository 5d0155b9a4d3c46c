"""`deltamesh console`: the web console of one mesh (mesh/console/, docs/CONSOLE.md).

Settings come from the `[console]` table of `--config FILE` (mesh/console/config.py); the flags,
derived from that dataclass, override it. A console that would listen off loopback without TLS and
a login token of its own stops before it binds (exit code 2).
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.mesh.console.config import ConsoleConfig

    config_command(commands, "console", ConsoleConfig, run, section="console",
                   help="serve a web console of the mesh: links, versions, pools, broker",
                   description="Serve a live web page of one mesh, read server side from its gateways, pools and "
                               "broker with the console's own tokens (the browser never sees them).")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from deltamesh.http import listen_socket, parse_listen, serve
    from deltamesh.mesh.cli import command_config, failed
    from deltamesh.mesh.cli.exits import Exit
    from deltamesh.mesh.console.collect import Collector
    from deltamesh.mesh.console.config import ConsoleConfig
    from deltamesh.mesh.console.server import build_app
    from deltamesh.tls import TlsError, server_context

    config = command_config(args, ConsoleConfig, "console")
    host, port = parse_listen(config.listen)
    try:
        context = server_context(config.tls)
    except TlsError as e:
        return failed(e)
    try:
        sock = listen_socket(host, port)
    except OSError as e:
        return failed(e, Exit.PORT_IN_USE)
    collector = Collector(config)
    app = build_app(collector, secure_cookie=context is not None)
    stop = asyncio.Event()
    readers: list[asyncio.Task] = []

    async def start(app) -> None:
        await collector.open()
        readers.append(asyncio.get_running_loop().create_task(collector.run(stop)))
        scheme = "https" if context is not None else "http"
        logging.getLogger(__name__).info("console at %s://%s:%d/", scheme, host, sock.getsockname()[1])

    async def finish(app) -> None:
        stop.set()
        await asyncio.gather(*readers)
        await collector.close()

    app.on_startup.append(start)
    app.on_cleanup.append(finish)
    return serve(app, host, port, ssl_context=context, sock=sock, what="console")
