"""The topology config: the demo's embedded default, a TOML file, and every way a topology can be wrong."""

from __future__ import annotations

import pytest

from deltamesh.config import ConfigError, from_dict, load_config
from deltamesh.gateway.config import GatewayConfig
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.topology import Topology, default_topology, load_topology


def test_the_default_is_an_origin_and_two_remote_regions_one_relaying_through_the_other():
    topo = default_topology()
    assert topo.origin.region == "us-east" and not topo.origin.upstream
    assert [g.link for g in topo.relays()] == ["us-east->eu-west", "eu-west->ap-south"]
    assert all(g.bandwidth_mbps > 0 and g.delay_ms > 0 for g in topo.relays())
    assert [topo.hops(p.region) for p in topo.pools] == [0, 1, 2]
    assert [p.name for p in topo.with_pools(2).pools] == ["us-1", "eu-1"]


def test_a_topology_file_is_read_and_checked(tmp_path):
    path = tmp_path / "mesh.toml"
    path.write_text('[[topology.gateways]]\nregion = "a"\n[[topology.gateways]]\nregion = "b"\nupstream = "a"\n'
                    'delay_ms = 5\n[[topology.pools]]\nname = "b-1"\nregion = "b"\n')
    topo = load_topology(path)
    assert topo.hops("b") == 1 and topo.gateway("b").delay_ms == 5.0
    path.write_text('[[topology.gateways]]\nregion = "a"\nlatency = 3\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_topology(path)


@pytest.mark.parametrize("table, message", [
    ({"gateways": []}, "at least one gateway"),
    ({"gateways": [{"region": "a", "upstream": "b"}, {"region": "b"}]}, "first gateway must be the origin"),
    ({"gateways": [{"region": "a"}, {"region": "b", "upstream": "c"}]}, "must be listed before"),
    ({"gateways": [{"region": "a"}, {"region": "a", "upstream": "a"}]}, "listed twice"),
    ({"gateways": [{"region": "a"}, {"region": "b"}]}, "only the first gateway may be an origin"),
    ({"gateways": [{"region": "a", "delay_ms": 10}]}, "no upstream"),
    ({"gateways": [{"region": "a"}], "pools": [{"name": "p", "region": "z"}]}, "unknown region"),
    ({"gateways": [{"region": "a"}], "pools": [{"name": "p", "region": "a"}] * 2}, "distinct"),
    ({"gateways": [{"region": "a/b"}]}, "must match"),
])
def test_bad_topologies_are_refused_with_the_reason(table, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Topology, table, where="topology")


def test_demo_config_fills_the_model_recipe_and_checks_its_values():
    tiny = DemoConfig()
    assert (tiny.lr, tiny.max_new_tokens, tiny.batch_size) == (5e-3, 1, 32)
    assert tiny.buffered_groups == 2 * tiny.groups_per_step
    assert tiny.tasks == "digit_sum" and tiny.eval.every == 0  # digit sums have no held-out set
    real = DemoConfig(model="smollm2", steps=10)
    assert real.lr == 2e-5 and real.max_new_tokens == 6
    assert real.tasks == "arithmetic" and real.eval.every == 5 and real.math_options()["answer"] == "first_number"
    assert DemoConfig(max_staleness=0).buffered_groups == tiny.groups_per_step  # sync: one step's groups
    two = DemoConfig(workflow="solver_verifier")
    assert two.model_ids == ("solver", "verifier") and two.max_new_tokens >= 2
    assert [p.name for p in DemoConfig(pools=1).topology.pools] == ["us-1"]
    for bad in ({"steps": 0}, {"model": "gpt"}, {"pools": 9}, {"max_digit": 5}, {"format_reward": 1.0},
                {"tasks": "sums"}, {"levels": [6]}, {"max_staleness": -1}, {"loss": "ppo"},
                {"eval": {"every": 2}},  # digit sums: no held-out set to score
                {"tasks": "arithmetic", "eval": {"every": 2, "region": "mars"}},
                {"workflow": "code", "code_tasks": "humaneval", "eval": {"every": 2}}):  # trains on its held-out set
        with pytest.raises((ConfigError, ValueError)):
            from_dict(DemoConfig, bad)


def test_a_gateway_link_delay_must_be_sane(tmp_path):
    key = str(tmp_path / "trainer.key.pub")
    assert GatewayConfig(trusted_keys=[key], upstreams=["http://a"], link_delay_ms=80).link_delay_ms == 80
    for bad in (-1.0, 60_001.0):
        with pytest.raises(ValueError, match="link_delay_ms"):
            GatewayConfig(trusted_keys=[key], link_delay_ms=bad)


def test_the_code_workflows_take_their_recipe_tasks_and_sandbox_from_the_demo_config():
    from deltamesh.mesh.cli import build_parser
    from deltamesh.mesh.cli.demo import overrides

    args = build_parser().parse_args(["demo", "--workflow", "solver_testgen", "--code-tasks", "humaneval",
                                      "--sandbox.workers", "3"])
    c = load_config(DemoConfig, None, section="demo", overrides=overrides(args))
    assert c.model_ids == ("solver", "testgen") and c.needs_sandbox and c.code_tasks == "humaneval"
    assert c.sandbox.workers == 3
    assert c.max_new_tokens > 1 and c.workflow_options()["max_feedback_chars"] < 1000  # the tiny model's context
    assert DemoConfig(workflow="solver_selector").model_ids == ("solver", "selector")
    assert not DemoConfig(workflow="solver_verifier").needs_sandbox
