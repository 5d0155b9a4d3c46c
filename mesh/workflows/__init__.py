"""Rollout workflows: episode functions that call one or more models' engines and return trajectories
with rewards, kept in a registry by name (`math`, `solver_verifier`, `code`,
`tool_use` (multi-turn), `solver_selector`, `solver_testgen`; see `registry.make_workflow`)."""

from deltamesh.mesh.workflows.base import EpisodeContext, Task, Workflow, WorkflowError, WorkflowSpec
from deltamesh.mesh.workflows.registry import WORKFLOWS, get_spec, make_workflow

__all__ = ["WORKFLOWS", "EpisodeContext", "Task", "Workflow", "WorkflowError", "WorkflowSpec", "get_spec",
           "make_workflow"]
