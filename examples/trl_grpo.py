"""TRL's GRPOTrainer on SmolLM2-135M, its rollouts from a vLLM server that takes every version through deltamesh.

    python examples/trl_grpo.py --steps 3

On this machine it starts what a lab runs in several regions: an origin gateway, a relay gateway (the
rollout region) and a vLLM server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
runs) with `--weight-transfer-config '{"backend": "deltamesh"}'`, all real processes in `--workdir`
(`deltamesh.mesh.vllm_plugin.local_mesh`). TRL's vLLM server mode drives its own NCCL weight transfer,
which names no other backend (and needs CUDA), so the example plugs in where TRL lets it:

- rollouts: a `rollout_func` asks the server's completions API for one sampled completion per prompt
  (TRL repeats each prompt `num_generations` times) with its token ids and logprobs, and notes the
  version the server reports serving (`/weight_info`);
- weights: a `TrainerCallback` hands the trained model, after every optimizer step, to the deltamesh
  trainer engine (`WeightTransferTrainerFactory` with vLLM's own HTTP client), which publishes it as
  the next version through the origin (a signed delta) and has the server take it from the relay.
  Version 0 (the starting weights) is published before the first step.

So step k's rollouts come from version k-1, published after step k-1: the summary (`--summary`, JSON)
lists the versions published and the version each step's rollouts were served from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

log = logging.getLogger("trl_grpo")

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,",
           "My favourite food is", "The best way to learn Python is", "Once upon a time"]


def reward_distinct_words(completions: list[str], **_: Any) -> list[float]:
    """A toy reward: more distinct words, up to ten, in the completion."""
    return [min(len(set(c.split())), 10) / 10 for c in completions]


def make_rollout(server: str, model_dir: str, max_tokens: int, served: list[dict[str, int]]):
    def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        version = int(requests.get(f"{server}/weight_info", timeout=30).json()["weight_version"])
        answer = requests.post(f"{server}/v1/completions", timeout=600, json={
            "model": model_dir, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 1.0,
            "logprobs": 0, "return_tokens_as_token_ids": True})
        answer.raise_for_status()
        choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
        completion_ids = [[int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] for c in choices]
        logprobs = [list(c["logprobs"]["token_logprobs"]) for c in choices]
        served.append({"step": trainer.state.global_step + 1, "version": version})
        log.info("step %d: %d rollouts from v%d", trainer.state.global_step + 1, len(prompts), version)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
    return rollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", default="", help="folder for the gateways, the server and TRL (default: a temporary one)")
    parser.add_argument("--summary", default="", help="write the versions published and served here (JSON)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from deltamesh.logs import setup_logging

    setup_logging()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="trl-grpo-"))
    summary = run(workdir, args.steps, args.max_tokens)
    log.info("published %s; rollouts served from %s", summary["published"],
             [s["version"] for s in summary["served"]])
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary))


def run(workdir: Path, steps: int, max_tokens: int) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from deltamesh.mesh.demo.models import smollm2_model_dir
    from deltamesh.mesh.vllm_plugin.local_mesh import LocalMesh
    from deltamesh.mesh.vllm_plugin.trainer_engine import DeltameshTrainerInitInfo

    started = time.monotonic()
    model_dir = str(smollm2_model_dir())
    published: list[int] = []
    served: list[dict[str, int]] = []
    with LocalMesh(workdir / "mesh", "smollm2") as mesh:
        server = mesh.start_vllm(model_dir, args=["--max-model-len", "512", "--no-enable-prefix-caching"])
        log.info("gateways %s (origin) and %s (relay); vLLM server %s", mesh.origin_url, mesh.relay_url, server)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        load_general_plugins()  # registers the deltamesh backend's trainer side
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltameshTrainerInitInfo(rank=0, publish=mesh.publish_table(full_every=0), engine_init=mesh.engine_init()),
            client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model))

        class PublishEachStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                published.append(engine.send_weights().version)
                log.info("step %d: published v%d, the server serves it", state.global_step, published[-1])

        published.append(engine.send_weights().version)  # the starting weights: step 1's rollouts
        config = GRPOConfig(
            output_dir=str(workdir / "trl"), max_steps=steps, per_device_train_batch_size=4, num_generations=4,
            gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=max_tokens,
            learning_rate=1e-5, beta=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            bf16=False, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_distinct_words, args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            rollout_func=make_rollout(server, model_dir, max_tokens, served), callbacks=[PublishEachStep()])
        trainer.train()
        engine.shutdown()
    return {"published": published, "served": served, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    main()
