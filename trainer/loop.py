"""The trainer loop: long-poll a batch, take one optimizer step, publish the new version, repeat.

`run_training` is what `deltamesh train` runs, single-process or under `torchrun` (then the model is
sharded with FSDP and every rank runs this same loop in step). Per step: rank 0 long-polls the
broker for a batch and hands it to the other ranks; the frozen reference model scores it for the
KL penalty; `train_step` updates the fp32 master weights; the bf16 weights are gathered to rank 0,
which publishes them as the next version in the background (at most one publish in flight) and
reports the version to the broker once it is at the gateway. The trainer therefore waits only on
batches, never on pools or links; on a CPU (`encode_first`) the next step's compute also waits for
the version's encode, which shares its cores, so the version leaves first. Rank 0 also splits the
step's trainer-side mismatch by rollout pool and names a pool whose mismatch jumps
(`deltamesh.trainer.mismatch`, in the step record and the metrics served at `metrics_listen`). Every
`checkpoint.every` versions (and on a clean stop) it checkpoints, after that version's publish has
ended, so a checkpoint never gets ahead of the gateway in a normal run. A restarted trainer resumes
the newest checkpoint and joins the gateway's stream as `deltamesh.trainer.stream_start.start_stream`
describes: versions continue after the gateway's head and the next one is a delta, so the pools keep
following the chain.

Batches are acknowledged to the broker once their update is in a checkpoint (or, without a checkpoint
directory, once the step has applied it): a restart resumes the newest checkpoint, so the batches
trained after it would otherwise be lost with the steps made from them. The broker serves every
unacknowledged batch again once the restarted trainer polls, and the resumed weights train on it.
Each checkpoint names the batches it takes in, and a trainer that resumes it acknowledges them before
its first poll: one that died after a checkpoint but before its acknowledgement reached the broker
does not train on those batches a second time. Each step's record (`metrics_file`) is written before
the checkpoint that takes the step in, with the ids of the trajectories it trained on.

SIGTERM or SIGINT stops the loop cleanly once the current poll or step ends: the last publish is
finished, a final checkpoint written and its batches acknowledged.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import signal
import threading
import time
from typing import Callable

import torch

from deltamesh.data import Batch
from deltamesh.trainer.checkpoint import CheckpointError, resume_latest, save_checkpoint
from deltamesh.trainer.distributed import DistContext, broadcast_tensors, init_distributed, shard_model, shutdown
from deltamesh.trainer.loop_config import TrainLoopConfig
from deltamesh.trainer.loss_inputs import LossInputs, broadcast_inputs, inputs_from_batch
from deltamesh.trainer.metrics import TrainerMetrics
from deltamesh.trainer.mismatch import MismatchWatch, PoolMismatch, pool_mismatch
from deltamesh.trainer.models import load_causal_lm
from deltamesh.trainer.step import (
    TrainState,
    batch_logprobs,
    build_optimizer,
    seed_everything,
    train_step,
)
from deltamesh.trainer.step_log import StepLog, step_record
from deltamesh.trainer.version_stream import VersionStream

log = logging.getLogger(__name__)


def run_training(cfg: TrainLoopConfig) -> int:
    """Run the trainer until `max_steps` or a stop signal; returns the process exit code."""
    ctx = init_distributed()
    stop = threading.Event()
    restore = _stop_on_signals(stop)
    try:
        _train(cfg, ctx, stop)
    finally:
        restore()
        shutdown(ctx)
    return 0


def _stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    def request_stop(signum: int, frame: object) -> None:
        log.info("signal %d: stopping after the current step", signum)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def resolve_device(name: str, ctx: DistContext) -> torch.device:
    """"auto" picks the rank's GPU when CUDA is present (init_distributed has set it), else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _share_int(value: int | None, ctx: DistContext) -> int:
    """Rank 0's integer on every rank."""
    sent = broadcast_tensors(
        {"v": torch.tensor([value if value is not None else 0], dtype=torch.int64)} if ctx.is_main else None,
        {"v": torch.int64}, ctx)["v"]
    assert sent is not None
    return int(sent[0])


def pad_rows(inputs: LossInputs, multiple: int) -> LossInputs:
    """Pad a batch with inert rows up to a multiple of `multiple` rows, so it splits evenly over ranks.

    A padding row holds one attended token and no loss token, in a group of its own (advantage 0),
    so it changes neither the loss nor the gradient (with `batch_normalize` on, the batch-wide
    advantage statistics do see its zero).
    """
    extra = -inputs.rows % multiple
    if extra == 0:
        return inputs
    width = inputs.input_ids.shape[1]

    def grow(t: torch.Tensor | None, fill: float | int | bool) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype)])

    attention = inputs.attention_mask
    if attention is None:
        attention = torch.ones(inputs.input_ids.shape, dtype=torch.int64)
    pad_attention = torch.zeros(extra, width, dtype=torch.int64)
    pad_attention[:, 0] = 1
    first_group = int(inputs.group_ids.max()) + 1 if inputs.rows else 0
    return LossInputs(
        input_ids=grow(inputs.input_ids, 0),
        loss_mask=grow(inputs.loss_mask, False),
        behaviour_logprobs=grow(inputs.behaviour_logprobs, 0.0),
        rewards=grow(inputs.rewards, 0.0),
        group_ids=torch.cat([inputs.group_ids, first_group + torch.arange(extra)]),
        attention_mask=torch.cat([attention, pad_attention]),
        ref_logprobs=grow(inputs.ref_logprobs, 0.0),
        versions=grow(inputs.versions, -1),
    )


