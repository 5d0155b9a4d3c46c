"""The progress of a pool's transfers (docs/CLI.md, "Progress"): `deltamesh pool sync` against a real gateway
logs what each version took when stderr is not a terminal and draws a bar when it is one (a pty), and
the reporter logs a line every few seconds while a long transfer runs (a clock of the test's own)."""

from __future__ import annotations

import logging
import os
import pty
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from deltamesh.delta import read_weights
from deltamesh.mesh.cli.progress import TransferProgress

SUMMARY = re.compile(r"pool p1: tiny v0 \(full\): fetched (\d+\.\d) MiB in [\d.]+ s, [\d.]+ MiB/s")


def sync_args(gw, tmp_path) -> list[str]:
    token = tmp_path / "p1.token"  # a token never goes on the command line: a private file
    token.write_text(gw.tokens["p1"] + "\n")
    token.chmod(0o600)
    return ["pool", "sync", "--once", "--gateway", gw.url, "--token-file", str(token), "--name", "p1", "--dir",
            str(tmp_path / "pool-p1"), "--trusted-key", str(gw.public_key)]


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k].view(torch.int16), w.view(torch.int16))
                                             for k, w in want.items())


@pytest.mark.slow
def test_pool_sync_logs_its_progress_when_stderr_is_not_a_terminal(published_gateway, deltamesh, tmp_path):
    gw = published_gateway
    done = deltamesh(*sync_args(gw, tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "tiny v0", done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if SUMMARY.search(ln)]
    # The bytes the gateway served, as the pool counted them (2 MiB of bf16 words, compressed).
    assert float(SUMMARY.search(line).group(1)) == round(gw.served_bytes() / 2**20, 1) > 1.0
    assert "\x1b[" not in done.stderr  # no terminal control codes in a log
    assert same_bits(read_weights(tmp_path / "pool-p1"), gw.weights)


@pytest.mark.slow
def test_pool_sync_draws_a_bar_on_a_terminal(published_gateway, tmp_path):
    gw = published_gateway
    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")} | {"TERM": "xterm",
                                                                                     "COLUMNS": "120"}
    proc = subprocess.Popen([gw.command, *sync_args(gw, tmp_path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=child, env=env)
    os.close(child)
    seen = b""
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the pty's other end is closed: the process is done with stderr
            break
        if not data:
            break
        seen += data
    os.close(main)
    assert proc.wait(60) == 0 and proc.stdout.read().decode().strip() == "tiny v0", seen.decode(errors="replace")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
    # The bar: its track and the bytes it counts (rich's DownloadColumn, "1.2/2.1 MB"), then, once it is
    # gone, the line that stays.
    assert "━" in screen and re.search(r"pool p1: tiny v0 \(full\) .*[\d.]+/[\d.]+ [kM]B", screen), screen
    assert SUMMARY.search(screen), screen
    assert same_bits(read_weights(tmp_path / "pool-p1"), gw.weights)


def test_a_long_transfer_logs_a_line_every_few_seconds(caplog):
    now = [1000.0]
    progress = TransferProgress(tty=False, every_s=5.0, clock=lambda: now[0])
    sync = SimpleNamespace(config=SimpleNamespace(name="eu-1"), model="policy", on_progress=None)
    progress.watch(sync)
    transfer = {"from": 3, "to": 4, "bytes_total": 40 * 2**20, "bytes_done": 0, "started": 1000.0}
    with caplog.at_level(logging.INFO, logger="deltamesh.mesh.cli.progress"):
        sync.on_progress(transfer)  # as the transfer starts
        for second in range(1, 13):  # 12 s at 1 MiB/s, told after each piece
            now[0] = 1000.0 + second
            sync.on_progress({**transfer, "bytes_done": second * 2**20})
        sync.on_progress({**transfer, "bytes_done": 12 * 2**20, "applied": 4})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["pool eu-1: policy v3 -> v4: 5.0 MiB of 40.0 MiB (12%), 1.0 MiB/s",
                     "pool eu-1: policy v3 -> v4: 10.0 MiB of 40.0 MiB (25%), 1.0 MiB/s",
                     "pool eu-1: policy v3 -> v4: fetched 12.0 MiB in 12.0 s, 1.0 MiB/s"]
