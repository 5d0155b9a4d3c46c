"""Hostile programs in the bwrap sandbox: each is contained, reported as the right outcome, and the
same sandbox serves a normal program right after it."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Callable, Sequence

import pytest

from deltamesh.mesh.sandbox import ExecutionResult, Outcome, Sandbox

GOOD = ("def f():\n    return 42\n", ["assert f() == 42"])


@pytest.fixture
def contained(sandbox: Sandbox, run_jobs) -> Callable[..., ExecutionResult]:
    """Run a hostile program, then a good one after it on the same sandbox; return the first's result."""

    def run(program: str, tests: Sequence[str] = ("pass",)) -> ExecutionResult:
        hostile, good = run_jobs(sandbox, [(program, list(tests))]) + run_jobs(sandbox, [GOOD])
        assert good.passed, good
        return hostile

    return run


def outcomes(result: ExecutionResult) -> list[Outcome]:
    return [t.outcome for t in result.tests]


def test_an_infinite_loop_is_a_timeout_and_the_next_test_still_runs(contained):
    result = contained("def spin():\n    while True:\n        pass\n", ["spin()", "assert 1 + 1 == 2"])
    assert outcomes(result) == [Outcome.TIMEOUT, Outcome.PASSED]


def test_a_fork_bomb_hits_the_process_limit(contained):
    result = contained("import os\nwhile True:\n    os.fork()\n")
    assert outcomes(result) == [Outcome.RESOURCE_LIMIT]


@pytest.mark.slow
def test_a_fork_bomb_that_swallows_errors_is_killed_with_its_group(contained):
    bomb = "import os\ndef bomb():\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n"
    result = contained(bomb, ["bomb()", "assert True"])
    # The first test forks until its deadline; its leftovers are killed before the second one runs.
    assert outcomes(result) == [Outcome.TIMEOUT, Outcome.PASSED]


def test_a_memory_bomb_hits_the_memory_limit(contained):
    result = contained("", ["x = bytearray(1 << 34)",
                                     "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))"])
    assert outcomes(result) == [Outcome.RESOURCE_LIMIT, Outcome.RESOURCE_LIMIT]


def test_writing_outside_the_scratch_dir_fails_and_the_scratch_dir_is_private(contained, tmp_path):
    outside, marker = tmp_path / "pwned", f"/tmp/deltamesh-sandbox-{uuid.uuid4().hex}"
    result = contained("", [f"open({str(outside)!r}, 'w').write('x')",
                                     "open('/usr/lib/pwned', 'w').write('x')",
                                     f"open({marker!r}, 'w').write('x')\nassert open({marker!r}).read() == 'x'"])
    assert outcomes(result) == [Outcome.ERROR, Outcome.ERROR, Outcome.PASSED]
    assert not outside.exists() and not Path("/usr/lib/pwned").exists() and not Path(marker).exists()


@pytest.fixture
def secrets_outside(tmp_path):
    """A token beside the test (world-readable: only the namespace hides it) and a key under /root."""
    token = tmp_path / "pool.token"
    token.write_text("TOKEN-" + uuid.uuid4().hex)
    token.chmod(0o644)
    files = [token]
    if os.geteuid() == 0:
        key = Path("/root") / f".deltamesh-sandbox-test-{uuid.uuid4().hex}.key"
        key.write_text("KEY-" + uuid.uuid4().hex)
        files.append(key)
    yield files
    for path in files[1:]:
        path.unlink(missing_ok=True)


def test_the_pools_token_and_key_files_are_not_readable(contained, secrets_outside):
    tests = [f"print(open({str(path)!r}).read())" for path in secrets_outside]
    tests.append("import os\nprint(os.listdir('/'))\nassert not os.path.exists('/root')")
    result = contained("", tests)
    assert outcomes(result) == [Outcome.ERROR] * len(secrets_outside) + [Outcome.PASSED]
    for path, test in zip(secrets_outside, result.tests):
        assert "FileNotFoundError" in test.stderr and path.read_text() not in test.stderr


def test_a_socket_to_a_listening_loopback_server_does_not_connect(contained):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        result = contained("import socket\n",
                           [f"socket.create_connection(('127.0.0.1', {port}), timeout=0.5)",
                            f"socket.create_connection(('localhost', {port}), timeout=0.5)"])
        assert outcomes(result) == [Outcome.ERROR, Outcome.ERROR]
        assert "ConnectionRefusedError" in result.tests[0].stderr
        with pytest.raises(TimeoutError):
            server.accept()


def test_huge_output_is_capped(contained, sandbox):
    cap = sandbox.config.output_bytes
    result = contained("", ["print('y' * 100_000)\nprint('the end')", "while True:\n    print('x' * 4096)"])
    assert outcomes(result) == [Outcome.PASSED, Outcome.RESOURCE_LIMIT]  # the file-size limit ends the flood
    for test in result.tests:
        assert len(test.stderr) < cap + 200
    assert result.tests[0].stderr.startswith("[... ") and result.tests[0].stderr.endswith("the end\n")


def test_killing_the_parent_or_everything_leaves_the_pool_serving(contained):
    me = os.getpid()
    result = contained("import os, signal\n",
                       [f"os.kill({me}, signal.SIGKILL)", "os.kill(1, signal.SIGKILL)\nassert True",
                        "os.kill(os.getppid(), signal.SIGKILL)", "assert True"])
    # The pool's pid is not in the sandbox's PID namespace; its init ignores the signal; the runner
    # dies, and the test after it is an error too.
    assert outcomes(result) == [Outcome.ERROR, Outcome.PASSED, Outcome.ERROR, Outcome.ERROR]
    assert "ProcessLookupError" in result.tests[0].stderr
    assert "test runner ended" in result.tests[3].stderr


def test_deleting_files_touches_nothing_of_the_host(contained, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("still here")
    victim.chmod(0o666)
    result = contained("import os, shutil, sys\n",
                       [f"os.remove({str(victim)!r})", "shutil.rmtree(os.path.dirname(os.__file__))",
                        "os.remove(sys.executable)"])
    assert outcomes(result) == [Outcome.ERROR] * 3
    assert victim.read_text() == "still here"
