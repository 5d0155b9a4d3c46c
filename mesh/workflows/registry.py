"""The workflow registry: shipped workflows by name, and `make_workflow` to bind one to its options.

`make_workflow("math", {"format_reward": 0.1})` checks the options against the workflow's config
dataclass (through the one config loader, so a misspelt option is an error). A name of the form
"package.module:NAME" loads the `WorkflowSpec` called NAME from any importable module, for
workflows of one's own (the shipped ones are `...verifiable_math:MATH`,
`...solver_verifier:SOLVER_VERIFIER`, `...code:CODE`, `...tool_use:TOOL_USE`,
`...solver_selector:SOLVER_SELECTOR` and `...solver_testgen:SOLVER_TESTGEN`).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any, Mapping

from deltamesh.config import ConfigError, from_dict
from deltamesh.mesh.workflows.base import Workflow, WorkflowError, WorkflowSpec
from deltamesh.mesh.workflows.code import CODE
from deltamesh.mesh.workflows.solver_selector import SOLVER_SELECTOR
from deltamesh.mesh.workflows.solver_testgen import SOLVER_TESTGEN
from deltamesh.mesh.workflows.solver_verifier import SOLVER_VERIFIER
from deltamesh.mesh.workflows.tool_use import TOOL_USE
from deltamesh.mesh.workflows.verifiable_math import MATH

WORKFLOWS: Mapping[str, WorkflowSpec] = MappingProxyType(
    {spec.name: spec for spec in (MATH, SOLVER_VERIFIER, CODE, TOOL_USE, SOLVER_SELECTOR, SOLVER_TESTGEN)})


def get_spec(name: str) -> WorkflowSpec:
    if name in WORKFLOWS:
        return WORKFLOWS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            spec = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise WorkflowError(f"cannot load workflow {name!r}: {e}") from e
        if not isinstance(spec, WorkflowSpec):
            raise WorkflowError(f"{name!r} is a {type(spec).__name__}, not a WorkflowSpec")
        return spec
    raise WorkflowError(f"unknown workflow {name!r}; known: {sorted(WORKFLOWS)} (or module:SPEC)")


def make_workflow(name: str, options: Mapping[str, Any] | None = None) -> Workflow:
    spec = get_spec(name)
    try:
        config = from_dict(spec.config_type, dict(options or {}), where=f"workflow {spec.name}")
    except ConfigError as e:
        raise WorkflowError(str(e)) from e
    return Workflow(spec, config)
