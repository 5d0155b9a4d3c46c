"""Two gloo ranks under torchrun with FSDP2 against the single-process trainer, bit for bit.

One torchrun run (see fsdp_worker.fsdp_scenario) covers: training from scratch on the same batches
as the single-process reference, gathering the published bf16 weights and fp32 master weights to
rank 0, saving a checkpoint from sharded state, and resuming sharded state from a single-process
checkpoint. The reference runs in this process with micro-batches of half the batch, which is
exactly the share each rank trains on, so the summation order of every gradient is the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from deltamesh.trainer.checkpoint import load_checkpoint
from deltamesh.trainer.step import TrainState, build_optimizer

WORKER = Path(__file__).with_name("fsdp_worker.py")
TOTAL, CHECKPOINT_AT = 5, 3


def _run_torchrun(out: Path, resume_root: Path, timeout: float = 240.0) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER), str(out),
        "--resume-root", str(resume_root), "--total", str(TOTAL), "--checkpoint-at", str(CHECKPOINT_AT),
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")[-6000:]


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.slow
def test_two_fsdp_ranks_publish_the_single_process_weights(tiny, tmp_path: Path):
    single_ckpt = tmp_path / "single"
    published, master, optim = tiny.single_reference(TOTAL, str(single_ckpt), CHECKPOINT_AT)
    out = tmp_path / "fsdp"
    out.mkdir()
    _run_torchrun(out, single_ckpt)

    # Trained from scratch on two ranks: the same bf16 weights, and the same fp32 master weights.
    _assert_bit_identical(load_file(out / f"published-v{CHECKPOINT_AT}.safetensors"), published[CHECKPOINT_AT])
    _assert_bit_identical(load_file(out / f"master-v{CHECKPOINT_AT}.safetensors"), master[CHECKPOINT_AT])
    assert all(t.dtype == torch.bfloat16 for t in published[CHECKPOINT_AT].values())
    # Resumed on two ranks from the single-process checkpoint and trained on: the same again.
    assert (out / "resumed_at").read_text() == str(CHECKPOINT_AT)
    _assert_bit_identical(load_file(out / f"published-v{TOTAL}.safetensors"), published[TOTAL])

    # The checkpoint the sharded ranks wrote restores the single-process state exactly.
    model = tiny.tiny_model(seed=5)
    state = TrainState(model, build_optimizer(model, tiny.trainer_config().optim))
    load_checkpoint(out / "ckpt" / f"v{CHECKPOINT_AT:010d}", state)
    assert (state.version, state.step) == (CHECKPOINT_AT, CHECKPOINT_AT)
    restored = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _assert_bit_identical(restored, master[CHECKPOINT_AT])
    osd = get_optimizer_state_dict(model, state.optimizer, options=StateDictOptions(full_state_dict=True))
    assert osd["state"].keys() == optim[CHECKPOINT_AT].keys()
    for param, entries in optim[CHECKPOINT_AT].items():
        for key, value in entries.items():
            assert torch.equal(osd["state"][param][key], value), (param, key)
