"""What a workflow is: an episode function that turns one rollout task into trajectories with rewards.

A `Task` is what a pool leased from the broker (its lease id is the group id). An episode may call
the engines of several model_ids; it finds them through `EpisodeContext`, which maps each of the
workflow's roles ("policy", "solver", "verifier", ...) to a model_id and each model_id to its engine.
It returns `deltamesh.data.Trajectory` records, the broker's submission format, built with
`trajectory_from_generation` and closed with `finalize_groups` so that each (model_id, group_id)
group states its true size: a multi-turn workflow may emit a different number of trajectories per
model than the task's n_samples. A workflow that runs model-written code declares `needs_sandbox`;
the pool then hands it its one `Sandbox` through `EpisodeContext.sandbox`.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Mapping, Sequence

import numpy as np

from deltamesh.data import Trajectory
from deltamesh.mesh.engines.base import Engine, Generation, SamplingParams
from deltamesh.mesh.sandbox import Sandbox


class WorkflowError(ValueError):
    """A workflow that cannot run as configured (unknown name, bad options, no engine for a role)."""


@dataclass(frozen=True)
class Task:
    """One leased prompt: `metadata["answer"]` holds the reference answer of verifiable tasks."""

    task_id: str
    prompt: str
    group_id: str = ""
    """The broker's lease id (a group's id); defaults to task_id."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    n_samples: int = 1
    model_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("task_id must be set")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if not self.group_id:
            object.__setattr__(self, "group_id", self.task_id)

    @property
    def answer(self) -> str | None:
        value = self.metadata.get("answer")
        return None if value is None else str(value)

    def reference_answer(self, workflow: str) -> str:
        """The answer `workflow` scores against; WorkflowError if the task has none."""
        if self.answer is None:
            raise WorkflowError(f"task {self.task_id}: the {workflow} workflow needs metadata.answer")
        return self.answer


@dataclass
class EpisodeContext:
    """Engines by model_id, which model_id plays each role, sampling parameters, and where we run."""

    engines: Mapping[str, Engine]
    params: SamplingParams
    roles: Mapping[str, str] = field(default_factory=dict)
    pool: str = ""
    region: str = ""
    sandbox: Sandbox | None = None
    """Where model-written code runs; set by the pool for workflows that declare `needs_sandbox`."""

    def need_sandbox(self, workflow: str) -> Sandbox:
        """The sandbox, or WorkflowError: a code workflow never falls back to running code unsandboxed."""
        if self.sandbox is None:
            raise WorkflowError(f"the {workflow} workflow runs model-written code and needs a sandbox")
        return self.sandbox

    def model_for(self, role: str) -> str:
        """The model_id playing `role`: from `roles`, or the only engine when there is just one."""
        model_id = self.roles.get(role)
        if model_id is None:
            if len(self.engines) != 1:
                raise WorkflowError(f"no model_id for role {role!r}: set roles (engines: {sorted(self.engines)})")
            model_id = next(iter(self.engines))
        if model_id not in self.engines:
            raise WorkflowError(f"role {role!r} is played by {model_id!r}, which has no engine here")
        return model_id

    def engine_for(self, role: str) -> tuple[str, Engine]:
        model_id = self.model_for(role)
        return model_id, self.engines[model_id]


EpisodeFn = Callable[[Task, EpisodeContext, Any], Awaitable[list[Trajectory]]]


@dataclass(frozen=True)
class WorkflowSpec:
    """A registered workflow: its roles, its options' dataclass and its episode function."""

    name: str
    roles: tuple[str, ...]
    config_type: type
    episode: EpisodeFn
    description: str = ""
    needs_sandbox: bool = False
    """Whether episodes run model-written code (the pool then builds its sandbox, or refuses to start)."""


@dataclass(frozen=True)
class Workflow:
    """A workflow with its options bound: `await workflow.run(task, ctx)`."""

    spec: WorkflowSpec
    config: Any

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def roles(self) -> tuple[str, ...]:
        return self.spec.roles

    async def run(self, task: Task, ctx: EpisodeContext) -> list[Trajectory]:
        return await self.spec.episode(task, ctx, self.config)


PromptFormat = Literal["auto", "completion", "chat"]
"""How a workflow shows a prompt to a model: "completion" sends the text as it is (the model continues
it: base models, and the tiny character models); "chat" sends it as one user turn through the
tokenizer's chat template, ending with the assistant's generation prompt (instruct models, which
answer a question rather than continue a file); "auto" is "chat" when the engine's tokenizer has a
chat template, else "completion"."""


