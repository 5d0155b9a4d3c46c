"""Multi-turn episodes: the engine's tokens of every turn kept with their logprobs and versions, the
environment's tokens masked out, one trajectory per episode; and the Python tool environment."""

from __future__ import annotations

import numpy as np
import pytest

from deltamesh.data import decode_trajectories, encode_trajectories
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.workflows import EpisodeContext, Task, make_workflow
from deltamesh.mesh.workflows.episodes import Step, run_episode
from deltamesh.mesh.workflows.tool_use import NO_TAG, TOOL_FIRST, PythonToolEnv, ToolUseConfig, tool_tasks

PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, seed=3)


class Scripted:
    """An environment that ends after `turns` steps, answering each with a numbered observation."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, []

    async def reset(self) -> str:
        return "go:"

    async def step(self, action: str) -> Step:
        self.seen.append(action)
        return Step(f"[obs{len(self.seen)}]", reward=0.5, done=len(self.seen) == self.turns)


def model_positions(t) -> list[int]:
    return [i for a, b in t.metadata["turn_spans"] for i in range(a, b)]


def test_an_episode_is_one_trajectory_whose_loss_mask_is_exactly_the_models_tokens(engines, run):
    engine = engines["solver"]
    env = Scripted(3)
    episode = run(run_episode(engine, env, PARAMS, max_turns=5, max_tokens=400))
    assert (len(episode.turns), episode.end, episode.reward) == (3, "done", 1.5)
    task = Task(task_id="t", group_id="G", prompt="go:")
    t = episode.trajectory(trajectory_id="G/0", task=task, model_id="solver", ctx=EpisodeContext({}, PARAMS))

    # prompt, turn 1, obs 1, turn 2, obs 2, turn 3 (the last observation ends the episode: not part of it)
    g = [turn.generation for turn in episode.turns]
    obs = [engine.encode("[obs1]"), engine.encode("[obs2]")]
    expected = engine.encode("go:") + g[0].tokens + obs[0] + g[1].tokens + obs[1] + g[2].tokens
    assert t.tokens.tolist() == expected
    assert np.flatnonzero(t.loss_mask).tolist() == model_positions(t)
    assert [b - a for a, b in t.metadata["turn_spans"]] == [len(x.tokens) for x in g]
    mask = t.loss_mask.astype(bool)
    assert t.logprobs[mask].tolist() == pytest.approx([lp for x in g for lp in x.logprobs])
    assert (t.logprobs[~mask] == 0).all() and (t.versions[~mask] == -1).all() and (t.versions[mask] == 0).all()
    # Each turn was generated from the whole context so far, and the environment saw the decoded text.
    assert [x.prompt for x in g] == [expected[:a] for a, _ in t.metadata["turn_spans"]]
    assert env.seen == [engine.decode(x.tokens) for x in g] == t.metadata["actions"]
    assert (t.reward, t.metadata["turns"], t.metadata["end"]) == (1.5, 3, "done")
    assert decode_trajectories(encode_trajectories([t]), max_trajectories=4, max_tokens=4096)[0].id == "G/0"


def test_an_episode_stops_at_max_turns_or_before_the_context_is_full(engines, run):
    engine = engines["solver"]
    capped = run(run_episode(engine, Scripted(99), PARAMS, max_turns=2, max_tokens=400))
    assert (len(capped.turns), capped.end, capped.turns[-1].observation_tokens) == (2, "max_turns", [])
    full = run(run_episode(engine, Scripted(99), PARAMS, max_turns=50, max_tokens=30))
    assert full.end == "max_tokens" and 1 <= len(full.turns) < 50


def test_the_python_tool_runs_code_and_shows_its_output_before_an_answer_counts(sandbox, run):
    env = PythonToolEnv("What is 2**10?", "1024", sandbox, ToolUseConfig(max_output_chars=50))

    async def play(actions):
        await env.reset()
        return [await env.step(a) for a in actions]

    steps = run(play(["hmm", "<answer>1024</answer>", "<python>print(2**10)</python> then <answer>",
                              "<python>1/0", "<answer>1024</answer>"]))
    assert steps[0] == Step(NO_TAG) and steps[1] == Step(TOOL_FIRST)
    assert steps[2] == Step("\n<output>\n1024\n</output>\n")
    assert steps[3].observation.startswith("\n<output>\n[error]\n") and "ZeroDivisionError" in steps[3].observation
    assert len(steps[3].observation) < 50 + 30 and not steps[3].done
    assert steps[4] == Step("", reward=1.0, done=True) and env.given == "1024" and len(env.executions) == 2
    wrong = run(play(["<python>print(1)</python>", "<answer>7</answer>"]))
    assert wrong[1] == Step("", reward=0.0, done=True)


def test_tool_tasks_answers_are_right():
    for record in tool_tasks(20, seed=1):
        prompt, answer = record["prompt"], record["metadata"]["answer"]
        if prompt.startswith("What is the sum of the digits of "):
            expr = prompt.removeprefix("What is the sum of the digits of ").rstrip("?")
            assert answer == str(sum(map(int, str(eval(expr)))))
        else:
            n = int(prompt.split()[-1].rstrip("?"))
            assert answer == str(sum(all(k % d for d in range(2, k)) for k in range(2, n)))


def test_the_tool_use_workflow_gives_every_episode_several_turns(engines, sandbox, run):
    ctx = EpisodeContext(engines={"solver": engines["solver"]}, params=PARAMS, pool="p", region="r", sandbox=sandbox)
    workflow = make_workflow("tool_use", {"max_turns": 3, "prompt_template": "{prompt}\n"})
    record = tool_tasks(1)[0]
    task = Task(task_id=record["id"], group_id="L", prompt=record["prompt"], metadata=record["metadata"], n_samples=4)
    trajs = run(workflow.run(task, ctx))
    assert len(trajs) == 4 and {t.group_size for t in trajs} == {4}
    for t in trajs:
        assert t.metadata["turns"] >= 2
        assert np.flatnonzero(t.loss_mask).tolist() == model_positions(t)
        assert t.reward == (1.0 if t.metadata["correct"] else 0.0)
        assert sum(t.metadata["outcomes"].values()) == t.metadata["tool_calls"]
