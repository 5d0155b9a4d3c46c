"""The pool's parts on their own: config and flags, role resolution, the lease rule, lease -> task,
the generate batcher (on a real tiny engine) and the merged engine metrics."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deltamesh.broker_client import TaskLease
from deltamesh.config import ConfigError, load_config
from deltamesh.mesh.cli import build_parser
from deltamesh.mesh.cli.pool_run import overrides
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig
from deltamesh.mesh.pool.batching import BatchingEngine
from deltamesh.mesh.pool.config import PoolConfig
from deltamesh.mesh.pool.metrics import EngineMetricsCollector, PoolMetrics
from deltamesh.mesh.pool.pool import PoolError, resolve_roles
from deltamesh.mesh.pool.staleness import lease_verdict
from deltamesh.mesh.pool.worker import task_from_lease

BASE = ["pool", "run", "--gateway", "http://127.0.0.1:1", "--broker", "http://127.0.0.1:2",
        "--name", "p1", "--trusted-key", "k.pem"]


@pytest.fixture(autouse=True)
def _pool_token(monkeypatch):
    """The pool's token, from the environment as a real pool takes it (never on the command line)."""
    monkeypatch.setenv("DELTAMESH_TOKEN", "t")


def _config(argv: list[str], path=None) -> PoolConfig:
    args = build_parser().parse_args(BASE + argv)
    return load_config(PoolConfig, path, section="pool", overrides=overrides(args))


def test_flags_make_a_single_policy_pool_and_a_file_a_multi_policy_one(tmp_path):
    c = _config(["--model", "/m", "--sampling.max-new-tokens", "16", "--worker.max-staleness", "2", "--no-hot-swap",
                 "--worker.workflow-options", '{"format_reward": 0.1}', "--tier", "big", "--sync.heartbeat-s", "0.5"])
    assert [(m.model_id, m.model_path) for m in c.models] == [("", "/m")]
    assert c.sampling.max_new_tokens == 16 and c.worker.max_staleness == 2 and c.hot_swap is False
    assert c.worker.workflow_options == {"format_reward": 0.1} and c.registration_name("x") == "p1"
    assert (c.sync.gateways, c.sync.token, c.sync.trusted_keys) == (["http://127.0.0.1:1"], "t", ["k.pem"])
    assert (c.sync.tier, c.sync.heartbeat_s) == ("big", 0.5)

    c = _config(["--model", "/m", "--model-id", "solver", "--model-id", "verifier", "--workflow", "solver_verifier"])
    assert [(m.model_id, m.model_path) for m in c.models] == [("solver", "/m"), ("verifier", "/m")]
    assert c.policy_dir("solver").name == "solver" and c.registration_name("solver") == "p1.solver"

    config = tmp_path / "pool.toml"
    config.write_text('[pool.worker]\nworkflow = "solver_verifier"\nroles = {solver = "a", verifier = "b"}\n'
                      '[[pool.models]]\nmodel_id = "a"\nmodel_path = "/a"\n'
                      '[[pool.models]]\nmodel_id = "b"\nmodel_path = "/b"\n')
    c = _config([], config)
    assert [m.model_id for m in c.models] == ["a", "b"] and c.worker.roles == {"solver": "a", "verifier": "b"}


@pytest.mark.parametrize("argv, message", [
    ([], "models must describe"),
    (["--model", "/m", "--model-id", "a", "--model-id", "a"], "distinct model_ids"),
    (["--model", "/m", "--role", "solver=zzz"], "roles name model_ids"),
    (["--model", "/m", "--worker.max-staleness", "-1"], "max_staleness"),
    (["--model", "/m", "--worker.lease-batch", "0"], "lease_batch"),
    (["--engine", "transformers", "--model-id", "a"], "needs model_path"),
    (["--model", "/m", "--listen", "nope"], "HOST:PORT"),
])
def test_bad_settings_fail_naming_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(argv)


def test_flag_pairs_that_do_not_line_up_are_refused(capsys):
    args = build_parser().parse_args(BASE + ["--model", "/a", "--model", "/b", "--model-id", "x", "--model-id", "y",
                                             "--model-id", "z"])
    with pytest.raises(ValueError, match="once per --model-id"):
        overrides(args)
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(BASE + ["--model", "/a", "--role", "solver"])
    assert refused.value.code == 2 and "wants ROLE=MODEL_ID, got 'solver'" in capsys.readouterr().err


def test_roles_resolve_by_setting_by_name_or_to_the_only_policy():
    assert resolve_roles(["policy"], ["m"], {}) == {"policy": "m"}
    assert resolve_roles(["solver", "verifier"], ["m"], {}) == {"solver": "m", "verifier": "m"}
    assert resolve_roles(["solver", "verifier"], ["solver", "verifier"], {}) == {"solver": "solver",
                                                                                  "verifier": "verifier"}
    assert resolve_roles(["solver", "verifier"], ["a", "b"], {"solver": "b", "verifier": "a"}) == {
        "solver": "b", "verifier": "a"}
    with pytest.raises(PoolError, match="role 'verifier'"):
        resolve_roles(["solver", "verifier"], ["a", "b"], {"solver": "a"})


