"""Multi-turn episodes: a policy acting on an environment over several turns, kept as one trajectory.

An `Environment` is made per episode (for one task); `reset()` gives the first observation (the
prompt) and `step(action)` answers the model's text of one turn with a `Step`: the next observation,
a reward and whether the episode is over. `run_episode` plays it: each turn the engine generates
from the whole context so far (the prompt, every earlier turn's generated tokens and observation
tokens, as tokens: nothing is re-tokenized, so what the trainer scores is exactly what the engine
saw), the generated text goes to `step`, and the observation's tokens are appended. The episode ends
when the environment says done, after `max_turns` turns, or when the context would pass
`max_tokens`.

`Episode.trajectory` makes the one trajectory of the episode: the engine's tokens of every turn with
their behaviour logprobs and versions (loss mask 1), the prompt and the environment's observations
between them with loss mask 0, logprob 0 and version -1. Its reward is the sum of the step rewards;
its metadata lists the turns and the token span of each turn's generated tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from deltamesh.data import Trajectory
from deltamesh.mesh.engines.base import Engine, Generation, SamplingParams
from deltamesh.mesh.workflows.base import EpisodeContext, Segment, Task, trajectory_from_segments


@dataclass(frozen=True)
class Step:
    observation: str
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    async def reset(self) -> str:
        """The first observation: what the model is prompted with."""
        ...

    async def step(self, action: str) -> Step:
        """React to the model's text of one turn."""
        ...


@dataclass
class Turn:
    generation: Generation
    action: str
    step: Step
    observation_tokens: list[int] = field(default_factory=list)
    """The observation's tokens, when another turn follows it (else they are not part of the episode)."""


@dataclass
class Episode:
    prompt: list[int]
    turns: list[Turn]
    end: str
    """Why it ended: "done" (the environment), "max_turns" or "max_tokens"."""
    seconds: float = 0.0

    @property
    def reward(self) -> float:
        return sum(t.step.reward for t in self.turns)

    def segments(self) -> list[Segment]:
        out = [Segment(self.prompt)]
        for turn in self.turns:
            out.append(Segment.of(turn.generation))
            if turn.observation_tokens:
                out.append(Segment(turn.observation_tokens))
        return out

    def trajectory(self, *, trajectory_id: str, task: Task, model_id: str, ctx: EpisodeContext,
                   metadata: Mapping[str, Any] | None = None) -> Trajectory:
        spans, at = [], 0
        for seg in self.segments():
            if seg.generated:
                spans.append([at, at + len(seg.tokens)])
            at += len(seg.tokens)
        return trajectory_from_segments(
            self.segments(), trajectory_id=trajectory_id, task=task, model_id=model_id, reward=self.reward,
            ctx=ctx, timings={"episode_s": self.seconds,
                              "generate_s": sum(t.generation.generate_s for t in self.turns)},
            metadata={"turns": len(self.turns), "turn_spans": spans, "end": self.end,
                      "actions": [t.action for t in self.turns],
                      "observations": [t.step.observation for t in self.turns], **(metadata or {})},
        )


async def run_episode(engine: Engine, env: Environment, params: SamplingParams, *, max_turns: int,
                      max_tokens: int) -> Episode:
    """Play one episode (see the module docstring)."""
    started = time.perf_counter()
    prompt = engine.encode(await env.reset())
    context = list(prompt)
    turns: list[Turn] = []
    end = "max_turns"
    while len(turns) < max_turns:
        (gen,) = await engine.generate([context], params)
        action = engine.decode(gen.tokens)
        step = await env.step(action)
        turn = Turn(gen, action, step)
        turns.append(turn)
        if step.done:
            end = "done"
            break
        if len(turns) == max_turns:
            break
        observation = engine.encode(step.observation)
        if len(context) + len(gen.tokens) + len(observation) + params.max_new_tokens > max_tokens:
            end = "max_tokens"
            break
        turn.observation_tokens = observation
        context += gen.tokens + observation
    return Episode(prompt, turns, end, time.perf_counter() - started)
