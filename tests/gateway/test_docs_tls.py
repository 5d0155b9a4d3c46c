"""docs/api/gateway.md, "TLS and tokens", run as written: its Python makes the CA, certificates and tokens, its
TOML is the origin's config file, and its commands start an mTLS origin and a TLS relay, publish with a
trainer certificate and read pools and links as an admin. The commands use fixed ports, so they run in
a network namespace of their own, where nothing else listens."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.delta import write_weights

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api" / "gateway.md"
VENV_BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.netns]

RELAY_HOLDS = """import json, ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile="pki/ca.pem")
req = urllib.request.Request("https://localhost:8701/v1/models/policy/head?after=-1&wait=30",
                             headers={"Authorization": "Bearer " + open("pool.token").read().strip()})
head = json.load(urllib.request.urlopen(req, context=ctx, timeout=60))["head"]
sys.exit(0 if head == 0 else f"relay head {head}")
"""


def section() -> str:
    text = DOC.read_text()
    start = text.index("## TLS and tokens")
    return text[start:text.index("\n## ", start + 1)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_tls_and_tokens_section_runs_as_written(kit, tmp_path, run_documented_lines):
    work = tmp_path / "mesh"  # tmp_path holds the kit's own trainer key
    work.mkdir()
    text = section()
    (python,) = blocks(text, "python")
    (toml,) = blocks(text, "toml")
    (bash,) = blocks(text, "bash")
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "DELTAMESH_LOG": "WARNING"}
    made = subprocess.run([sys.executable, "-c", python], cwd=work, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    name = toml.splitlines()[0].removeprefix("# ").strip()
    (work / name).write_text(toml)
    write_weights(work / "weights", kit.tiny_weights())

    lines = [line for line in bash.splitlines() if line.strip()]
    ran = run_documented_lines(lines, work, env, after=[f"python -c {shlex.quote(RELAY_HOLDS)}"],
                               ports=re.findall(r"127\.0\.0\.1:(\d+)", text))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "published policy v0: full" in ran.stdout
    assert "pools of region eu-1" in ran.stdout and "links of region origin" in ran.stdout
    assert "eu-1" in ran.stdout.split("links of region origin")[1]  # the relay announced itself with its cert