def test_lease_rule():
    # Not serving a published version yet: no leasing, whatever the bound.
    v = lease_verdict({"a": None}, {"a": 3}, None)
    assert not v.may_lease and "waiting for a published version" in v.reason
    assert lease_verdict({"a": 3}, {"a": 7}, None).may_lease  # no bound
    v = lease_verdict({"a": 5, "b": 2}, {"a": 6, "b": 5}, 2)
    assert not v.may_lease and v.behind == {"a": 1, "b": 3} and "b: v2 is 3 versions behind v5 (bound 2)" in v.reason
    assert lease_verdict({"a": 5, "b": 3}, {"a": 6, "b": 5}, 2).may_lease
    assert lease_verdict({"a": 5}, {"a": None}, 0).may_lease  # nothing known newer
    assert lease_verdict({"a": 9}, {"a": 5}, 0).behind == {"a": 0}


def test_a_lease_becomes_a_workflow_task():
    lease = TaskLease(lease_id="L7", group_id="L7", task_id="t1", epoch=0, prompt=[{"role": "user", "content": "hi"}],
                      metadata={"answer": "4"}, n_samples=3, model_ids=["m"], deadline=0.0)
    task = task_from_lease(lease)
    assert (task.task_id, task.group_id, task.n_samples, task.answer, task.model_ids) == ("t1", "L7", 3, "4", ("m",))
    assert task.prompt == '[{"role": "user", "content": "hi"}]'
    # A dataset line that nests its fields under "metadata" (as digit_sum_tasks writes them).
    nested = TaskLease(lease_id="L8", group_id="L8", task_id="t2", epoch=0, prompt="1+1=",
                       metadata={"metadata": {"answer": "2"}, "source": "x"}, n_samples=1, model_ids=[], deadline=0.0)
    assert dict(task_from_lease(nested).metadata) == {"answer": "2", "source": "x"}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return TransformersEngine(TransformersEngineConfig(model_id="tiny", model_dir=str(tiny_dir)))


def test_concurrent_generate_calls_share_one_engine_batch(engine):
    greedy = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    prompts = [[engine.encode("1+2=")] * 2, [engine.encode("a longer prompt, 3+4=")], [engine.encode("x")] * 3]

    async def main():
        alone = [await engine.generate(p, greedy) for p in prompts]
        async with BatchingEngine(engine, max_prompts=64, window_s=0.01) as batched:
            together = await asyncio.gather(*(batched.generate(p, greedy) for p in prompts))
            assert batched.batches == 1
            # A call with its own seed must stay reproducible: it runs alone.
            seeded = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)
            a, b = await asyncio.gather(batched.generate(prompts[0], seeded), batched.generate(prompts[0], seeded))
            assert batched.batches == 3 and [g.tokens for g in a] == [g.tokens for g in b]
        return alone, together

    alone, together = asyncio.run(main())
    assert [[g.tokens for g in gens] for gens in alone] == [[g.tokens for g in gens] for gens in together]
    assert [len(gens) for gens in together] == [2, 1, 3]


def test_a_bad_prompt_fails_only_its_own_call(engine):
    params = SamplingParams(max_new_tokens=3, temperature=0)

    async def main():
        async with BatchingEngine(engine, window_s=0.01) as batched:
            return await asyncio.gather(batched.generate([engine.encode("ok")], params),
                                        batched.generate([[10 ** 9]], params), return_exceptions=True)

    good, bad = asyncio.run(main())
    assert len(good) == 1 and len(good[0].tokens) == 3
    assert isinstance(bad, ValueError) and "out of range" in str(bad)


def test_engine_metrics_of_several_policies_merge_into_the_pool_registry():
    pool_registry = CollectorRegistry()
    PoolMetrics(pool_registry)
    engines = [EngineMetrics(m, "transformers", CollectorRegistry()) for m in ("solver", "verifier")]
    for i, m in enumerate(engines):
        m.tokens.inc(10 * (i + 1))
    pool_registry.register(EngineMetricsCollector([m.registry for m in engines]))
    text = generate_latest(pool_registry).decode()
    assert text.count("# TYPE deltamesh_engine_generated_tokens_total counter") == 1
    assert 'deltamesh_engine_generated_tokens_total{engine="transformers",model="solver"} 10.0' in text
    assert 'deltamesh_engine_generated_tokens_total{engine="transformers",model="verifier"} 20.0' in text
    assert "deltamesh_pool_leasing" in text


def test_cli_registers_pool_run():
    args = build_parser().parse_args(BASE + ["--model", "/m"])
    assert isinstance(args, argparse.Namespace) and args.run.__module__ == "deltamesh.mesh.cli.pool_run"


def test_pool_run_refuses_bad_settings_with_exit_code_2(caplog):
    def run(argv: list[str]) -> int:
        args = build_parser().parse_args(BASE + argv)
        return args.run(args)

    assert run(["--worker.lease-batch", "0", "--model", "/m"]) == 2
    assert "lease_batch" in caplog.text
    # Two policies, and the workflow's verifier role is played by neither: refused before any engine loads.
    assert run(["--model", "/m", "--model-id", "a", "--model-id", "b", "--workflow", "solver_verifier",
                "--region", "r", "--role", "solver=a"]) == 2
    assert "no policy plays role 'verifier'" in caplog.text
