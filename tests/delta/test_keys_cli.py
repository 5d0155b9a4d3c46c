"""`deltamesh keys generate`: writes a usable key pair and never overwrites one by accident."""

from __future__ import annotations

import os
import subprocess
import sys

from deltamesh.delta import generate_key, key_id, load_manifest, load_private_key, load_public_key
from deltamesh.delta.manifest import Manifest


def _deltamesh(*args: str) -> subprocess.CompletedProcess:
    cli = os.path.join(os.path.dirname(sys.executable), "deltamesh")
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)


def test_generate_writes_a_working_pair_and_refuses_to_overwrite(tmp_path, capfd):
    out = tmp_path / "keys" / "trainer"
    done = _deltamesh("keys", "generate", "--out", str(out))
    assert done.returncode == 0, done.stderr
    private, public = load_private_key(out), load_public_key(out.with_name("trainer.pub"))
    assert key_id(private) == key_id(public) and key_id(private) in done.stdout
    assert (out.stat().st_mode & 0o777) == 0o600
    manifest = Manifest(model_id="m", version=0, base_version=None, kind="full", codec="x", tensors=(), pieces=())
    assert load_manifest(manifest.signed(private), [public]) == manifest

    # The rest in-process (same entry point), to spare the suite two interpreter start-ups.
    from deltamesh.mesh.cli import main

    assert main(["keys", "generate", "--out", str(out)]) == 1
    assert "already exists" in capfd.readouterr().err
    assert key_id(load_private_key(out)) == key_id(private)
    assert main(["keys", "generate", "--out", str(out), "--force"]) == 0
    assert key_id(load_private_key(out)) != key_id(private)
    assert key_id(generate_key()) != key_id(private)