def uses_chat(engine: Engine, prompt_format: str) -> bool:
    """Whether prompts to `engine` go through its chat template (see `PromptFormat`); WorkflowError for
    "chat" on an engine whose tokenizer has none."""
    if prompt_format == "completion":
        return False
    # Read through the Engine interface, so an engine the pool wraps (BatchingEngine) keeps its template.
    tokenizer = engine.tokenizer
    has_template = tokenizer is not None and tokenizer.chat_template is not None
    if prompt_format == "chat" and not has_template:
        raise WorkflowError(f"prompt_format 'chat': the tokenizer of {getattr(engine, 'model_id', 'this engine')!r} "
                            "has no chat template")
    if prompt_format not in ("auto", "chat"):
        raise WorkflowError(f"prompt_format must be auto, completion or chat, not {prompt_format!r}")
    return has_template


def encode_prompt(engine: Engine, text: str, chat: bool, reply_prefix: str = "") -> list[int]:
    """The prompt's tokens: `text` as it is, or as one user turn of the chat template with its
    generation prompt (the template's special tokens become their ids), then `reply_prefix`: the
    start of the assistant's reply, which the model continues."""
    if not chat:
        return engine.encode(text + reply_prefix)
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return engine.encode(rendered + reply_prefix)


def token_ids_containing(engine: Engine, text: str) -> tuple[int, ...]:
    """The ids of every vocabulary entry whose text holds `text` (e.g. a closing ``` fence, as stop
    tokens); () when the engine's tokenizer has no vocabulary to read."""
    if engine.tokenizer is None:
        return ()
    vocab = engine.tokenizer.get_vocab
    # Byte-level BPE writes printable ASCII as itself, so a token's text holds `text` as it is.
    return tuple(sorted(i for token, i in vocab().items() if text in token))


def render(template: str, **values: str) -> str:
    """Fill `{name}` placeholders in one pass (a value holding `{name}` text, as code may, stays as it
    is); other braces (LaTeX, JSON) in the template stay as they are."""
    if not values:
        return template
    pattern = re.compile("|".join(re.escape("{" + name + "}") for name in values))
    return pattern.sub(lambda m: str(values[m.group(0)[1:-1]]), template)


@dataclass(frozen=True)
class Segment:
    """A run of tokens in a trajectory: the model's own (with behaviour logprobs and versions: trained
    on, loss mask 1) or anyone else's (a prompt, an environment's observation: logprob 0, version -1,
    loss mask 0)."""

    tokens: Sequence[int]
    logprobs: Sequence[float] | None = None
    versions: Sequence[int] | None = None

    @property
    def generated(self) -> bool:
        return self.logprobs is not None

    @classmethod
    def of(cls, gen: Generation) -> "Segment":
        """The tokens an engine generated."""
        return cls(gen.tokens, gen.logprobs, gen.versions)


def trajectory_from_segments(
    segments: Sequence[Segment], *, trajectory_id: str, task: Task, model_id: str, reward: float,
    ctx: EpisodeContext, timings: Mapping[str, float] | None = None, metadata: Mapping[str, Any] | None = None,
) -> Trajectory:
    """One trajectory of the segments in order; `group_size` is set by `finalize_groups`."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    for seg in segments:
        n = len(seg.tokens)
        tokens += seg.tokens
        logprobs += seg.logprobs if seg.logprobs is not None else [0.0] * n
        versions += seg.versions if seg.versions is not None else [-1] * n
        mask += [1 if seg.generated else 0] * n
    return Trajectory(
        id=trajectory_id, task_id=task.task_id, group_id=task.group_id, group_size=1, model_id=model_id,
        tokens=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
        loss_mask=np.asarray(mask, dtype=np.uint8), versions=np.asarray(versions, dtype=np.int32),
        reward=float(reward), pool=ctx.pool, region=ctx.region,
        timings={"finished_at": time.time(), **(timings or {})}, metadata=dict(metadata or {}),
    )


def trajectory_from_generation(
    gen: Generation, *, trajectory_id: str, task: Task, model_id: str, reward: float, ctx: EpisodeContext,
    timings: Mapping[str, float] | None = None, metadata: Mapping[str, Any] | None = None,
) -> Trajectory:
    """Prompt + generated tokens, behaviour logprobs, loss mask 1 on generated tokens, versions per token.

    Prompt positions carry logprob 0 and version -1. `group_size` is set by `finalize_groups`.
    """
    return trajectory_from_segments(
        [Segment(gen.prompt), Segment.of(gen)], trajectory_id=trajectory_id, task=task, model_id=model_id,
        reward=reward, ctx=ctx, timings={"generate_s": gen.generate_s, **(timings or {})},
        metadata={"finish_reason": gen.finish_reason, **(metadata or {})},
    )


def finalize_groups(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Set every trajectory's group_size to the number returned for its (model_id, group_id)."""
    sizes = Counter((t.model_id, t.group_id) for t in trajectories)
    for t in trajectories:
        t.group_size = sizes[(t.model_id, t.group_id)]
    return list(trajectories)
