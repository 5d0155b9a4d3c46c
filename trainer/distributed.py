"""Multi-rank training: process-group set-up, FSDP2 sharding and the few collectives the step needs.

A trainer started by `torchrun --nproc-per-node N` shards its model over the N ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`; gloo on CPU, NCCL on GPUs) and splits each batch's sequences
evenly over them; a plain `python` start is a single process and every helper here is a no-op then,
so the same step code serves both. Gradients are summed across ranks, never averaged: the loss is
already normalised over the whole batch's tokens, so the sum is the single-process gradient. Only
rank 0 ends up with the full weights that get published and checkpointed. Two ranks reproduce a
single process that trains in micro-batches of half the batch bit for bit (a sum of two is the same
in either order); with more ranks the collective's summation order may differ in the last bits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from deltamesh.delta.cuts import TensorSpec

log = logging.getLogger(__name__)

# Broadcast headers describe a tensor of at most this many dimensions.
_MAX_DIMS = 4


@dataclass(frozen=True)
class DistContext:
    """Which rank this process is out of how many; world_size 1 means no process group."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def row_range(self, rows: int) -> tuple[int, int]:
        """This rank's contiguous share [start, stop) of a batch of `rows` sequences (equal shares)."""
        if rows % self.world_size:
            raise ValueError(f"a batch of {rows} sequences does not split evenly over {self.world_size} ranks")
        share = rows // self.world_size
        return self.rank * share, (self.rank + 1) * share


SINGLE = DistContext()


def init_distributed(backend: str | None = None) -> DistContext:
    """Join the process group that torchrun describes in the environment, or run single-process.

    The backend defaults to NCCL when CUDA is available and gloo otherwise; on GPUs each rank uses
    the device LOCAL_RANK.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    log.info("rank %d of %d joined the process group (%s)", ctx.rank, ctx.world_size, backend)
    return ctx


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (no-op single-process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: nn.Module, ctx: DistContext, block_classes: Iterable[str] | None = None) -> nn.Module:
    """Shard `model` over the ranks with FSDP2: one unit per transformer block, plus the root.

    Blocks are the module classes named `block_classes`, by default those in the Hugging Face
    model's `_no_split_modules` (every HF causal LM names its decoder layer there). Tied embeddings
    stay together in the root unit. Returns the model itself (sharded in place); single-process it
    is returned untouched.
    """
    if not ctx.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (ctx.world_size,))
    if block_classes is None:
        block_classes = model._no_split_modules or ()
    names = set(block_classes)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in (*blocks, model):
        # Sum, not average: each rank's loss is already divided by the whole batch's token count.
        unit.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
        unit.set_force_sum_reduction_for_comms(True)
    log.info("sharded %s over %d ranks (%d blocks)", type(model).__name__, ctx.world_size, len(blocks))
    return model


def comm_device(ctx: DistContext) -> torch.device:
    """Where collective buffers must live: the rank's GPU under NCCL, else the CPU."""
    if ctx.distributed and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `t` over the ranks in place and return it."""
    if not ctx.distributed:
        return t
    device = comm_device(ctx)
    if t.device == device:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    else:
        buf = t.to(device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        t.copy_(buf)
    return t


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a dim of `rows` that FSDP2's even sharding (torch.chunk: shares of
    ceil(rows / world), the last ones shorter or empty) gives `rank` of `world`."""
    share = -(-rows // world) if rows else 0
    return min(rank * share, rows), min((rank + 1) * share, rows)


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 of a (possibly FSDP2-sharded) tensor that this rank holds; a
    plain tensor is held whole (a 0-d tensor: its one "row")."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return (0, t.shape[0]) if t.dim() else (0, 1)
    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"a tensor sharded as {placements} is not one dim-0 shard per rank")
    mesh = t.device_mesh
    return shard_rows(t.shape[0], mesh.size(), mesh.get_local_rank())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP-sharded) tensor; a plain tensor is its own shard."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor; a collective that every rank must call in step."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(
    model: nn.Module, ctx: DistContext, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """The model's full state on CPU, on rank 0 (None on the other ranks, which must call it too).

    Floating tensors are cast to `dtype` if given (on their device, before the copy to CPU). A
    tensor reachable under several names (tied input and output embeddings) appears once, under its
    first name, as Hugging Face checkpoints store it.
    """
    out: dict[str, torch.Tensor] | None = {} if ctx.is_main else None
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        whole = full_tensor(t.detach())
        if out is not None:
            target = dtype if dtype is not None and whole.is_floating_point() else whole.dtype
            # A snapshot: it must not alias the live parameters that the next step updates.
            out[name] = whole.to("cpu", target, copy=whole.device.type == "cpu" and target == whole.dtype)
    return out


def local_state(model: nn.Module, dtype: torch.dtype | None = None
                ) -> tuple[list[TensorSpec], dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """This rank's share of the model's state, with no collective: the whole model's tensor table (name,
    dtype, whole shape; sorted), a CPU copy of the rows this rank holds of each tensor (floating ones
    cast to `dtype`), and which rows they are. Tied tensors appear once, under their first name."""
    from deltamesh.delta.dtypes import DTYPE_NAMES

    table, local, rows = [], {}, {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        t = t.detach()
        mine = local_tensor(t)
        target = dtype if dtype is not None and mine.is_floating_point() else mine.dtype
        # A snapshot: it must not alias the live parameters that the next step updates.
        local[name] = mine.to("cpu", target, copy=True).contiguous()
        rows[name] = local_rows(t)
        table.append(TensorSpec(name, DTYPE_NAMES[target], tuple(t.shape)))
    return sorted(table, key=lambda s: s.name), local, rows


def broadcast_tensors(
    tensors: Mapping[str, torch.Tensor | None] | None,
    dtypes: Mapping[str, torch.dtype],
    ctx: DistContext,
) -> dict[str, torch.Tensor | None]:
    """Send rank 0's named tensors (each optional, of the dtype `dtypes` names) to every rank.

    Rank 0 passes the tensors, the others pass None. Shapes travel first in a fixed-size header so
    the receivers can allocate; booleans travel as bytes.
    """
    names = list(dtypes)
    if not ctx.distributed:
        if tensors is None:
            raise ValueError("single-process broadcast needs the tensors")
        return {n: tensors.get(n) for n in names}
    header = torch.zeros(len(names), 2 + _MAX_DIMS, dtype=torch.int64)
    if ctx.is_main:
        if tensors is None:
            raise ValueError("rank 0 must pass the tensors to broadcast")
        for i, n in enumerate(names):
            t = tensors.get(n)
            if t is None:
                continue
            if t.dim() > _MAX_DIMS:
                raise ValueError(f"{n}: cannot broadcast a {t.dim()}-d tensor")
            header[i, 0], header[i, 1] = 1, t.dim()
            header[i, 2 : 2 + t.dim()] = torch.tensor(t.shape)
    device = comm_device(ctx)
    header = header.to(device)
    dist.broadcast(header, src=0)
    header = header.cpu()
    out: dict[str, torch.Tensor | None] = {}
    for i, n in enumerate(names):
        if not header[i, 0]:
            out[n] = None
            continue
        shape = header[i, 2 : 2 + int(header[i, 1])].tolist()
        wire = torch.uint8 if dtypes[n] == torch.bool else dtypes[n]
        if ctx.is_main:
            buf = tensors[n].detach().to(device, wire).contiguous()  # type: ignore[index]
        else:
            buf = torch.empty(shape, dtype=wire, device=device)
        dist.broadcast(buf, src=0)
        out[n] = buf.to("cpu", dtypes[n])
    return out
