"""Logging set-up shared by every deltamesh process: one format, one place to pick the level.

Lines are text for a terminal, or with `--log-format json` (DELTAMESH_LOG_FORMAT=json) one JSON object
each, for a log shipper (Loki, Elasticsearch, journald's JSON export) to index without a parser:
`{"time", "level", "logger", "message"}`, with `process` when several services share one output and
`exception` (the traceback, as one string) when there is one.
"""

from __future__ import annotations

import json
import logging
import os
import time

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback stays inside its string)."""

    def __init__(self, process_name: str | None = None):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process_name is not None:
            line["process"] = self.process_name
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str | int | None = None, *, process_name: str | None = None,
                  log_format: str | None = None) -> None:
    """Configure the root logger once per process.

    `level` falls back to the DELTAMESH_LOG environment variable, then INFO; `log_format` ("text" or
    "json") to DELTAMESH_LOG_FORMAT, then text. `process_name` tags each line so that logs of several
    services started by one command stay readable.
    """
    if level is None:
        level = os.environ.get("DELTAMESH_LOG", "INFO")
    log_format = log_format or os.environ.get("DELTAMESH_LOG_FORMAT") or "text"
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} must be one of {', '.join(LOG_FORMATS)}")
    fmt = LOG_FORMAT if process_name is None else f"%(asctime)s %(levelname).1s [{process_name}] %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, force=True)
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter(process_name))
    # aiohttp logs every request at INFO; keep it for debugging only.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def setup_guest_logging(level: str | int | None = None) -> None:
    """Show deltamesh's own log lines when it runs inside another program (a vLLM worker, through the
    weight-transfer backend) that configures logging its own way: a handler on the `deltamesh` logger
    alone, in the project's format, at `level` (default as `setup_logging`); the root logger and the
    host's loggers are left as they are. Once per process."""
    logger = logging.getLogger("deltamesh")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level if level is not None else os.environ.get("DELTAMESH_LOG", "INFO"))
    logger.propagate = False
