"""Trainer test fixtures: the shared tiny-model helpers (loaded by path, as torchrun runs them too) and a trainer key."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from deltamesh.delta import generate_key, save_keypair

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deltamesh_trainer_test_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny() -> ModuleType:
    """The helpers of fsdp_worker.py: tiny_model, fixed_batches, trainer_config, single_reference."""
    return _load_worker()


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
