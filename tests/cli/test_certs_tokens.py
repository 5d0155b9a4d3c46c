"""`deltamesh certs` and `deltamesh tokens` as an operator runs them: real processes, real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deltamesh.tokens import TokenStore

DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DELTAMESH, *args], capture_output=True, text=True, timeout=60)


def test_certs_make_a_ca_and_certificates(tmp_path):
    ca = tmp_path / "ca"
    assert run("certs", "ca", "--out", str(ca)).returncode == 0
    assert oct((ca / "ca.key").stat().st_mode & 0o777) == "0o600"
    again = run("certs", "ca", "--out", str(ca))
    assert again.returncode == 1 and "already holds a CA" in again.stderr
    done = run("certs", "issue", "--ca", str(ca), "--name", "gateway/eu", "--host", "127.0.0.1", "--host",
               "gw.example", "--out", str(tmp_path / "eu"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "eu" / "gateway-eu.pem").exists() and (tmp_path / "eu" / "gateway-eu.key").exists()
    bad = run("certs", "issue", "--ca", str(ca), "--name", "eu", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "ROLE/NAME" in bad.stderr
    missing = run("certs", "issue", "--ca", str(tmp_path / "none"), "--name", "pool/a", "--out", str(tmp_path))
    assert missing.returncode == 1 and "no CA" in missing.stderr


def test_tokens_add_list_revoke(tmp_path):
    file = tmp_path / "tokens.toml"
    added = run("tokens", "add", "--file", str(file), "--name", "eu-1", "--role", "pool", "--model", "policy")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert token.startswith("dm_") and token not in file.read_text()
    assert TokenStore(file).authenticate(token).name == "eu-1"
    listed = run("tokens", "list", "--file", str(file))
    assert "eu-1" in listed.stdout and "policy" in listed.stdout and token not in listed.stdout
    assert run("tokens", "add", "--file", str(file), "--name", "x", "--role", "root").returncode == 2
    assert run("tokens", "revoke", "--file", str(file), "--name", "eu-1").returncode == 0
    assert TokenStore(file).authenticate(token) is None
    gone = run("tokens", "revoke", "--file", str(file), "--name", "eu-1")
    assert gone.returncode == 1 and "holds no token" in gone.stderr
