"""The sandbox's settings: validated, a missing bubblewrap refuses to run code, and the weaker mode
runs only when configured and says so."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deltamesh.mesh.sandbox import Outcome, Sandbox, SandboxConfig, SandboxError, SandboxUnavailable


@pytest.mark.parametrize("bad", [dict(isolation="none"), dict(uid=0), dict(gid=0), dict(workers=0),
                                 dict(timeout_s=1.0, test_timeout_s=2.0), dict(processes=1),
                                 dict(memory_bytes=-1), dict(python="python3")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SandboxConfig(**bad)


def test_without_bubblewrap_code_is_refused_and_the_weaker_mode_is_named():
    with pytest.raises(SandboxUnavailable, match="refusing to run model-written code.*'rlimits'"):
        Sandbox(SandboxConfig(bwrap="/nonexistent/bwrap"))


def test_the_weaker_mode_runs_only_when_configured_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="deltamesh.mesh.sandbox"):
        sandbox = Sandbox(SandboxConfig(isolation="rlimits", bwrap="/nonexistent/bwrap", test_timeout_s=1.0))
    assert "without namespaces" in caplog.text
    result = asyncio.run(sandbox.run("def f():\n    return 1\n", ["assert f() == 1", "assert f() == 2",
                                                                 "import time\ntime.sleep(5)"]))
    assert [t.outcome for t in result.tests] == [Outcome.PASSED, Outcome.FAILED, Outcome.TIMEOUT]


def test_an_unusable_interpreter_is_a_sandbox_error_not_an_outcome(bwrap_ok):
    with pytest.raises(SandboxError, match="does not run"):
        Sandbox(SandboxConfig(python="/nonexistent/python3"))


def test_oversized_sources_are_refused_before_anything_runs(bwrap_ok):
    sandbox = Sandbox(SandboxConfig(max_source_bytes=100))
    with pytest.raises(ValueError, match="max_source_bytes"):
        asyncio.run(sandbox.run("x = 1\n" * 50, ["pass"]))
    assert asyncio.run(sandbox.run("x = 1", [])).tests == ()
