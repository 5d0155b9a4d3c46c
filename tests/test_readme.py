"""The meshes of README.md and docs/SECURITY.md, run as written. The README's: keys, a CA and
certificates, tokens, a TLS origin and a TLS relay pulling from it with a gateway token, a publish with
the trainer's token, a pool syncing through the relay bit-exact, the admin's tables and a TLS broker.
SECURITY.md's: three regions, mTLS between gateways and for the trainer, a pool two relay hops away.
The lines use fixed ports, so each runs in a network namespace of its own, where nothing else listens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deltamesh.delta import read_weights, write_weights

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.netns]



def doc_lines(doc: str) -> list[str]:
    """The lines of the one bash block of `doc` that sets up a mesh."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
                if "deltamesh certs" in b]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("doc, pool_dir, admin_table", [("README.md", "pool-eu-1", "eu-1"),
                                                         ("docs/SECURITY.md", "pool-ap-1", None)])
def test_the_documented_mesh_runs_as_written(tmp_path, run_documented_lines, doc, pool_dir, admin_table):
    gen = torch.Generator().manual_seed(3)
    weights = {"layer.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
               "layer.bias": torch.randn(64, generator=gen).to(torch.bfloat16)}
    write_weights(tmp_path / "weights", weights)
    ran = run_documented_lines(doc_lines(doc), tmp_path)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    synced = read_weights(tmp_path / pool_dir)
    assert all(torch.equal(synced[name].view(torch.int16), w.view(torch.int16)) for name, w in weights.items())
    if admin_table is not None:
        assert admin_table in ran.stdout  # the admin's pools table lists the pool
    for secret in tmp_path.glob("*.token"):
        assert secret.read_text().strip() not in (tmp_path / "tokens.toml").read_text()
