"""Trainer test fixtures: the helper modules of this folder (loaded by path: torchrun runs fsdp_worker.py
as a script, and test modules cannot import a conftest or each other) and a trainer key."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deltamesh.delta import generate_key, save_keypair


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deltamesh_trainer_test_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny() -> ModuleType:
    """The helpers of fsdp_worker.py: tiny_model, fixed_batches, trainer_config, single_reference."""
    return _load("fsdp_worker")


@pytest.fixture(scope="session")
def mesh() -> ModuleType:
    """The helpers of loop_mesh.py: a mesh of real processes (`Mesh`), trajectories for it, and reading
    what the broker and the gateway report."""
    return _load("loop_mesh")


@pytest.fixture
def key_files(tmp_path: Path):
    """A fresh trainer key: (private key, its file, the public key's file)."""
    key = generate_key()
    public = save_keypair(key, tmp_path / "trainer.key")
    return key, tmp_path / "trainer.key", public


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run best on one thread on this shared machine (and torchrun ranks use one too)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
