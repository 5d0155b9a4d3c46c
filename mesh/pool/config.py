"""Typed settings of a rollout pool (`deltamesh pool run --config FILE`, table `[pool]`).

A pool serves one or more policies (model_ids), each with its own engine and its own weight stream
from the region's gateway, and runs one workflow over the tasks it leases from the broker. `[pool]`
holds what the pool is (name, broker, engine, where weights live) and has four sections:
`[pool.sync]` how each weight stream follows the gateways (`WeightSyncSettings`, shared with
`deltamesh pool sync`), `[pool.worker]` how the rollout worker leases, runs and submits,
`[pool.sampling]` how the engines sample, and `[pool.sandbox]` where code workflows run
model-written code (`SandboxConfig`, docs/SANDBOX.md); `[[pool.models]]` lists the policies. Flags derived from
these fields override the file; every value is checked here, so a bad setting fails at start-up
naming the key. A single-policy pool needs no file: `--model PATH` (and optionally `--model-id`)
describe its one policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deltamesh.config import http_url, http_urls
from deltamesh.config_flags import flag
from deltamesh.http import parse_listen
from deltamesh.mesh.pool.sync_config import WeightSyncSettings
from deltamesh.mesh.sandbox import SandboxConfig


@dataclass
class PolicyConfig:
    """One policy the pool serves: its model_id and where its engine starts from."""

    model_id: str = ""
    """Empty: the one model the gateway serves (only for a single-policy pool)."""
    model_path: str = ""
    """A Hugging Face model directory (config and tokenizer; its weights are replaced by the synced
    version before the pool generates). The SGLang engine launches its server from it unless
    `engine_url` attaches to a running one, and reads its tokenizer from it."""
    engine_url: str = ""
    """SGLang only: base URL of a running SGLang server to attach to."""
    engine_port: int = 30000
    """SGLang only: port of the server the pool launches (when `engine_url` is empty)."""

    def __post_init__(self) -> None:
        if self.engine_url:
            self.engine_url = http_url(self.engine_url, "engine_url")
        if not 0 < self.engine_port < 65536:
            raise ValueError(f"engine_port {self.engine_port} out of range")


@dataclass
class SamplingConfig:
    """How the pool samples (see `deltamesh.mesh.engines.base.SamplingParams`)."""

    max_new_tokens: int = 256
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this (1: all)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token up to max_new_tokens."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0")


@dataclass
class WorkerConfig:
    """The rollout worker: which workflow it runs, and how it leases tasks and submits trajectories."""

    workflow: str = field(default="math", metadata=flag("--workflow"))
    """Workflow name: math, solver_verifier, code, tool_use, solver_selector, solver_testgen, or module:SPEC."""
    workflow_options: dict[str, Any] = field(default_factory=dict)
    """The workflow's options (a table in the file)."""
    roles: dict[str, str] = field(default_factory=dict, metadata=flag("--role", metavar="ROLE=MODEL_ID"))
    """Workflow role -> model_id. A role left out is played by the model_id of the same name, or by
    the only policy when there is one."""
    max_staleness: int | None = None
    """Stop leasing while a policy's engine is more than this many versions behind the newest version
    known (the trainer's, as the broker reports it, or the gateway's head); unset: no bound."""
    lease_batch: int = 4
    """Most tasks asked for in one lease request."""
    max_episodes: int = 8
    """Episodes run at once; their generate calls are merged into shared engine batches."""
    idle_s: float = 0.5
    """Pause before asking again when the broker had no task (or the pool may not lease)."""
    broker_refresh_s: float = 1.0
    """How often the trainer versions are read from the broker for the staleness bound."""
    drain_s: float = 30.0
    """On stop: how long running episodes may take to finish and submit (unfinished leases expire)."""
    ledger: str = field(default="", metadata=flag(metavar="PATH"))
    """A file each acknowledged submission is appended to, as one JSON line (time, lease id, trajectory
    ids): the pool's record of what the broker acknowledged, to check the broker's records against;
    empty: none."""

    def __post_init__(self) -> None:
        if not self.workflow:
            raise ValueError("worker.workflow must name a workflow")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("worker.max_staleness must be >= 0")
        if min(self.lease_batch, self.max_episodes) < 1:
            raise ValueError("worker.lease_batch and worker.max_episodes must be >= 1")
        if self.drain_s < 0:
            raise ValueError("worker.drain_s must be >= 0")
        if min(self.idle_s, self.broker_refresh_s) <= 0:
            raise ValueError("worker.idle_s and worker.broker_refresh_s must be > 0")


@dataclass
class ServeCheckConfig:
    """The check after every swap that the engine serves exactly the version it claims (docs/PROOF.md)."""

    enabled: bool = True
    """Off: the pool trusts its engine's update calls (only for an engine that cannot read its weights back)."""
    rotation: int = 4
    """Every tensor of the model is read back at least once every `rotation` checks, touched or not."""

    def __post_init__(self) -> None:
        if self.rotation < 1:
            raise ValueError(f"rotation must be >= 1, got {self.rotation}")


