"""The `math` workflow on a real in-process engine: trajectory records, rewards, broker format."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deltamesh.data import decode_trajectories, encode_trajectories
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.workflows import EpisodeContext, Task, WorkflowError, make_workflow
from deltamesh.mesh.workflows.verifiable_math import MathConfig, digit_sum_tasks, score

PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)


def run(workflow, task, ctx):
    return asyncio.run(workflow.run(task, ctx))


def test_math_episode_records_and_rewards(engines):
    engine = engines["solver"]
    ctx = EpisodeContext(engines={"solver": engine}, params=PARAMS, pool="p1", region="eu")
    workflow = make_workflow("math", {"format_reward": 0.1})
    task = Task(task_id="t1", group_id="L7", prompt="3+4=", metadata={"answer": "7"}, n_samples=16)
    trajs = run(workflow, task, ctx)

    assert len(trajs) == 16 and len({t.id for t in trajs}) == 16
    prompt = engine.encode("3+4=")
    for t in trajs:
        fields = (t.model_id, t.task_id, t.group_id, t.group_size, t.pool, t.region)
        assert fields == ("solver", "t1", "L7", 16, "p1", "eu")
        n = len(t.tokens) - len(prompt)
        assert 1 <= n <= 3 and t.tokens[:len(prompt)].tolist() == prompt
        assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * n
        assert t.versions.tolist() == [-1] * len(prompt) + [0] * n
        assert (t.logprobs[:len(prompt)] == 0).all() and (t.logprobs[len(prompt):] < 0).all()
        completion = engine.decode(t.tokens[len(prompt):].tolist())
        assert t.metadata["completion"] == completion
        assert (t.reward, t.metadata["answer"], t.metadata["correct"]) == score(completion, "7", workflow.config)
        assert t.timings["episode_s"] >= t.timings["generate_s"] > 0

    # The records are the broker's submission format as they are.
    back = decode_trajectories(encode_trajectories(trajs), max_trajectories=64, max_tokens=64)
    assert [b.id for b in back] == [t.id for t in trajs]
    assert all(np.array_equal(b.versions, t.versions) for b, t in zip(back, trajs))


def test_a_correct_answer_gets_reward_one(engines):
    """Rerun with the same seed and a reference that one sample's answer matches."""
    ctx = EpisodeContext(engines={"solver": engines["solver"]}, params=PARAMS)
    workflow = make_workflow("math")
    first = run(workflow, Task(task_id="t", prompt="2+2=", metadata={"answer": "nothing"}, n_samples=16), ctx)
    answers = [t.metadata["answer"] for t in first if t.metadata["answer"] is not None]
    assert answers, "some of 16 samples of 3 characters contain a number"
    again = run(workflow, Task(task_id="t", prompt="2+2=", metadata={"answer": answers[0]}, n_samples=16), ctx)
    rewards = [t.reward for t in again]
    assert 1.0 in rewards
    assert rewards == [1.0 if t.metadata["correct"] else 0.0 for t in again]


def test_math_needs_a_reference_and_a_policy(engines):
    workflow = make_workflow("math")
    ctx = EpisodeContext(engines=engines, params=PARAMS)  # two engines, no roles: ambiguous
    with pytest.raises(WorkflowError, match="role 'policy'"):
        run(workflow, Task(task_id="t", prompt="1+1=", metadata={"answer": "2"}), ctx)
    ctx = EpisodeContext(engines=engines, params=PARAMS, roles={"policy": "verifier"})
    with pytest.raises(WorkflowError, match="metadata.answer"):
        run(workflow, Task(task_id="t", prompt="1+1="), ctx)
    ctx = EpisodeContext(engines=engines, params=PARAMS, roles={"policy": "nobody"})
    with pytest.raises(WorkflowError, match="no engine"):
        run(workflow, Task(task_id="t", prompt="1+1=", metadata={"answer": "2"}), ctx)


