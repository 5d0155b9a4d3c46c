"""Logging set-up shared by every deltamesh process: one format, one place to pick the level."""

from __future__ import annotations

import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(level: str | int | None = None, *, process_name: str | None = None) -> None:
    """Configure the root logger once per process.

    `level` falls back to the DELTAMESH_LOG environment variable, then INFO. `process_name` tags each
    line so that logs of several services started by one command stay readable.
    """
    if level is None:
        level = os.environ.get("DELTAMESH_LOG", "INFO")
    fmt = LOG_FORMAT if process_name is None else f"%(asctime)s %(levelname).1s [{process_name}] %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, force=True)
    # aiohttp logs every request at INFO; keep it for debugging only.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