@dataclass
class PoolConfig:
    """Everything `deltamesh pool run` needs: the pool itself, its policies, and its three sections."""

    sync: WeightSyncSettings
    """How each policy's weight stream follows the region's gateways (`[pool.sync]`)."""
    name: str = ""
    """Pool name (registered with the gateway and the broker)."""
    broker: str = field(default="", metadata=flag(metavar="URL[,URL...]"))
    """Base URL of the dataflow broker, or of its active and standby brokers separated by commas
    (`http://a:8700,http://b:8700`): calls fail over between them."""
    broker_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_BROKER_TOKEN"))
    """Bearer token for the broker (`deltamesh tokens add --role pool --name NAME`); empty for an anonymous broker."""
    dir: str = "pool-weights"
    """Root of the synced weights: each policy's directory is DIR/<model_id>, kept at the gateway's
    head atomically; a restarted pool resumes from it without downloading what it already holds."""
    region: str = ""
    """Region name; empty: the region of the first gateway that answers."""
    engine: Literal["transformers", "sglang", "vllm"] = "transformers"
    """The inference engine of every policy (vllm: in process, `pip install deltamesh[vllm]`)."""
    tensor_parallel_size: int = 1
    """vLLM engine only: its tensor-parallel ranks. Above 1, one worker process per rank, each holding and
    checking only its own share of the weights (`VLLMRanksEngine`, docs/ENGINES.md); each version is
    reloaded from the synced directory, rank by rank."""
    device: str = "cpu"
    """Transformers engine: where the model runs ("cpu", "cuda", "cuda:1")."""
    threads: int = 0
    """Torch CPU threads of this process (0: torch's default)."""
    seed: int | None = None
    """Seed of the transformers engine's sampling (unset: random, so pools do not sample alike)."""
    hot_swap: bool = True
    """Apply new versions into a live transformers engine in place; off reloads every version from
    the synced directory (what an engine without hot swap does)."""
    listen: str = field(default="127.0.0.1:0", metadata=flag(metavar="HOST:PORT"))
    """The pool's own status and /metrics server (port 0: any free port)."""
    advertise: str = field(default="", metadata=flag(metavar="URL"))
    """The status server's URL as the gateway should reach it (its RTT probes); default: the listen address."""
    batch_window_s: float = 0.005
    """How long the transformers engine's batcher waits for more generate calls to join a batch (0: no
    merging)."""
    max_batch: int = 64
    """Most prompts one engine batch decodes together."""
    prefill_chunk_tokens: int = 128
    """Transformers engine: prompt tokens per prefill pass (0: a batch's prompts in one pass). A new
    version lands between two passes, so a long prefill does not hold it back."""
    models: list[PolicyConfig] = field(default_factory=list)
    """The policies served (`[[pool.models]]`; on the command line `--model` / `--model-id`)."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """The rollout worker (`[pool.worker]`)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the engines sample (`[pool.sampling]`)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where the code workflows run model-written code (`[pool.sandbox]`); built only for those."""
    check: ServeCheckConfig = field(default_factory=ServeCheckConfig)
    """The check after every swap of what each engine serves (`[pool.check]`, docs/PROOF.md)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name is required")
        self.broker = http_urls(self.broker, "broker")
        if not self.models:
            raise ValueError("models must describe at least one policy (or give --model)")
        ids = [m.model_id for m in self.models]
        if len(self.models) > 1 and (not all(ids) or len(set(ids)) != len(ids)):
            raise ValueError(f"a pool of several policies needs distinct model_ids, got {ids}")
        for m in self.models:
            if self.engine in ("transformers", "vllm") and not m.model_path:
                raise ValueError(f"policy {m.model_id or '(default)'}: the {self.engine} engine needs model_path")
            if self.engine == "sglang" and not (m.model_path or m.engine_url):
                raise ValueError(f"policy {m.model_id or '(default)'}: the SGLang engine needs model_path or engine_url")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs engine \"vllm\" (the {self.engine} "
                             "engine runs in one process)")
        unknown = sorted(set(self.worker.roles.values()) - set(ids))
        if unknown:
            raise ValueError(f"worker.roles name model_ids the pool does not serve: {unknown}")
        parse_listen(self.listen)
        if self.advertise:
            self.advertise = http_url(self.advertise, "advertise")
        if self.max_batch < 1 or self.threads < 0 or self.batch_window_s < 0 or self.prefill_chunk_tokens < 0:
            raise ValueError("max_batch must be >= 1, threads, batch_window_s and prefill_chunk_tokens >= 0")

    def policy_dir(self, model_id: str) -> Path:
        """The synced weights directory of one policy."""
        return Path(self.dir) / model_id

    def registration_name(self, model_id: str) -> str:
        """The name each policy's weight stream registers with at the gateway: the pool's name, with
        the model_id appended when the pool serves several (the registry keeps one model per name)."""
        return self.name if len(self.models) == 1 else f"{self.name}.{model_id}"
