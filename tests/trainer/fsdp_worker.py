"""Tiny trainer runs shared by the trainer tests: a random-init tiny Qwen3, fixed batches, and the
two-rank FSDP scenario that `torchrun --nproc-per-node 2` runs from this file.

The test modules load this file by path to run the single-process reference in-process with
exactly the same model, settings and batches that the FSDP ranks build.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from deltamesh.trainer.config import TrainerConfig
from deltamesh.trainer.distributed import SINGLE as SINGLE_CTX
from deltamesh.trainer.loss_inputs import LossInputs

VOCAB = 96
SEQ = 24
PROMPT = 8
ROWS = 8


def tiny_model(seed: int = 0) -> transformers.Qwen3ForCausalLM:
    """A random-init two-layer Qwen3 with tied embeddings (about 60k parameters), in fp32."""
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg).float()


def trainer_config(**overrides) -> TrainerConfig:
    """Settings under which one step visibly moves the tiny model and every loss term is active."""
    cfg = TrainerConfig(seed=0)
    cfg.optim.lr = 1e-3
    cfg.optim.max_grad_norm = 0.05  # small enough that the clip is active
    cfg.loss.m2_threshold = 0.02
    cfg.loss.kl_coef = 0.1
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@torch.no_grad()
def fixed_batches(model: torch.nn.Module, count: int, rows: int = ROWS, seed: int = 1) -> list[LossInputs]:
    """`count` batches of `rows` sequences (groups of 4), with behaviour logprobs a noisy version of
    the model's own and the model's own as the reference, so that M2PO masks some tokens and PPO
    clips some. Right padding on odd rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        attn = torch.ones(rows, SEQ, dtype=torch.int64)
        attn[1::2, SEQ - 5 :] = 0
        loss_mask = torch.zeros(rows, SEQ, dtype=torch.bool)
        loss_mask[:, PROMPT:] = True
        loss_mask &= attn.bool()
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        own = torch.cat([torch.zeros(rows, 1), logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]], 1)
        noise = torch.randn(rows, SEQ, generator=g) * 0.15
        outliers = torch.rand(rows, SEQ, generator=g) < 0.05
        behaviour = own + noise + outliers * 2.0
        out.append(
            LossInputs(
                input_ids=ids,
                loss_mask=loss_mask,
                behaviour_logprobs=behaviour,
                rewards=torch.rand(rows, generator=g),
                group_ids=torch.arange(rows) // 4,
                attention_mask=attn,
                ref_logprobs=own,
            )
        )
    return out


def single_reference(total: int, checkpoint_root: str, checkpoint_at: int) -> tuple[dict, dict, dict]:
    """Single-process run of `total` steps in micro-batches of half the batch (the share each of two
    ranks gets), checkpointing after step `checkpoint_at`. Returns {version: published bf16},
    {version: fp32 master} and {version: optimizer state by parameter name} after each step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from deltamesh.trainer.checkpoint import save_checkpoint
    from deltamesh.trainer.distributed import full_state_dict
    from deltamesh.trainer.step import TrainState, build_optimizer, published_weights, seed_everything, train_step

    cfg = trainer_config(micro_batch_size=ROWS // 2)
    seed_everything(cfg.seed)
    model = tiny_model()
    batches = fixed_batches(model, total)
    state = TrainState(model, build_optimizer(model, cfg.optim))
    published, master, optim = {}, {}, {}
    for batch in batches:
        train_step(state, batch, cfg)
        published[state.version] = published_weights(model)
        master[state.version] = full_state_dict(model, SINGLE_CTX)
        osd = get_optimizer_state_dict(model, state.optimizer, options=StateDictOptions(full_state_dict=True))
        optim[state.version] = {p: {k: v.clone() for k, v in s.items()} for p, s in osd["state"].items()}
        if state.version == checkpoint_at:
            save_checkpoint(checkpoint_root, state)
    return published, master, optim


def fsdp_scenario(out: Path, resume_root: str, total: int, checkpoint_at: int) -> None:
    """On two ranks: train `checkpoint_at` steps from scratch, publish, checkpoint to out/ckpt; take
    one more step on another batch; then resume `resume_root` (the single-process checkpoint at
    version `checkpoint_at`), train on to `total` and publish again. Rank 0 broadcasts the batches."""
    from safetensors.torch import save_file

    from deltamesh.trainer.checkpoint import resume_latest, save_checkpoint
    from deltamesh.trainer.distributed import full_state_dict, init_distributed, shard_model, shutdown
    from deltamesh.trainer.loss_inputs import broadcast_inputs
    from deltamesh.trainer.step import TrainState, build_optimizer, published_weights, seed_everything, train_step

    ctx = init_distributed("gloo")
    cfg = trainer_config()
    seed_everything(cfg.seed)
    model = tiny_model()
    batches = fixed_batches(model, total + 1) if ctx.is_main else [None] * (total + 1)
    if ctx.is_main:
        batches[total].ref_logprobs = None  # a batch without the optional field crosses too
    model = shard_model(model, ctx)
    state = TrainState(model, build_optimizer(model, cfg.optim))

    def train(batch: LossInputs | None) -> None:
        train_step(state, broadcast_inputs(batch, ctx), cfg, ctx)

    for batch in batches[:checkpoint_at]:
        train(batch)
    weights = published_weights(model, ctx)
    master = full_state_dict(model, ctx)
    save_checkpoint(out / "ckpt", state, ctx)
    train(batches[total])
    resume_latest(resume_root, state, ctx)
    resumed_at = state.version
    for batch in batches[checkpoint_at:total]:
        train(batch)
    final = published_weights(model, ctx)
    if ctx.is_main:
        assert weights is not None and master is not None and final is not None
        save_file(weights, out / f"published-v{checkpoint_at}.safetensors")
        save_file(master, out / f"master-v{checkpoint_at}.safetensors")
        save_file(final, out / f"published-v{total}.safetensors")
        (out / "resumed_at").write_text(str(resumed_at))
    shutdown(ctx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume-root", required=True)
    parser.add_argument("--total", type=int, default=5)
    parser.add_argument("--checkpoint-at", type=int, default=3)
    args = parser.parse_args()
    fsdp_scenario(args.out, args.resume_root, args.total, args.checkpoint_at)


if __name__ == "__main__":
    main()
