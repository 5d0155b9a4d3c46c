"""Typed settings of the evaluator (`deltamesh eval --config FILE`, table `[eval]`).

The evaluator follows a gateway as a pool does (`EvalConfig` extends the pools' `WeightSyncSettings`:
gateways, token, trusted keys, TLS), so its own fields sit beside those: which policy it scores and
with what engine, which versions (`every` k-th, and any asked for), on which held-out set
(`[eval.heldout]`), with how many samples per problem (`samples`, the n of avg@n) and how it samples
(`[eval.sampling]`), which workflow scores an answer (the one the policy trains with, and its
options), where its results live (`db`) and who may read them or ask for more (`listen`,
`tokens_file`/`anonymous`). Its `tls` is both its TLS towards the gateways and its own server's (a
certificate it serves with and presents, the CA it verifies peers with, `client_ca` for mTLS
callers). Every value is checked here, so a bad one fails at start-up naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deltamesh.config_flags import flag
from deltamesh.http import parse_listen
from deltamesh.mesh.pool.config import SamplingConfig, ServeCheckConfig
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.sandbox import SandboxConfig
from deltamesh.mesh.workflows.arithmetic import LEVELS, WORDINGS, Wording


@dataclass
class HeldoutConfig:
    """The held-out problems every scored version answers (`[eval.heldout]`)."""

    family: Literal["arithmetic", "humaneval", "synthetic_code"] = "arithmetic"
    """arithmetic: the held-out split of the arithmetic word problems (mesh/workflows/arithmetic.py),
    never in a training set drawn by `train_tasks` with the same split; humaneval: HumanEval's problems,
    the held-out set of the code workflows (which then train on the synthetic set); synthetic_code: the
    8 in-repo code problems (only for tests: they are a training set too)."""
    problems: int = 40
    """How many problems (arithmetic: spread evenly over `levels`; code: the first N)."""
    levels: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Arithmetic: the difficulty levels asked (1..5)."""
    split_seed: int = 0
    """Arithmetic: the key of the train/held-out split (the trainer's task set must use the same)."""
    heldout_percent: int = 20
    """Arithmetic: the share of each level's problems held out."""
    wording: Wording = "words"
    """Arithmetic: the problems as stories (words) or as bare equations (equation: `3 + 4 =`); the
    trainer's task set must use the same."""

    def __post_init__(self) -> None:
        if self.family not in ("arithmetic", "humaneval", "synthetic_code"):
            raise ValueError(f"heldout.family must be arithmetic, humaneval or synthetic_code, got {self.family!r}")
        if self.problems < 1:
            raise ValueError(f"heldout.problems must be >= 1, got {self.problems}")
        if not self.levels or any(lv not in LEVELS for lv in self.levels):
            raise ValueError(f"heldout.levels must name levels among {list(LEVELS)}, got {self.levels}")
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout.heldout_percent must be in 1..99, got {self.heldout_percent}")
        if self.wording not in WORDINGS:
            raise ValueError(f"heldout.wording must be one of {list(WORDINGS)}, got {self.wording!r}")


@dataclass
class EvalConfig(WeightSyncSettings):
    """One evaluator: the gateways it follows (inherited), the policy it scores and how."""

    name: str = "eval"
    """Its name at the gateway (it registers as a pool of tier `eval`, with a pool token of this name)."""
    model_id: str = field(default="", metadata=flag(metavar="ID"))
    """The policy scored."""
    model_path: str = field(default="", metadata=flag("--model", metavar="PATH"))
    """A Hugging Face model directory of the policy's architecture (config, tokenizer) the engine starts from."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """The engine that generates the answers (vllm: in process, `pip install deltamesh[vllm]`)."""
    device: str = "cpu"
    """Where the transformers engine runs ("cpu", "cuda")."""
    threads: int = 0
    """Torch CPU threads of this process (0: torch's default)."""
    seed: int | None = 0
    """Seed of the engine's sampling."""
    dir: str = "eval-weights"
    """The synced weights of the version being scored (kept like a pool's, so a restart resumes)."""
    db: str = field(default="eval.db", metadata=flag(metavar="PATH"))
    """SQLite file of the results: one row per scored version (version, weights hash, accuracy)."""
    every: int = 5
    """Score version 0 and every version that is a multiple of this, in order (0: only versions asked for)."""
    samples: int = 4
    """Samples per problem: a version's score is avg@samples, the mean correctness over all of them."""
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)
    """The held-out set (`[eval.heldout]`)."""
    workflow: str = "math"
    """The workflow whose episode generates and scores an answer (single-role: math or code)."""
    workflow_options: dict[str, Any] = field(default_factory=dict)
    """Its options: the same as the pools' ([pool.worker] workflow_options), so answers are read alike."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How answers are sampled (`[eval.sampling]`): the temperature of avg@n and the answer length."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where a code workflow's answers run (`[eval.sandbox]`, docs/SANDBOX.md); built only for those."""
    check: ServeCheckConfig = field(default_factory=ServeCheckConfig)
    """The check after every swap that the engine serves the version it claims (`[eval.check]`); a
    version is scored only once its check passed."""
    max_batch: int = 64
    """Most prompts one engine batch decodes together."""
    listen: str = field(default="127.0.0.1:0", metadata=flag(metavar="HOST:PORT"))
    """The evaluator's server: results (`GET /v1/evals`), requests for a version (`POST /v1/evals`),
    `/metrics` and `/healthz`."""
    tokens_file: str = field(default="", metadata=flag(metavar="TOML"))
    """Who may call its routes (`deltamesh tokens add`): admin reads results and asks for versions,
    metrics reads results and `/metrics`."""
    anonymous: bool = False
    """Serve without authentication: only on an address no one else can reach."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name:
            raise ValueError("name is required")
        if not self.model_id:
            raise ValueError("model_id (the policy scored) is required")
        if not self.model_path:
            raise ValueError("model_path (the model directory the engine starts from) is required")
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"engine must be transformers or vllm, got {self.engine!r}")
        if self.every < 0 or self.samples < 1 or self.max_batch < 1 or self.threads < 0:
            raise ValueError("every must be >= 0, samples and max_batch >= 1, threads >= 0")
        if not self.db or not self.dir:
            raise ValueError("db and dir must be set")
        parse_listen(self.listen)
        if self.tokens_file and self.anonymous:
            raise ValueError("tokens_file and anonymous exclude each other")
        if not (self.tokens_file or self.tls.client_ca or self.anonymous):
            raise ValueError("the evaluator's server needs a tokens file (tokens_file) or client certificates "
                             "(client_ca), or anonymous = true for an address no one else can reach")
