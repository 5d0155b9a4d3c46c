"""A pool running a code workflow: `--workflow code` and the `[pool.sandbox]` settings from flags, and
a pool that refuses to start when bubblewrap is missing and no weaker isolation was asked for."""

from __future__ import annotations

import asyncio

import pytest

from deltamesh.config import load_config
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.cli.pool_run import overrides
from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig, WorkerConfig
from deltamesh.mesh.pool.pool import PoolError, RolloutPool
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.sandbox import SandboxConfig

BASE = ["pool", "run", "--gateway", "http://127.0.0.1:1", "--broker", "http://127.0.0.1:2",
        "--name", "p1", "--trusted-key", "k.pem", "--model", "/m"]


@pytest.fixture(autouse=True)
def _pool_token(monkeypatch):
    """The pool's token, from the environment as a real pool takes it (never on the command line)."""
    monkeypatch.setenv("DELTAMESH_TOKEN", "t")


@pytest.mark.parametrize("workflow", ["code", "tool_use", "solver_selector", "solver_testgen"])
def test_code_workflows_are_pool_options_with_sandbox_settings(workflow):
    args = build_parser().parse_args(BASE + ["--workflow", workflow, "--sandbox.workers", "4",
                                             "--sandbox.isolation", "rlimits"])
    c = load_config(PoolConfig, None, section="pool", overrides=overrides(args))
    assert c.worker.workflow == workflow and (c.sandbox.workers, c.sandbox.isolation) == (4, "rlimits")


def test_a_pool_without_bubblewrap_refuses_code_workflows_and_says_how_to_proceed(tmp_path):
    config = PoolConfig(name="p", broker="http://127.0.0.1:2", region="r", dir=str(tmp_path),
                        sync=WeightSyncSettings(gateways=["http://127.0.0.1:1"], token="t", trusted_keys=["k.pem"]),
                        models=[PolicyConfig("m", "/nonexistent")], worker=WorkerConfig(workflow="code"),
                        sandbox=SandboxConfig(bwrap="/nonexistent/bwrap"))
    with pytest.raises(PoolError, match=r"code workflow runs model-written code: bubblewrap .* not installed.*"
                                        r"'rlimits'"):
        asyncio.run(RolloutPool(config).run(asyncio.Event()))