def test_registry_rejects_unknown_workflows_and_options():
    with pytest.raises(WorkflowError, match="unknown workflow"):
        make_workflow("poetry")
    with pytest.raises(WorkflowError, match="unknown keys"):
        make_workflow("math", {"temperature": 1.0})
    with pytest.raises(WorkflowError, match="prompt_template"):
        make_workflow("math", {"prompt_template": "no placeholder"})
    with pytest.raises(WorkflowError, match="not a WorkflowSpec"):
        make_workflow("deltamesh.mesh.workflows.verifiable_math:score")
    assert make_workflow("deltamesh.mesh.workflows.verifiable_math:MATH").name == "math"


def test_digit_sum_tasks():
    tasks = digit_sum_tasks(50, seed=3)
    assert len(tasks) == 50 and len({t["id"] for t in tasks}) == 50
    for t in tasks:
        a, b = t["prompt"].rstrip("=").split("+")
        assert t["metadata"]["answer"] == str(int(a) + int(b)) and len(t["metadata"]["answer"]) == 1
    assert digit_sum_tasks(50, seed=3) == tasks
    assert score("7", "7", MathConfig(format_reward=0.1)) == (1.0, "7", True)
    assert score("5", "7", MathConfig(format_reward=0.1)) == (0.1, "5", False)
    assert score("x", "7", MathConfig(format_reward=0.1)) == (0.0, None, False)


def test_a_reply_prefix_counts_toward_the_answer_and_first_number_reads_a_rambling_reply():
    first = MathConfig(reply_prefix="The answer is", answer="first_number")
    assert score(" 12. Then Tom buys 3 more", "12", first) == (1.0, "12", True)
    final = MathConfig(reply_prefix="The answer is")
    assert score(" 12. Then Tom buys 3 more", "12", final)[2] is False  # the last number: 3
    assert score(" 12.", "12", final) == (1.0, "12.", True)
    with pytest.raises(ValueError, match="answer must be"):
        MathConfig(answer="last")
    with pytest.raises(ValueError, match="prompt_format"):
        MathConfig(prompt_format="markdown")


def test_the_prompt_goes_as_a_chat_turn_with_the_reply_begun(tmp_path):
    """A tokenizer with a chat template (SmolLM2's, on a tiny model): the prompt is one user turn, the
    reply prefix follows the generation prompt, and only the model's own tokens are trained on."""
    from deltamesh.mesh.demo.models import TinyModelConfig, tiny_model_dir
    from deltamesh.mesh.engines.transformers_engine import TransformersEngine, TransformersEngineConfig

    path = tiny_model_dir(TinyModelConfig(tokenizer="smollm2", seed=3), path=tmp_path / "tiny-bpe")
    engine = TransformersEngine(TransformersEngineConfig(model_id="policy", model_dir=str(path), seed=0))
    workflow = make_workflow("math", {"prompt_format": "chat", "reply_prefix": "The answer is",
                                      "answer": "first_number"})
    ctx = EpisodeContext(engines={"policy": engine}, params=PARAMS)
    (t,) = run(workflow, Task(task_id="t", prompt="What is 3 + 4?", metadata={"answer": "7"}), ctx)
    tokenizer = engine._tokenizer
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                             add_generation_prompt=True) + "The answer is"
    prompt_len = int((t.loss_mask == 0).sum())
    assert t.tokens[:prompt_len].tolist() == engine.encode(expected) and prompt_len < len(t.tokens)
    assert (t.reward, t.metadata["answer"], t.metadata["correct"]) == score(t.metadata["completion"], "7", workflow.config)
    with pytest.raises(WorkflowError, match="no chat template"):
        chat = make_workflow("math", {"prompt_format": "chat"})
        char_ctx = EpisodeContext(engines={"policy": TransformersEngine(TransformersEngineConfig(
            model_id="policy", model_dir=str(tiny_model_dir(TinyModelConfig(seed=3), path=tmp_path / "tiny-char"))))},
            params=PARAMS)
        run(chat, Task(task_id="t", prompt="1+1=", metadata={"answer": "2"}), char_ctx)
