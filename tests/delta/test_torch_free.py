"""A gateway host has no torch: what `deltamesh gateway` imports (its command line, the server, and
the codec's manifest, hashing, key, statement and piece layers) loads no torch, transformers or
matplotlib. Checked in a fresh interpreter, since this one has long imported them."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "matplotlib")

PROBE = """
import json, sys
from deltamesh.mesh.cli import build_parser
build_parser(lazy=True).parse_args(["gateway", "--anonymous"])
import deltamesh.gateway.server.app, deltamesh.gateway.server.relay
from deltamesh.delta import load_manifest, digest, load_public_key, load_statement
import deltamesh.delta.piece
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
"""


def test_the_gateway_and_the_codec_layers_it_uses_import_no_torch():
    out = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_the_codec_package_still_offers_every_name_it_lists():
    import deltamesh.delta as delta

    assert all(getattr(delta, name) is not None for name in delta.__all__)


def test_no_public_name_of_the_codec_is_also_a_module_of_it():
    """Loading a submodule binds it on the package under its own name, so a module named like one of
    the package's functions (once `apply`) would hide that function: no name may be both."""
    from pathlib import Path

    import deltamesh.delta as delta

    modules = {p.stem for p in Path(delta.__file__).parent.glob("*.py")}
    assert modules & set(delta.__all__) == set()
