"""FSDP2 (`run.parallel = "fsdp"`): every block, memories included, sharded with fully_shard.

    fully_shard(block) for each block (its Engram / TN-gram memory shards with it; an
    Over-Encoding embedding memory gets its own unit), then fully_shard(model) for the rest
    (token embedding = tied head, final norm, skip weights).

Each parameter becomes a DTensor sharded on dim 0 over the processes (uneven shards padded by
FSDP); forward/backward all-gather one unit at a time and reduce-scatter (average) the
gradients, so a process holds 1/world_size of the weights, gradients and optimiser state.

Optimisers: Adam runs on the DTensor shards as they are (torch.optim supports DTensor). Muon
(`tngram.optim.muon.Muon`) keeps its momentum buffer as the local shard and all-gathers the
Nesterov update of a matrix before Newton-Schulz (the orthogonalisation needs the whole matrix),
then applies only the local rows; every process orthogonalises every matrix (the same bf16
result on each; no round-robin), a documented choice trading compute for no extra collective.

Gradients equal those of 1 process bitwise (tests/test_dist_fsdp.py, 20 steps): a unit's
repeated input tensor gets its own view node so the gradient sum at it keeps the unsharded
order (`_split_repeated_inputs`).

Checkpoints (resume at any world size, also 1 process without FSDP): each process writes its
shards through torch.distributed.checkpoint (tngram.train.sharded_checkpoint; the weights are
also gathered into the checkpoint's model.safetensors for readers). A checkpoint in the usual
full-tensor format (written by 1 process) is read into the shards by the views below: every
process reads the full tensors and keeps its own shard (distribute_tensor with the parameter's
own mesh and placements, no communication). The final weights are gathered with
DTensor.full_tensor() (every process takes part, in parameter order).

Not combined with optim.memory_update sparse/rowwise (FSDP reduce-scatters dense gradients only):
use run.parallel=ddp for those. With one process FSDP is not applied (the same single-process run).
"""

from __future__ import annotations

from typing import Any, Iterator, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory.base import builds_row_sparse_grads

PARALLEL = ("ddp", "fsdp")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def apply_fsdp(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """Shard `model` in place (blocks, embedding memory, root) over `world_size` processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if builds_row_sparse_grads(model):
        raise TngramError(
            "run.parallel=fsdp cannot train row-sparse tables "
            "(optim.memory_update sparse/rowwise); use run.parallel=ddp or "
            "optim.memory_update=dense"
        )
    mesh = init_device_mesh(device.type, (world_size,))
    units = list(getattr(model, "blocks", []))
    emb = getattr(model, "embed_memory", None)
    if emb is not None:
        units.append(emb)
    if not units:  # any other model (e.g. a transformers model): its decoder layers
        units = [m for m in model.modules() if m.__class__.__name__.endswith("DecoderLayer")]
    for unit in units:
        fully_shard(unit, mesh=mesh)
        # after fully_shard, prepended: runs before FSDP's own pre-forward hook
        unit.register_forward_pre_hook(_split_repeated_inputs, prepend=True, with_kwargs=True)
    fully_shard(model, mesh=mesh)
    return model


def _split_repeated_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give every repeat of an input tensor but the last its own view (a ViewBackward node), so
    that gradients are summed in the order of the unsharded model.

    FSDP2 passes all of a unit's grad-requiring inputs through one autograd Function (its
    post-backward hook), whose backward hands their gradients on together, in argument order.
    GPT passes the normalised embedding x0 to the first block as both `x` and `x0`; x0 is also
    every other block's `x0` (and the tied embedding is the only parameter upstream of it). In
    the unsharded model the block's later use (x0) reaches the shared tensor first, then x; through
    FSDP's Function x came first, so the (>= 3-term) float sum at x0 was associated differently
    and the tied embedding's gradient differed in the last bits (3.7e-9 on the tiny test model),
    which Muon's bf16 Newton-Schulz amplified (3.9e-4 relative loss after 20 steps). With a
    view, the earlier arguments' gradients pass through their own node, which runs after the
    Function, so each block's gradient parts arrive in reverse argument order, as they do
    unsharded when a module uses its arguments in order (tngram's Block does): the 2-process
    run then equals the 1-process run bitwise (tests/test_dist_fsdp.py)."""
    if not torch.is_grad_enabled():
        return args, kwargs
    items = list(args) + list(kwargs.values())
    last = {id(t): i for i, t in enumerate(items) if torch.is_tensor(t) and t.requires_grad}
    if len(last) == sum(1 for t in items if torch.is_tensor(t) and t.requires_grad):
        return args, kwargs  # no tensor passed twice: nothing to reorder
    out = [
        t.view_as(t) if torch.is_tensor(t) and t.requires_grad and last[id(t)] != i else t
        for i, t in enumerate(items)
    ]
    return tuple(out[: len(args)]), dict(zip(kwargs, out[len(args) :]))


def _full(t: Any) -> Any:
    return t.full_tensor() if _is_dtensor(t) else t


class FullStateModel:
    """What tngram.train.checkpoint needs of a model, with full (unsharded) tensors:
    state_dict() gathers (collective: call on every process), load_state_dict() keeps each
    process's shard. Everything else is forwarded to the model."""

    def __init__(self, model: nn.Module, gathered: dict[str, Tensor] | None = None) -> None:
        self._model, self._sd = model, gathered

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def state_dict(self) -> dict[str, Tensor]:
        if self._sd is None:
            self._sd = {k: _full(v).detach() for k, v in self._model.state_dict().items()}
        return self._sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Tensor], strict: bool = True) -> Any:
        own = self._model.state_dict()
        if strict and set(own) != set(sd):
            raise TngramError(
                f"checkpoint does not fit the sharded model: {sorted(set(own) ^ set(sd))[:5]}"
            )
        for k, t in own.items():
            src = sd[k].to(device=t.device, dtype=t.dtype)
            if _is_dtensor(t):
                t.to_local().copy_(_shard_like(src, t).to_local())
            else:
                t.copy_(src)
        return None


