"""Settings of `deltamesh demo`: which model and workflow, how many steps, and the RL recipe per model.

The defaults are the embedded demo: the tiny random-init model (character tokenizer) learning the
digit-sum task "a+b=" (digits 0..2, so nine prompts and one-character answers) by GRPO/M2PO, which it
reliably does within a few dozen steps on two CPU cores. `model = "smollm2"` runs the real
pretrained SmolLM2-135M-Instruct at lr 5e-6 instead (a realistic delta size, slower steps). Every
field left as None takes its value from the model's `Recipe` in `__post_init__`, so a finished
`DemoConfig` is complete; checks name the bad field.

The code workflows (`code`, `solver_selector`, `solver_testgen`) take their problems from the
in-repo synthetic set (`code_tasks = "humaneval"`: HumanEval's 164), run model-written programs in
each pool's sandbox (`[demo.sandbox]`, passed to every pool as `[pool.sandbox]`), and have their own
recipes (`CODE_RECIPES`: longer answers, smaller batches, since each sample costs sandbox runs).

`engine = "vllm"` runs every pool on the in-process vLLM engine (its CPU build here) instead of the
transformers engine. vLLM's CPU attention kernels take no head size below 32, so the tiny model of a
vLLM demo is the same seeded model with 32-wide heads (`mesh/demo/models.py: VLLM_TINY`); the
trainer trains that same model. Each vLLM pool takes a 512 MiB KV cache (see `mesh/pool/engine_setup.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deltamesh.mesh.demo.topology import Topology, default_topology
from deltamesh.mesh.sandbox.config import SandboxConfig
from deltamesh.mesh.workflows.arithmetic import WORDINGS


@dataclass(frozen=True)
class Recipe:
    """The RL recipe that works for one model on its math task (or a code workflow)."""

    lr: float
    max_new_tokens: int
    group_size: int
    groups_per_step: int
    format_reward: float
    max_digit: int
    temperature: float = 1.0
    tasks: str = "digit_sum"
    """The math task family: digit_sum ("a+b=", one-character answers) or arithmetic (word problems)."""
    levels: tuple[int, ...] = (1, 2, 4)
    """Arithmetic: the difficulty levels trained and held out."""
    wording: str = "words"
    """Arithmetic: the problems as stories (words) or bare equations (equation)."""
    math_options: tuple[tuple[str, Any], ...] = ()
    """More options of the math workflow (how the prompt is shown, how the answer is read)."""
    kl_coef: float = 1e-3
    """The trainer's KL penalty weight (0 also spares it the reference model's forward pass)."""
    eval_every: int = 0
    """Score every k-th version on the held-out set (0: no evaluator)."""


# SmolLM2-135M on the arithmetic problems worded as bare equations, continued as text after four solved
# examples whose operands are outside every level's ranges (so none is a training or held-out problem):
# the first number it writes is its answer. Asked the word problems instead (in chat, its reply begun
# "The answer is") it answers about 2% of them at temperature 1, too few for a group ever to differ.
SMOLLM2_FEW_SHOT = "3 + 10 = 13\n7 * 11 = 77\n85 - 12 = 73\n41 + 10 - 2 = 49\n{prompt}"
SMOLLM2_ARITHMETIC: tuple[tuple[str, Any], ...] = (
    ("prompt_format", "completion"), ("prompt_template", SMOLLM2_FEW_SHOT), ("answer", "first_number"))

# Tiny: lr 5e-3 (AdamW, grad clip 1.0), 4 groups of 8 single-token answers per step; chosen from
# in-process runs over seeds 0-3, where the mean reward of the last third of 40 steps beat the first
# third by 0.26-0.42. The format reward (0.2 for any number) gets a random model to emit digits at all.
RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(lr=5e-3, max_new_tokens=1, group_size=8, groups_per_step=4, format_reward=0.2, max_digit=2),
    # 8 groups of 4 a step at lr 2e-5: through the mesh, sync, held-out avg@4 0.59 -> 0.73 in 30 steps
    # (BENCHMARKS.md). Pools serve the bf16 rounding of the weights: at 1e-5 most updates fall below it and
    # 30 steps moved nothing; in process, 5e-5 collapsed the policy within 10.
    "smollm2": Recipe(lr=2e-5, max_new_tokens=6, group_size=4, groups_per_step=8, format_reward=0.0, max_digit=4,
                      tasks="arithmetic", wording="equation", math_options=SMOLLM2_ARITHMETIC, eval_every=5),
}

# Code workflows: a program needs more than a digit, and every sample costs sandbox executions (the
# two-policy ones several), so fewer samples per step. Math-only fields are unused there.
CODE_RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(lr=5e-3, max_new_tokens=16, group_size=4, groups_per_step=2, format_reward=0.0, max_digit=2),
    "smollm2": Recipe(lr=5e-6, max_new_tokens=64, group_size=4, groups_per_step=2, format_reward=0.0, max_digit=4),
}

# The policies (model_ids, one trainer and weight stream each) of each workflow: its roles' names.
WORKFLOW_MODELS: dict[str, tuple[str, ...]] = {
    "math": ("policy",), "solver_verifier": ("solver", "verifier"), "code": ("policy",),
    "solver_selector": ("solver", "selector"), "solver_testgen": ("solver", "testgen"),
}
CODE_WORKFLOWS = ("code", "solver_selector", "solver_testgen")

# Short templates for a character-level model; the Verifier accepts by answering "y".
TINY_SOLVER_VERIFIER: dict[str, Any] = {
    "solver_template": "{prompt}", "verifier_template": "{prompt}{answer}?",
    "retry_template": "{prompt}{answer}{feedback}=", "accept_pattern": r"^\W*y",
}
# The tiny model's context is 512 characters: shorter Selector and retry prompts than the defaults,
# which show whole programs and up to 1000 characters of test failures.
TINY_CODE: dict[str, dict[str, Any]] = {
    "code": {},
    "solver_selector": {"selector_template": "{prompt}#A\n{a}#B\n{b}#?"},
    "solver_testgen": {"retry_template": "{program}\n{feedback}\n{prompt}", "max_feedback_chars": 120},
}


@dataclass
class DemoEvalConfig:
    """The demo's evaluator (`deltamesh eval`, `[demo.eval]`): which versions of the first policy it
    scores on the held-out set, and how."""

    every: int | None = None
    """Score version 0, every k-th version and the final one (0: no evaluator; unset: the model's
    recipe: 5 for SmolLM2 on the arithmetic problems, none for the tiny model's digit sums)."""
    problems: int = 40
    """Held-out problems (arithmetic: spread over the levels trained; code workflows: HumanEval's first N)."""
    samples: int = 4
    """Samples per problem: the score is avg@samples."""
    temperature: float | None = None
    """Sampling temperature of the scored answers (unset: the pools')."""
    region: str = ""
    """The region whose gateway it follows (empty: the origin's)."""

    def __post_init__(self) -> None:
        if (self.every is not None and self.every < 0) or self.problems < 1 or self.samples < 1:
            raise ValueError("eval.every must be >= 0, eval.problems and eval.samples >= 1")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")


@dataclass
class DemoConfig:
    """The demo mesh: model, workflow, length, recipe (unset fields take the model's), topology and timeouts."""

    steps: int = 60
    """Optimizer steps (versions published after v0) per trainer."""
    model: Literal["tiny", "smollm2"] = "tiny"
    """tiny: the random-init character model; smollm2: the real pretrained SmolLM2-135M-Instruct."""
    workflow: Literal["math", "solver_verifier", "code", "solver_selector", "solver_testgen"] = "math"
    """math, code: one policy; solver_verifier, solver_selector, solver_testgen: two policies, two trainers
    (docs/WORKFLOWS.md)."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """The pools' inference engine: transformers, or vLLM in process (`pip install deltamesh[vllm]`;
    the tiny model then has 32-wide attention heads, which vLLM's CPU kernels need)."""
    code_tasks: Literal["synthetic", "humaneval"] = "synthetic"
    """Problems of the code workflows: the in-repo synthetic set, or HumanEval (the `code` extra)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where the code workflows' pools run model-written code (each pool's `[pool.sandbox]`)."""
    seed: int = 0
    """Seed of the trainer, the pools' sampling and the task set."""
    lr: float | None = None
    """Learning rate (unset: the model's recipe)."""
    group_size: int | None = None
    """Samples per prompt (one GRPO group)."""
    groups_per_step: int | None = None
    """Groups per trainer step."""
    max_new_tokens: int | None = None
    """Most tokens the pools generate per answer."""
    format_reward: float | None = None
    """Reward for an answer that is a number at all."""
    max_digit: int | None = None
    """Largest digit in the digit-sum prompts (0..4)."""
    tasks: Literal["digit_sum", "arithmetic"] | None = None
    """The math workflows' task family: digit_sum ("a+b=") or arithmetic (word problems of graded
    difficulty whose held-out split the evaluator scores; mesh/workflows/arithmetic.py); unset: the recipe's."""
    levels: list[int] | None = None
    """Arithmetic: the difficulty levels (1..5) trained and held out (unset: the recipe's)."""
    wording: Literal["words", "equation"] | None = None
    """Arithmetic: the problems as stories (words) or bare equations (equation: `3 + 4 =`), trained and
    held out alike (unset: the recipe's)."""
    temperature: float | None = None
    """The pools' sampling temperature, which the trainer's logprobs are taken at too (unset: the recipe's)."""
    kl_coef: float | None = None
    """The trainer's KL penalty weight (unset: the recipe's; 0 skips the reference model)."""
    loss: Literal["m2po", "clip"] = "m2po"
    """The policy loss: M2PO (PPO's clip plus the second-moment mask on stale tokens) or plain PPO clipping."""
    max_staleness: int | None = None
    """Most versions a sample may lag the trainer: the broker drops older groups and pools stop leasing
    that far behind (0: synchronous on-policy training); unset: no bound."""
    eval: DemoEvalConfig = field(default_factory=DemoEvalConfig)
    """The evaluator of the first policy (`[demo.eval]`)."""
    full_every: int = 10
    """The trainer also publishes a full snapshot every N versions (0: only v0)."""
    tls: bool = True
    """Gateways and broker serve HTTPS with the run's own CA (RUN_DIR/pki) and every caller presents a
    token of its role; --no-tls: plain HTTP and anonymous services, on loopback only."""
    pools: int | None = None
    """Run only the topology's first N pools (unset: all)."""
    run_dir: str = ""
    """Where logs, stores, weights and the report go (default runs/demo-<timestamp>)."""
    console: bool = True
    """Also serve the web console of the mesh (`deltamesh console`, docs/CONSOLE.md) on loopback, at
    http://127.0.0.1:8790/ when that port is free; --no-console: not."""
    topology: Topology = field(default_factory=default_topology)
    """Regions, links and pools (`[demo.topology]`, or a `[topology]` file given with --topology)."""
    buffered_groups: int | None = None
    """Broker backpressure: groups waiting or leased at most (default: two steps' worth; one step's when
    max_staleness is 0)."""
    start_timeout_s: float = 300.0
    """How long the mesh may take to come up and reach its first trainer step."""
    settle_timeout_s: float = 120.0
    """After the trainer's last step: how long pools may take to serve its final version."""
    stop_grace_s: float = 15.0
    """On stop: how long each service may take to exit before it is killed."""
    poll_s: float = 0.5
    """Period of the monitor's status reads."""

    def __post_init__(self) -> None:
        if self.model not in RECIPES:
            raise ValueError(f"model must be one of {sorted(RECIPES)}, got {self.model!r}")
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"engine must be transformers or vllm, got {self.engine!r}")
        if self.workflow not in WORKFLOW_MODELS:
            raise ValueError(f"workflow must be one of {sorted(WORKFLOW_MODELS)}, got {self.workflow!r}")
        recipe = (CODE_RECIPES if self.workflow in CODE_WORKFLOWS else RECIPES)[self.model]
        for name in ("lr", "group_size", "groups_per_step", "max_new_tokens", "format_reward", "max_digit", "tasks",
                     "temperature", "kl_coef", "wording"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(recipe, name))
        if self.levels is None:
            self.levels = list(recipe.levels)
        if self.eval.every is None:
            self.eval.every = recipe.eval_every if self.tasks == "arithmetic" or self.needs_sandbox else 0
        self._check_eval()
        if self.workflow == "solver_verifier" and self.model == "tiny" and self.max_new_tokens < 2:
            self.max_new_tokens = 2  # the Verifier needs room for a verdict and some feedback
        if self.buffered_groups is None:  # synchronous: one step's groups, made at the version they train
            self.buffered_groups = (1 if self.max_staleness == 0 else 2) * self.groups_per_step
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if min(self.group_size, self.groups_per_step, self.max_new_tokens, self.buffered_groups) < 1:
            raise ValueError("group_size, groups_per_step, max_new_tokens and buffered_groups must be >= 1")
        if not 0 <= self.format_reward < 1:
            raise ValueError(f"format_reward must be in [0, 1), got {self.format_reward}")
        if not 0 <= self.max_digit <= 4:
            raise ValueError(f"max_digit must be in 0..4, got {self.max_digit}")
        if self.full_every < 0:
            raise ValueError(f"full_every must be >= 0, got {self.full_every}")
        if self.pools is not None:
            self.topology = self.topology.with_pools(self.pools)
        if not self.topology.pools:
            raise ValueError("the topology has no pools")
        if min(self.start_timeout_s, self.settle_timeout_s, self.stop_grace_s, self.poll_s) <= 0:
            raise ValueError("start_timeout_s, settle_timeout_s, stop_grace_s and poll_s must be > 0")

    def _check_eval(self) -> None:
        if self.tasks not in ("digit_sum", "arithmetic"):
            raise ValueError(f"tasks must be digit_sum or arithmetic, got {self.tasks!r}")
        if not self.levels or any(lv not in (1, 2, 3, 4, 5) for lv in self.levels):
            raise ValueError(f"levels must name levels among 1..5, got {self.levels}")
        if self.wording not in WORDINGS:
            raise ValueError(f"wording must be {' or '.join(WORDINGS)}, got {self.wording!r}")
        if self.temperature < 0 or self.kl_coef < 0:
            raise ValueError("temperature and kl_coef must be >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or unset, got {self.max_staleness}")
        if self.loss not in ("m2po", "clip"):
            raise ValueError(f"loss must be m2po or clip, got {self.loss!r}")
        if not self.eval.every:
            return
        if self.needs_sandbox and self.code_tasks == "humaneval":
            raise ValueError("the evaluator's held-out set of the code workflows is HumanEval: train on the "
                             "synthetic problems (code_tasks = synthetic) or set eval.every = 0")
        if not self.needs_sandbox and self.tasks != "arithmetic":
            raise ValueError("the evaluator needs a held-out set: tasks = arithmetic (digit sums have none); "
                             "or set eval.every = 0")
        if self.eval.region and self.eval.region not in {g.region for g in self.topology.gateways}:
            raise ValueError(f"eval.region {self.eval.region!r} is not a region of the topology")

    @property
    def eval_temperature(self) -> float:
        return self.temperature if self.eval.temperature is None else self.eval.temperature

    @property
    def model_ids(self) -> tuple[str, ...]:
        return WORKFLOW_MODELS[self.workflow]

    @property
    def needs_sandbox(self) -> bool:
        return self.workflow in CODE_WORKFLOWS

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step

    def run_path(self, now: str) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / f"demo-{now}"

    def workflow_options(self) -> dict[str, Any]:
        if self.workflow == "math":
            return {"format_reward": self.format_reward, **self.math_options()}
        if self.workflow == "solver_verifier" and self.math_options():
            # The Solver asked as the math policy is (and as the evaluator scores it), the Verifier in kind.
            math = self.math_options()
            return {"prompt_format": math["prompt_format"], "solver_prefix": math.get("reply_prefix", ""),
                    "answer": math["answer"], "solver_template": math.get("prompt_template", "{prompt}"),
                    "retry_template": "{prompt}\nYou answered: {answer}\nA reviewer rejected it: {feedback}"}
        if self.model != "tiny":
            return {}
        return dict(TINY_CODE[self.workflow] if self.workflow in CODE_WORKFLOWS else TINY_SOLVER_VERIFIER)

    def math_options(self) -> dict[str, Any]:
        """How the math workflow shows a task and reads its answer: the recipe's, for its task family."""
        recipe = RECIPES[self.model]
        return dict(recipe.math_options) if self.tasks == recipe.tasks else {}

    def eval_workflow(self) -> tuple[str, dict[str, Any]]:
        """The workflow (and its options) the evaluator scores the first policy with: the policy's own
        for math and the code workflows' single-role `code` (HumanEval); for the solver of
        solver_verifier, `math` with the solver's prompt."""
        if self.needs_sandbox:
            return "code", dict(TINY_CODE["code"]) if self.model == "tiny" else {}
        if self.workflow == "math":
            return "math", self.workflow_options()
        return "math", self.math_options()
