"""`--log-format json` and the global flags: one JSON object a line (a traceback inside its string),
the same from the processes a command starts, and `--log-level` / `--log-format` taken before or after
the command. Real `deltamesh` processes: a gateway that starts, logs and is stopped."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from common import wait_healthy

from deltamesh.delta.keys import generate_key, save_keypair
from deltamesh.logs import JsonFormatter
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.demo.processes import free_port

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


def _gateway_log(tmp_path: Path, *flags: str, before: tuple[str, ...] = ()) -> str:
    """Start a gateway with `before` ahead of the command and `flags` after it; stop it; its stderr."""
    save_keypair(generate_key(), tmp_path / "t.key")
    port = free_port()
    proc = subprocess.Popen([DELTAMESH, *before, "gateway", "--anonymous", "--region", "o", "--listen",
                             f"127.0.0.1:{port}", "--store", str(tmp_path / "store"), "--trusted-key",
                             str(tmp_path / "t.key.pub"), *flags], stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 143, err
    return err


@pytest.mark.parametrize("where", ["after", "before"])
def test_a_gateway_logs_json_lines(tmp_path, where):
    flags = ("--log-format", "json")
    err = _gateway_log(tmp_path, *(flags if where == "after" else ()), before=flags if where == "before" else ())
    lines = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any(line["message"].startswith("gateway o up") for line in lines)
    assert lines[-1]["message"] == "gateway o: stopping (SIGTERM)" and lines[-1]["level"] == "INFO"


def test_log_level_after_the_command_counts(tmp_path):
    err = _gateway_log(tmp_path, "--log-level", "WARNING")
    assert "gateway o up" not in err and "anonymous" in err  # INFO gone, the WARNING kept


def test_global_flags_before_are_not_reset_by_the_command():
    parser = build_parser()
    args = parser.parse_args(["--log-format", "json", "--log-level", "DEBUG", "keys", "generate", "--out", "k"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    args = parser.parse_args(["pool", "sync", "--log-format", "json", "--gateway", "http://g:1"])
    assert args.log_format == "json" and args.log_level is None


def test_a_traceback_stays_inside_its_json_line():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("it",), sys.exc_info())
    line = JsonFormatter("pool-1").format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "failed: it" and parsed["process"] == "pool-1" and "RuntimeError: boom" in parsed["exception"]
