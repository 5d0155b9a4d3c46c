"""Expected failures of the real command line: each is one line on stderr and its documented exit code
(docs/CLI.md): a key file missing or of the wrong kind (2), a URL that does not answer (3), a token
refused (4, before anything is downloaded), a port in use (5, before any "up" line), a full disk (6)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.delta import write_weights
from deltamesh.mesh.cli.exits import Exit
from deltamesh.mesh.demo.processes import free_port
from deltamesh.tokens import TokenSpec, add_token

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


def run(*args: str, timeout: float = 60, token: str = "") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAMESH_")}
    env = {**clean, **({"DELTAMESH_TOKEN": token} if token else {})}  # a token never goes on the command line
    return subprocess.run([DELTAMESH, *args], capture_output=True, text=True, timeout=timeout, env=env)


def one_line(done: subprocess.CompletedProcess, code: int, text: str, *, alone: bool = True) -> str:
    """The one error line of a command that failed with `code`, which must contain `text`: its whole
    stderr, or (not `alone`: it got as far as logging its progress) its last line and only error."""
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if " E " in line]
    assert done.returncode == code and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert (len(lines) == 1 if alone else errors == lines[-1:]) and text in lines[-1], done.stderr
    return lines[-1]


def test_key_files_missing_or_of_the_wrong_kind(kit, tmp_path):
    store = str(tmp_path / "store")
    one_line(run("gateway", "--store", store, "--anonymous", "--trusted-key", str(tmp_path / "none.pub")),
             Exit.USAGE, "No such file or directory")
    leaked = one_line(run("gateway", "--store", store, "--anonymous", "--trusted-key", str(kit.key.private)),
                      Exit.USAGE, "holds a private key")
    assert "PRIVATE KEY-----" not in leaked
    src = tmp_path / "weights"
    write_weights(src, kit.tiny_weights())
    one_line(run("publish", "--gateway", "http://127.0.0.1:9", "--model", "m", "--key", str(kit.key.public),
                 "--state", str(tmp_path / "st"), str(src)), Exit.USAGE, "holds a public key")
    one_line(run("pool", "sync", "--once", "--gateway", "http://127.0.0.1:9", "--name", "p",
                 "--dir", str(tmp_path / "p"), "--trusted-key", str(kit.key.private), token="t"), Exit.USAGE,
             "holds a private key")


def test_unreachable_urls(kit, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    one_line(run("pools", "--gateway", down), Exit.UNREACHABLE, "unreachable")
    src = tmp_path / "weights"
    write_weights(src, kit.tiny_weights())
    one_line(run("publish", "--gateway", down, "--model", "m", "--key", str(kit.key.private), "--state",
                 str(tmp_path / "st"), str(src)), Exit.UNREACHABLE, "cannot reach gateway")


def test_a_port_in_use_fails_before_any_up_line(kit, tmp_path):
    tokens = tmp_path / "tokens.toml"
    add_token(tokens, TokenSpec("ops", "admin"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run("gateway", "--listen", f"127.0.0.1:{port}", "--store", str(tmp_path / "store"),
                   "--trusted-key", str(kit.key.public), "--tokens-file", str(tokens))
    line = one_line(done, Exit.PORT_IN_USE, f"cannot listen on 127.0.0.1:{port}: address already in use")
    assert " up" not in line and not (tmp_path / "store").exists()


@pytest.mark.slow
def test_a_refused_token_fails_before_any_download(kit, spawn_gateway, tmp_path):
    tokens = tmp_path / "tokens.toml"
    trainer = add_token(tokens, TokenSpec("t", "trainer", ["m"]))
    other_pool = add_token(tokens, TokenSpec("someone-else", "pool"))
    gw = spawn_gateway("eu", anonymous=False, extra=["--tokens-file", str(tokens)])
    src = tmp_path / "weights"
    write_weights(src, kit.tiny_weights())
    published = run("publish", "--gateway", gw.url, "--model", "m", "--key", str(kit.key.private),
                    "--state", str(tmp_path / "st"), str(src), token=trainer)
    assert published.returncode == 0, published.stderr
    for token, why in (("dm_wrong", "401"), (other_pool, "403")):
        pool_dir = tmp_path / f"pool-{why}"
        done = run("pool", "sync", "--once", "--gateway", gw.url, "--name", "p1", "--dir",
                   str(pool_dir), "--trusted-key", str(kit.key.public), token=token)
        one_line(done, Exit.REFUSED, why)
        assert not pool_dir.exists() or not any(pool_dir.iterdir()), why  # nothing was downloaded
    assert "/pieces/" not in gw.log_tail(100_000)


@pytest.mark.slow
def test_a_full_disk(kit, spawn_gateway, tmp_path):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tiny)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        gw = spawn_gateway("eu")
        import torch

        src = tmp_path / "weights"
        write_weights(src, {"w": torch.randn(512 * 1024, generator=torch.Generator().manual_seed(0)).bfloat16()})
        published = run("publish", "--gateway", gw.url, "--model", "m", "--key", str(kit.key.private), "--state",
                        str(tmp_path / "st"), str(src))
        assert published.returncode == 0, published.stderr  # 1 MiB of weights, 256 KiB of disk
        done = run("pool", "sync", "--once", "--gateway", gw.url, "--name", "p1", "--dir",
                   str(tiny / "pool"), "--trusted-key", str(kit.key.public), token="t")
        one_line(done, Exit.DISK_FULL, "No space left on device", alone=False)
    finally:
        subprocess.run(["umount", str(tiny)], capture_output=True)