def _build_models(cfg: TrainLoopConfig, ctx: DistContext) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The fp32 model to train and, for the KL penalty, a frozen copy of the initial weights."""
    device = resolve_device(cfg.device, ctx)
    model = load_causal_lm(cfg.model, dtype=torch.float32, device=str(device))
    reference = None
    if cfg.reference and cfg.loss.kl_coef > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
        reference = shard_model(reference, ctx)
    return shard_model(model, ctx), reference


def _judge_mismatch(watch: MismatchWatch, state: TrainState, batch: Batch, trained_on: int
                    ) -> dict[str, PoolMismatch]:
    """The step's per-pool mismatch on the batch's rows (padding rows dropped), judged by `watch`."""
    if state.row_mismatch is None:
        return {}
    pools = [str(s.get("pool", "")) for s in batch.samples]
    return watch.observe(trained_on, pool_mismatch(state.row_mismatch[: len(batch)], pools))


def _train(cfg: TrainLoopConfig, ctx: DistContext, stop: threading.Event) -> None:
    seed_everything(cfg.seed)
    model, reference = _build_models(cfg, ctx)
    state = TrainState(model, build_optimizer(model, cfg.optim))
    ckpt = cfg.checkpoint
    resumed_unacked: list[str] = []  # batches in the resumed checkpoint whose acknowledgement may not have reached the broker
    if ckpt.dir is None:
        log.warning("no checkpoint directory: a restarted trainer starts again from %s", cfg.model)
    else:
        meta = resume_latest(ckpt.dir, state, ctx)
        if meta is None:
            log.info("no checkpoint under %s: starting from %s", ckpt.dir, cfg.model)
        elif meta["extra"].get("model_id", cfg.model_id) != cfg.model_id:
            raise CheckpointError(f"{ckpt.dir} holds checkpoints of {meta['extra']['model_id']!r}, "
                                  f"not of {cfg.model_id!r}")
        else:
            resumed_unacked = [str(b) for b in meta["extra"].get("unacked", [])]
    checkpointed = state.version
    encode_first = cfg.encode_first == "on" or (cfg.encode_first == "auto" and
                                                 resolve_device(cfg.device, ctx).type == "cpu")

    records = watch = None
    if ctx.is_main:
        records = StepLog(cfg.metrics_file)
        served = TrainerMetrics()
        watch = MismatchWatch(cfg.mismatch, cfg.model_id, served)
    stream = VersionStream(cfg, ctx, model, on_published=records.published if records is not None else None)
    client = stream.client
    try:
        if client is not None and cfg.metrics_listen:
            log.info("%s: metrics at %s/metrics", cfg.model_id, client.serve_metrics(served.registry,
                                                                                     cfg.metrics_listen))
        counter = stream.start(state.version, stop)
        if counter is None:
            return
        state.version = counter
        if client is not None and resumed_unacked:
            client.ack(resumed_unacked)  # before the first poll, which would have them served again
        steps = 0
        trained: list[str] = []  # batches trained on since the last checkpoint, not yet acknowledged
        while cfg.max_steps is None or state.step < cfg.max_steps:
            poll_start = time.monotonic()
            batch = None
            if client is not None and not stop.is_set():
                batch = client.next_batch(cfg.batch_size, cfg.poll_s, stop)
            if not _share_int(int(batch is not None), ctx):
                break
            wait_s = time.monotonic() - poll_start
            # The version's encode has the cores first (TrainLoopConfig.encode_first): a publish stall.
            encode_wait_s = stream.wait_encoded() if encode_first else 0.0
            trained_on = state.version
            inputs = broadcast_inputs(None if batch is None else pad_rows(inputs_from_batch(batch), ctx.world_size),
                                      ctx)
            if reference is not None:
                inputs = dataclasses.replace(inputs, ref_logprobs=batch_logprobs(reference, inputs, cfg, ctx))
            metrics = train_step(state, inputs, cfg, ctx)
            step_end = time.time()  # wall clock: the publish stages it starts are compared across processes
            if batch is not None:
                trained.append(batch.batch_id)
            train_s = time.monotonic() - poll_start - wait_s - encode_wait_s
            steps += 1
            stall_s = encode_wait_s + stream.publish(state.version, {"step_end": step_end})
            if client is not None and records is not None and batch is not None:
                # Recorded before the checkpoint that takes the step in: the step records show every step
                # whose update a checkpoint holds (a restart redoes those after its checkpoint).
                assert watch is not None
                mismatch = _judge_mismatch(watch, state, batch, trained_on)
                step_s = time.monotonic() - poll_start
                client.report_step(wait_s, step_s)
                records.add(step_record(step=state.step, version=state.version, batch=batch, metrics=metrics,
                                        trained_on=trained_on, wait_s=wait_s, train_s=train_s, stall_s=stall_s,
                                        step_s=step_s, mismatch=mismatch))
            if ckpt.dir is not None and state.version % ckpt.every == 0:
                if client is not None:
                    client.wait_published()  # a checkpoint must not get ahead of the gateway
                # The batches it takes in go with it: a restart from it acknowledges them before it
                # polls, so a kill between this checkpoint and their acknowledgement trains none twice.
                save_checkpoint(ckpt.dir, state, ctx, keep=ckpt.keep, extra={"model_id": cfg.model_id,
                                                                              "unacked": trained})
                checkpointed = state.version
            if client is not None and trained and (ckpt.dir is None or checkpointed == state.version):
                client.ack(trained)  # their updates are now as safe as this trainer can make them
                trained = []
        stream.wait_published()
        if ckpt.dir is not None and steps and checkpointed != state.version:
            save_checkpoint(ckpt.dir, state, ctx, keep=ckpt.keep, extra={"model_id": cfg.model_id, "unacked": trained})
        if client is not None and trained:
            client.ack(trained)
        log.info("%s: stopped at step %d, version %d (%d steps this run)", cfg.model_id, state.step, state.version,
                 steps)
    finally:
        stream.close()
