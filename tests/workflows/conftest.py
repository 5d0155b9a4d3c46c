"""Fixtures of the workflow tests: tiny random-init models served by real in-process engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Two different tiny models (character tokenizer), one per policy."""
    root = tmp_path_factory.mktemp("workflow-models")
    return {name: tiny_model_dir(TinyModelConfig(seed=seed), path=root / name)
            for name, seed in (("solver", 11), ("verifier", 12))}


@pytest.fixture
def engines(tiny_dirs) -> dict[str, TransformersEngine]:
    return {name: TransformersEngine(TransformersEngineConfig(model_id=name, model_dir=str(path), seed=0))
            for name, path in tiny_dirs.items()}


@pytest.fixture
def sandbox():
    """A bwrap sandbox with short limits: the code workflows' programs are a line or two."""
    from deltamesh.mesh.sandbox import Sandbox, SandboxConfig

    return Sandbox(SandboxConfig(test_timeout_s=1.0, timeout_s=10.0, workers=2))


@pytest.fixture
def run():
    """Runs coroutines on one event loop for the whole test: a sandbox's worker slots belong to the
    loop they were first waited for in, so one sandbox must not move between `asyncio.run` calls."""
    import asyncio

    with asyncio.Runner() as runner:
        yield runner.run
