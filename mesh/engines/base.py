"""The rollout engine interface: what a pool's rollout worker and the workflows may ask of an engine.

An engine serves one model_id. It generates for a batch of token prompts with sampling parameters and
returns, for each prompt, the generated tokens, the behaviour log-probability of each token and the
policy version that produced each token: a generation may straddle a weight swap, and then its early
tokens carry the old version and its later ones the new. Weights change in one of two ways:
`load_version` reloads a whole version from the safetensors directory the pool keeps in sync, and
`apply_update` hot-swaps a version the pool has already verified and decoded once
(`deltamesh.delta.DecodedVersion`, the same object the pool then applies to its directory) into the
live weights, where the engine can (`supports_in_place`). Either way the switch is atomic: the
engine serves the old version or the new one, never a mix, and a failed update leaves the old
version serving, bit for bit.

Behaviour log-probabilities are those of the temperature-scaled distribution (log_softmax of
logits / temperature) before top-p/top-k truncation; this is what SGLang returns and what the trainer
recomputes with its `temperature` setting. With temperature 0 (greedy) they are the model's own.
`TokenizedEngine` is the part of the interface every adapter answers alike (version, tokenizer).

An engine that can read its served weights back (`ReadsBack`) lets the pool prove after every swap
that it serves exactly the version it claims (`deltamesh.mesh.pool.serve_check`); an engine without
it is not checked, and a tensor it cannot read back (digest None) is counted, never taken as wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from deltamesh.delta import DecodedVersion, Grid

FinishReason = Literal["stop", "length"]


class EngineError(RuntimeError):
    """The engine could not do what was asked (server down, bad answer, update refused)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature` 0 means greedy. A generation ends at `max_new_tokens`, at one of
    `stop_token_ids`, or at the model's end-of-sequence tokens unless `ignore_eos` (the token that
    stopped it is kept in the output). `seed` makes one request's sampling reproducible."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Generation:
    """One prompt's result: generated tokens with their behaviour logprobs and producing versions."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    generate_s: float = 0.0
    """Wall time from submission to the last token."""

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"tokens ({len(self.tokens)}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per generated token"
            )


@runtime_checkable
class Engine(Protocol):
    """A rollout engine for one model_id (see the module docstring for the contract)."""

    model_id: str

    @property
    def version(self) -> int:
        """The policy version that the next generated token will come from."""
        ...

    @property
    def supports_in_place(self) -> bool:
        """Whether `apply_update` works (else the pool agent syncs a directory and calls `load_version`)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (its chat template and vocabulary), or None for an engine
        that has none (then prompts are plain text)."""
        ...

    def encode(self, text: str) -> list[int]:
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        ...

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        ...

    async def load_version(self, path: str | Path, version: int) -> None:
        """Serve the full weights in safetensors directory `path` as `version` from the next step on."""
        ...

    async def apply_update(self, version: DecodedVersion) -> None:
        """Apply one decoded delta (onto the version served now) or full snapshot in place; on any
        error the engine still serves what it served before, bit for bit."""
        ...

    async def close(self) -> None:
        ...


@dataclass(frozen=True)
class ServedDigests:
    """What an engine serves at one instant: the version it claims and, per asked checkpoint tensor, the
    xxh3-128 (`deltamesh.delta.tensor_digest`) of that tensor as the engine's forward pass reads it, or
    None where the engine cannot read it back (e.g. a layer repacked into an opaque kernel format)."""

    version: int
    digests: dict[str, str | None]


@runtime_checkable
class ReadsBack(Protocol):
    """An engine that can hash the weights it serves, by checkpoint tensor name."""

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Grid] | None = None) -> ServedDigests:
        """Digests of `names` as served now, never read during an update; a tensor with a hash grid in
        `grids` (a version built in parts: deltamesh.delta.slices) is hashed by its tiles."""
        ...


class TokenizedEngine:
    """The parts of `Engine` that every adapter answers alike from the state it keeps: the served
    `_version`, the model's `_tokenizer` and its end-of-sequence ids `_eos`."""

    _version: int
    _eos: tuple[int, ...]
    _tokenizer: Any

    @property
    def version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(list(tokens), skip_special_tokens=True)
