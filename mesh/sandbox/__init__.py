"""The sandbox: runs model-written Python against tests in an isolated process (bubblewrap), with
rlimits, a wall clock and capped output, and one outcome per test (docs/SANDBOX.md)."""

from deltamesh.mesh.sandbox.config import SandboxConfig
from deltamesh.mesh.sandbox.results import ExecutionResult, Outcome, SandboxError, SandboxUnavailable, TestResult
from deltamesh.mesh.sandbox.sandbox import Sandbox

__all__ = ["ExecutionResult", "Outcome", "Sandbox", "SandboxConfig", "SandboxError", "SandboxUnavailable",
           "TestResult"]
