"""`deltamesh demo` keeps its tokens where only their owner reads them: the mesh's services as the demo
starts them (real processes, with TLS and a token per caller), whose command lines, as `ps` shows
them to every user of the host, hold no token; the config files and token files they read are mode
0600 and the config files hold no token either. The relays authenticate to their upstreams with
their token files (their announcement is taken), so the tokens did reach the services.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import aiohttp
import pytest

from deltamesh.http import bearer, client_session, request_json
from deltamesh.mesh.demo.config import DemoConfig, DemoEvalConfig
from deltamesh.mesh.demo.launch import prepare, start
from deltamesh.mesh.demo.processes import ServiceSet

pytestmark = pytest.mark.slow


def command_line(pid: int) -> str:
    """What `ps` shows every user of the host for `pid`."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_demo_puts_no_token_on_a_command_line_or_in_a_readable_file(tmp_path):
    # With the evaluator too: it follows its gateway with a pool token of its own name.
    config = DemoConfig(steps=1, run_dir=str(tmp_path / "run"), tasks="arithmetic", eval=DemoEvalConfig(every=2))
    plan = prepare(config, tmp_path / "run")
    assert plan.creds is not None  # TLS and tokens: the demo's default
    tokens = list(plan.creds.tokens.values())
    services = ServiceSet()

    async def scenario() -> list[tuple[str, str]]:
        try:
            start(plan, services)
            lines = [(s.name, command_line(s.pid)) for s in services.services]
            gateways = list(plan.gateways.values())
            async with client_session(tls=plan.creds.client_tls()) as session:
                assert await services.wait_healthy(session, gateways, 120, asyncio.Event())
                origin = plan.gateways[plan.config.topology.origin.region]
                relays = {spec.region for spec in plan.config.topology.gateways if spec.upstream}
                announced: set[str] = set()
                for _ in range(100):  # each relay announces itself to its upstream with its token file
                    for gw in gateways:
                        links = await request_json(session, "GET", f"{gw.url}/v1/links",
                                                   headers=bearer(plan.token("admin")))
                        announced |= {link["peer"] for link in links["links"] if link["role"] == "downstream"}
                    if relays <= announced:
                        break
                    await asyncio.sleep(0.2)
                assert relays <= announced, announced
                assert origin.running()
            services.check()  # every service took its token flags (a refused flag exits at once)
            return lines
        finally:
            await services.stop(grace_s=5)

    try:
        lines = asyncio.run(scenario())
    except aiohttp.ClientError as e:
        pytest.fail(f"the demo's gateways did not answer: {e}")
    assert {name for name, _ in lines} >= {"broker", "trainer-policy", "eval"} and len(lines) >= 7
    for name, line in lines:
        assert not any(token in line for token in tokens), f"{name} shows a token in ps: {line}"
        assert " --token " not in f"{line} " and "-token " not in line.replace("-token-file ", ""), line
    for toml in (plan.run_dir / "pools").glob("*.toml"):
        assert private(toml) and not any(token in toml.read_text() for token in tokens), toml
    for toml in [*(plan.run_dir / "trainer").glob("*.toml"), plan.run_dir / "broker" / "broker.toml",
                 plan.run_dir / "eval" / "eval.toml"]:
        assert private(toml) and not any(token in toml.read_text() for token in tokens), toml
    files = list(plan.creds.token_files.values())
    assert len(files) == len(tokens) and all(private(f) for f in files)
    assert sorted(f.read_text().strip() for f in files) == sorted(tokens)
    assert os.stat(plan.creds.token_files["admin"].parent).st_mode & 0o077 == 0