def _shard_like(full: Tensor, like: Any) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


class FullStateOptimizer:
    """An optimiser whose state_dict() has full tensors (collective) and whose load_state_dict()
    takes full tensors and keeps each process's shard of those that shard like their parameter."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._opt = opt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opt, name)

    def state_dict(self) -> dict[str, Any]:
        sd = self._opt.state_dict()
        return {
            "state": {i: {k: _full(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self._opt.param_groups for p in g["params"]]
        state = {}
        for i, st in sd["state"].items():
            p = params[int(i)]
            state[i] = {
                k: (
                    _shard_like(v.to(p.device), p)
                    if torch.is_tensor(v) and _is_dtensor(p) and tuple(v.shape) == tuple(p.shape)
                    else v
                )
                for k, v in st.items()
            }
        self._opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def checkpoint_views(
    model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], sharded: bool
) -> tuple[Any, dict[str, Any]]:
    """(model, optimizers) as tngram.train.checkpoint should see them: unchanged unless sharded;
    then full-state views (their state_dict() gathers: call on every process, in the same order)."""
    if not sharded:
        return model, optimizers
    return FullStateModel(model), {k: FullStateOptimizer(o) for k, o in optimizers.items()}


def gather_for_save(
    model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], sharded: bool
) -> tuple[Any, dict[str, Any]]:
    """As checkpoint_views, with the gathers already done (every process must call this; only the
    main process then writes)."""
    if not sharded:
        return model, optimizers
    m = FullStateModel(model)
    m.state_dict()
    opts = {}
    for k, o in optimizers.items():
        full = FullStateOptimizer(o).state_dict()
        opts[k] = _Frozen(full)
    return m, opts


class _Frozen:
    def __init__(self, sd: dict[str, Any]) -> None:
        self._sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self._sd


def local_parameters(model: nn.Module) -> Iterator[Tensor]:
    """Each parameter's local data (the shard under FSDP): for finiteness checks without gathers."""
    for p in model.parameters():
        yield cast(Any, p).to_local() if _is_dtensor(p) else p  # a DTensor's shard


def shard_model(model: nn.Module, parallel: str, ctx: Any) -> bool:
    """Apply FSDP2 when run.parallel is "fsdp" and there is more than one process (ctx: the
    trainer's DistContext); returns whether the model is now sharded."""
    if parallel not in PARALLEL:
        raise TngramError(f"run.parallel must be one of {PARALLEL}, got {parallel!r}")
    if parallel != "fsdp" or ctx.world_size == 1:
        return False
    apply_fsdp(model, ctx.device, ctx.world_size)
    return True
