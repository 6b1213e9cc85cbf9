"""Process group, device and batch arithmetic for single-process and torchrun (DDP) training.

torchrun sets RANK / LOCAL_RANK / WORLD_SIZE (tngram.common.get_dist_info); with world_size > 1
we join the default process group with NCCL on CUDA and gloo on CPU. A plain `python` run is
rank 0 of 1 and runs the same code with every collective skipped.

Batch arithmetic (as in train_gpt.py): a recipe fixes the global batch in tokens and the
micro-batch in sequences per process; gradient accumulation is derived so that

    global_batch_tokens = world_size * grad_accum_steps * micro_batch_seqs * seq_len

and 1 process with accumulation k*w sees the same data and takes the same steps as w processes
with accumulation k (the loader gives micro-step i of 1 process the data of rank i of w).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tngram.common import TngramError, get_dist_info
from tngram.memory.base import builds_row_sparse_grads


@dataclass(frozen=True)
class DistContext:
    ddp_rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when world_size == 1
    owns_group: bool  # we created the process group (and destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.ddp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0, flag: str = "run.device") -> torch.device:
    """The one device rule (training, evaluation, sampling): "auto" -> cuda:LOCAL_RANK when CUDA is
    available, else cpu; "cuda" -> cuda:LOCAL_RANK; "cuda:N" and "cpu" as given; "mps" (Apple GPU)
    when torch has it. Anything else, or a device this torch cannot use, is a one-line error naming
    `flag` (the config key or command-line flag the name came from)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if not (name in ("cpu", "mps") or (name.startswith("cuda:") and name[5:].isdigit())):
        raise TngramError(f"{flag} must be auto, cpu, cuda, cuda:N or mps, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TngramError(f"{flag} is {name!r} but CUDA is not available (use cpu)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TngramError(f"{flag} is 'mps' but this torch has no MPS device (use cpu)")
    return device


def init_distributed(device_name: str = "auto") -> DistContext:
    """Join torchrun's process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU)."""
    info = get_dist_info()
    device = resolve_device(device_name, info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.world_size == 1:
        return DistContext(0, 0, 1, device, None, owns_group=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend=backend)
    return DistContext(info.ddp_rank, info.local_rank, info.world_size, device, backend, owns)


def shutdown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def grad_accum_steps(
    global_batch_tokens: int, micro_batch_seqs: int, seq_len: int, world_size: int
) -> int:
    """Micro-steps per optimiser step; TngramError unless the global batch divides evenly."""
    per_micro = world_size * micro_batch_seqs * seq_len
    if global_batch_tokens % per_micro:
        raise TngramError(
            f"data.global_batch_tokens ({global_batch_tokens}) must be a multiple of world_size x "
            f"data.micro_batch_seqs x model.sequence_len = {world_size} x {micro_batch_seqs} x "
            f"{seq_len} = {per_micro}; change data.micro_batch_seqs or the number of processes"
        )
    return global_batch_tokens // per_micro


def all_reduce_mean(t: Tensor, ctx: DistContext) -> Tensor:
    """Mean over processes (in place); identity for a single process."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= ctx.world_size
    return t


def all_true(flag: bool, ctx: DistContext) -> bool:
    """True on every process iff `flag` is True on every process."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([0 if flag else 1], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t) == 0


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def broadcast_str(value: str | None, ctx: DistContext) -> str | None:
    """Rank 0's string (or None) on every process."""
    if not ctx.distributed:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel around `model` when world_size > 1, else the model itself."""
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    sparse = {id(p) for p in sparse_grad_params(model)}
    if sparse:  # row-sparse tables: DDP leaves them alone, sync_sparse_grads all-gathers the rows
        names = [n for n, p in model.named_parameters() if id(p) in sparse]
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return DDP(model, device_ids=ids, broadcast_buffers=False)


def release_ddp(holder: Any, ctx: DistContext, attr: str = "fwd_model") -> None:
    """Drop `holder.attr` (the DDP-wrapped model) and collect it while the process group is still
    registered; call before `shutdown`. Otherwise the wrapper's Reducer can hold the last reference
    to the gloo group, whose destructor then joins gloo's worker thread with the GIL held while
    that thread waits for the GIL to free a finished collective's tensor: an intermittent hang at
    exit (pytorch/pytorch#56297). With attr="model" on an
    FSDP-sharded model: its FSDP state holds the group too, in a reference cycle that only a
    later garbage collection (at any moment, or at interpreter exit) would free."""
    if ctx.distributed and getattr(holder, attr, None) is not None:
        setattr(holder, attr, None)
        import gc

        gc.collect()  # torch 2.13 frees it by reference count alone; this covers any cycle


def sparse_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """The table parameters whose modules produce row-sparse gradients (optim.memory_update
    sparse / rowwise), in a fixed order (the same on every process)."""
    from tngram.optim.groups import memory_table_params

    if not builds_row_sparse_grads(model):
        return []
    return [p for p in memory_table_params(model) if p.requires_grad]


def sync_sparse_grads(model: nn.Module, ctx: DistContext) -> None:
    """Average the row-sparse table gradients over processes (what DDP does for dense ones).

    Each process's gradient is coalesced, its (indices, values) are all-gathered (padded to the
    longest; gloo and NCCL all_gather need equal sizes), concatenated and coalesced again, which
    sums the rows several processes touched, then divided by world_size. A process whose table
    got no gradient contributes zero rows. No-op for one process or without sparse tables.
    """
    if not ctx.distributed:
        return
    for p in sparse_grad_params(getattr(model, "module", model)):
        g = p.grad
        k = len(p.shape) - 1  # sparse dims (rows)
        width = p.shape[-1]
        if g is None:
            ind = torch.zeros(k, 0, dtype=torch.int64, device=p.device)
            val = torch.zeros(0, width, dtype=p.dtype, device=p.device)
        else:
            if not g.is_sparse:
                raise TngramError(f"sync_sparse_grads: {tuple(p.shape)} table has a dense gradient")
            g = g.coalesce()
            ind, val = g.indices(), g.values()
        n = torch.tensor([ind.shape[1]], dtype=torch.int64, device=p.device)
        sizes = [torch.zeros_like(n) for _ in range(ctx.world_size)]
        dist.all_gather(sizes, n)
        sizes_i = [int(s) for s in sizes]
        most = max(sizes_i)
        if most == 0:
            continue
        pad_i = torch.zeros(k, most, dtype=torch.int64, device=p.device)
        pad_v = torch.zeros(most, width, dtype=val.dtype, device=p.device)
        pad_i[:, : ind.shape[1]] = ind
        pad_v[: ind.shape[1]] = val
        all_i = [torch.empty_like(pad_i) for _ in range(ctx.world_size)]
        all_v = [torch.empty_like(pad_v) for _ in range(ctx.world_size)]
        dist.all_gather(all_i, pad_i)
        dist.all_gather(all_v, pad_v)
        ind = torch.cat([t[:, :s] for t, s in zip(all_i, sizes_i)], dim=1)
        val = torch.cat([t[:s] for t, s in zip(all_v, sizes_i)], dim=0)
        p.grad = torch.sparse_coo_tensor(ind, val / ctx.world_size, tuple(p.shape)).coalesce()


def no_sync(model: nn.Module, sync: bool) -> AbstractContextManager:
    """Skip DDP's gradient all-reduce on accumulation micro-steps that are not the last."""
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    ddp: Any = model  # a DistributedDataParallel (it has no_sync)
    return ddp.no_sync()
