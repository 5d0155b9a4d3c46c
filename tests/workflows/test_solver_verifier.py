"""The Solver + Verifier workflow on two real in-process engines (two tiny models, two model_ids).

Random tiny models do not follow instructions, so the Verifier's verdict is steered through the
workflow's own `accept_pattern` option: one that always matches (every answer accepted), one that
never does (every answer rejected, every sample retried), and the default one on sampled replies.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from deltamesh.data import decode_trajectories, encode_trajectories
from deltamesh.mesh.engines.base import SamplingParams
from deltamesh.mesh.workflows import EpisodeContext, Task, make_workflow
from deltamesh.mesh.workflows.answers import answers_match, extract_answer

PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=9)
ROLES = {"solver": "solver", "verifier": "verifier"}


def episode(engines, accept_pattern: str | None, answer: str, n: int = 4):
    options = {} if accept_pattern is None else {"accept_pattern": accept_pattern}
    workflow = make_workflow("solver_verifier", options)
    ctx = EpisodeContext(engines=engines, params=PARAMS, roles=ROLES, pool="p", region="r")
    task = Task(task_id="q1", group_id="L3", prompt="2+3=", metadata={"answer": answer}, n_samples=n)
    return asyncio.run(workflow.run(task, ctx))


def by_sample(trajs):
    out: dict[int, dict[tuple[str, int], object]] = {}
    for t in trajs:
        out.setdefault(t.metadata["sample"], {})[(t.metadata["role"], t.metadata["turn"])] = t
    return out


def check_consistent(engines, trajs, answer: str) -> None:
    """Both model_ids present; each episode's trajectories share one reward: its final outcome."""
    sizes = Counter(t.model_id for t in trajs)
    assert set(sizes) == {"solver", "verifier"}
    for t in trajs:
        assert t.group_id == "L3" and t.group_size == sizes[t.model_id]
        assert t.model_id == t.metadata["role"]
    for sample in by_sample(trajs).values():
        final = sample.get(("solver", 1), sample[("solver", 0)])
        text = engines["solver"].decode(final.tokens[final.loss_mask.astype(bool)].tolist()).strip()
        outcome = 1.0 if answers_match(extract_answer(text), answer) else 0.0
        assert {t.reward for t in sample.values()} == {outcome}
        assert (("solver", 1) in sample) == (not sample[("verifier", 0)].metadata["accepted"])
    back = decode_trajectories(encode_trajectories(trajs), max_trajectories=64, max_tokens=256)
    assert sorted(b.id for b in back) == sorted(t.id for t in trajs)


def test_all_accepted_means_no_retry(engines):
    trajs = episode(engines, accept_pattern="", answer="5")
    assert Counter(t.model_id for t in trajs) == {"solver": 4, "verifier": 4}
    check_consistent(engines, trajs, "5")


def test_all_rejected_means_one_retry_each_with_feedback(engines):
    trajs = episode(engines, accept_pattern="(?!)", answer="5")
    assert Counter(t.model_id for t in trajs) == {"solver": 8, "verifier": 4}
    check_consistent(engines, trajs, "5")
    for sample in by_sample(trajs).values():
        retry, review = sample[("solver", 1)], sample[("verifier", 0)]
        prompt = engines["solver"].decode(retry.tokens[~retry.loss_mask.astype(bool)].tolist())
        assert f"A reviewer rejected it: {review.metadata['completion']}" in prompt
        generated = engines["solver"].decode(retry.tokens[retry.loss_mask.astype(bool)].tolist()).strip()
        assert retry.metadata["completion"] == generated


def test_shared_outcome_reward_is_one_when_the_final_answer_is_right(engines):
    """Rerun with the same seeds and a reference equal to one episode's final answer."""
    first = episode(engines, accept_pattern="(?!)", answer="none", n=8)
    finals = [t.metadata["final_answer"] for t in first if t.metadata["final_answer"] is not None]
    if not finals:
        pytest.fail("no final answer among 8 samples; pick another seed")
    trajs = episode(engines, accept_pattern="(?!)", answer=finals[0], n=8)
    check_consistent(engines, trajs, finals[0])
    assert 1.0 in {t.reward for t in trajs}


def test_default_verdict_pattern_on_sampled_replies(engines):
    trajs = episode(engines, accept_pattern=None, answer="5", n=6)
    check_consistent(engines, trajs, "5")
