"""`RankGroup.gather`, how the backend's tensor-parallel ranks agree: JSON all-gathers over a real gloo group.

Two processes join a gloo group on loopback (as vLLM's tensor-parallel CPU group is one) and gather
values of different lengths, unicode included; every rank gets every rank's value in rank order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deltamesh.mesh.demo.processes import free_port

RANK = """
import json, os, sys
import torch.distributed as dist
from deltamesh.mesh.vllm_plugin.rank_updates import RankGroup
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = RankGroup(dist.group.WORLD, rank, 2)
first = group.gather({"rank": rank, "error": "é" * (1 + 50 * rank)})
second = group.gather([] if rank else {"steps": [1, 2]})
print(json.dumps([first, second]), flush=True)
dist.barrier()
# Leave without gloo's teardown: one rank's destructors racing the other's exit abort it now and then
# ("terminate called without an active exception"), which is the test's process, not what it checks.
os._exit(0)
"""


def test_every_rank_gets_every_rank_value_in_order(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    expected = [[{"rank": 0, "error": "é"}, {"rank": 1, "error": "é" * 51}], [{"steps": [1, 2]}, []]]
    assert [json.loads(out.strip().splitlines()[-1]) for out, _ in outs] == [expected, expected]
