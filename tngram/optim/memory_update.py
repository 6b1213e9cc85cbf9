"""How the memory tables are updated: `optim.memory_update = "dense" | "sparse" | "rowwise"`.

A step reads at most B*T rows of each n-gram table / CP factor. "dense" (the default) is plain
Adam on the whole table, as before, bit for bit: a dense gradient and two moments per entry,
every entry read and written every step. The two others give the tables a row-sparse gradient
(`tngram.kernels.sparse_rows`: only the touched rows) and update only those rows:

    sparse   LazyAdam (below): torch.optim.SparseAdam's lazy Adam. A row's moments and weights
             change only at steps where the row has a gradient; the bias correction counts the
             table's steps (torch's semantics). State: 2 floats per entry (8 bytes per table
             parameter). Same numbers as torch.optim.SparseAdam, 2-4x faster on CPU (tested).
    rowwise  RowwiseAdam (below): lazy like "sparse", first moment per entry, but ONE second
             moment per table row (the mean of the squared gradient over the row), as the
             row-wise Adagrad/Adam of large embedding trainers (FBGEMM, PBG). State: 4 + 4/width
             bytes per table parameter (width = row length: Engram head_dim, OE slice width,
             TN-gram cp_rank).

Catch-up (`optim.memory_catchup = true`, with sparse or rowwise). A lazy row stands still at the
steps it is not read, where dense Adam moves it on with its decaying momentum: after one gradient a
row moves about (1 - b1)/sqrt(1 - b2) lr at once and then, step after step, by a factor
r = b1/sqrt(b2) less (0.92 at b1 0.9, b2 0.95), in all about 13x its first move. A row read once in
a while therefore learns an order of magnitude slower than under dense Adam. With catch-up the
optimiser keeps each row's last step s and the table's lr history; when the row is read again at
step t it first adds, in closed form, the moves dense Adam would have made at steps s+1..t-1
(moments decayed by b1^j, b2^j; each step's lr and bias correction from the history), decays the
moments by b1^(t-1-s), b2^(t-1-s), then takes its usual step. The rows are brought up to date when
they are READ, before the forward (a read hook in tngram.kernels.sparse_rows.compact_rows), so the
forward sees what dense Adam's forward would; a row read by another DDP process only gets the
same arithmetic at the update (bit for bit the same adds). That is dense Adam's arithmetic
evaluated lazily, exact when eps = 0: eps is left out of the missed moves, so that their factor
depends on the row only through s and is computed once per distinct s (at the mini recipes
sqrt(v) of a table entry is ~1e-6 at the median and ~1e-8 at the 1st percentile: entries within
~10x of eps = 1e-8 move more than under dense Adam). Moves below r^j < 1e-12 of the first are
dropped when r < 1. Rows still owed moves are settled for evaluation (`settled`, weights restored
after) and at the end of training (`settle`). State: + 4 bytes per row (last step, int32) and 8
bytes per step of lr history.

Where the code is: the optimisers' shared row loop and catch-up in `tngram.optim.lazy_rows`,
LazyAdam and RowwiseAdam in `tngram.optim.row_adams` (both re-exported here).

On CUDA (triton installed) the touched rows of a sparse gradient are updated by one Triton kernel
(`tngram.kernels.row_update`: per tile of touched rows load -> step, catch-up included -> store
in place; no gathered copies, nothing outside the touched rows read or written), after a
first-use self-check against a float64 evaluation; it does torch's operations with torch's
roundings (tests/test_sparse_triton.py). If the check fails or the kernel raises, one warning and
torch's gather / update / scatter from then on, all touched rows of a table at once (~14 kernels
per table; the CPU's chunks of rows, `tngram.optim.lazy_rows._chunk_rows`, are a cache choice
that would cost ~13 launches per 256 rows of width 1024 on a GPU). On CPU the torch path runs.
TNGRAM_ROW_UPDATE_IMPL (auto | torch | triton) forces one.

Which parameters: `tngram.optim.groups.memory_table_params` (TN-gram factors, Engram / OE tables);
everything else keeps its optimiser (Adam for embeddings/scalars, Muon for matrices). Tables get
the same learning rate (memory_table_lr) and betas/eps as under "dense".

The trainer calls `setup_memory_update` once (it switches the modules' `sparse_grad` on and
builds the table optimiser), `clip_grad_norm` instead of torch's (it handles sparse gradients and
is torch's own call when there are none), and under DDP `tngram.train.dist.sync_sparse_grads`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory.base import MemoryModule, RowSparse
from tngram.optim.groups import memory_table_params
from tngram.optim.lazy_rows import settle_tables, settled_tables
from tngram.optim.row_adams import LazyAdam, RowwiseAdam

MEMORY_UPDATES = ("dense", "sparse", "rowwise")


def set_sparse_grads(model: nn.Module, on: bool = True) -> list[nn.Parameter]:
    """Switch the row-sparse table gradients of every memory module of `model` on (or off);
    returns the table parameters that now get sparse gradients."""
    mods = list(model.modules())
    if on:  # every memory module must be able to (tngram.memory.base.RowSparse); one line if not
        for m in mods:
            if isinstance(m, MemoryModule) and not isinstance(m, RowSparse):
                raise TngramError(
                    "optim.memory_update sparse/rowwise needs row-sparse table gradients, "
                    f"which the memory module {type(m).__name__} does not provide; "
                    "use optim.memory_update=dense"
                )
            problem = m.row_sparse_problem() if isinstance(m, RowSparse) else ""
            if problem:
                raise TngramError(problem)
    for m in mods:
        if isinstance(m, RowSparse):
            m.sparse_grad = on
    return memory_table_params(model) if on else []


def setup_memory_update(
    model: nn.Module,
    groups: list[dict],
    mode: str,
    betas: tuple[float, float],
    eps: float,
    catchup: bool = False,
) -> tuple[torch.optim.Optimizer | None, list[dict]]:
    """(table optimiser or None, the param groups left for the other optimisers).

    groups: tngram.optim.groups.build_param_groups(...). "dense": (None, groups) unchanged and the
    model untouched. "sparse" / "rowwise": the memory tables leave their group (whose other
    parameters stay), the modules switch to row-sparse gradients, and the tables get
    LazyAdam / RowwiseAdam with the group's lr (each group dict keeps names, group,
    base_lr, so the trainer's schedule treats it like any other). catchup: the table optimiser
    adds the missed steps' moves (optim.memory_catchup; module docstring).
    """
    if mode not in MEMORY_UPDATES:
        raise TngramError(f"optim.memory_update must be one of {MEMORY_UPDATES}, got {mode!r}")
    if mode == "dense":
        return None, groups
    tables = {id(p) for p in set_sparse_grads(model, True) if p.requires_grad}
    rest, table_groups = [], []
    for g in groups:
        keep = [i for i, p in enumerate(g["params"]) if id(p) not in tables]
        moved = [i for i, p in enumerate(g["params"]) if id(p) in tables]
        if moved:
            table_groups.append(
                {
                    **g,
                    "params": [g["params"][i] for i in moved],
                    "names": [g["names"][i] for i in moved],
                    "optimizer": mode,
                }
            )
        if keep:
            rest.append(
                g
                if not moved
                else {
                    **g,
                    "params": [g["params"][i] for i in keep],
                    "names": [g["names"][i] for i in keep],
                }
            )
    if not table_groups:
        return None, rest
    if mode == "sparse":
        return LazyAdam(table_groups, betas=betas, eps=eps, catchup=catchup), rest
    return RowwiseAdam(table_groups, betas=betas, eps=eps, catchup=catchup), rest


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) that also takes sparse gradients.

    Without sparse gradients this IS torch's call (same numbers). With them, each sparse gradient
    is coalesced first (duplicate rows of accumulated micro-steps summed, so its values are the
    touched rows of the dense gradient), the total norm is the 2-norm over every dense gradient
    and every sparse gradient's values, and all are scaled by min(1, max_norm / (norm + 1e-6)).
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]  # every one (mypy: not None)
    if not any(g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    for p, g in zip(params, grads):
        if g.is_sparse and not g.is_coalesced():
            p.grad = g.coalesce()
    grads = [p.grad for p in params if p.grad is not None]
    parts = [(g.values() if g.is_sparse else g).detach() for g in grads]
    if not parts:
        return torch.zeros(())
    dev = parts[0].device  # tables kept on the CPU (tngram.hf table_device): norms meet here
    total = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(t.float()).to(dev) for t in parts])
    )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef.device.type == "cpu" and bool(coef >= 1.0):
        return total  # nothing to clip: x * 1 == x, so skip the pass (no sync on CPU)
    for t in parts:
        t.mul_(coef.to(t.device, t.dtype))
    return total


def optimizer_state_bytes(
    opt: torch.optim.Optimizer, params: Iterable[Tensor] | None = None
) -> int:
    """Bytes of the tensors in `opt`'s state (of `params` only, when given)."""
    keep = None if params is None else {id(p) for p in params}
    total = 0
    for p, st in opt.state.items():
        if keep is not None and id(p) not in keep:
            continue
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


STATE_BYTES_PER_PARAM = {
    "adam": 8,
    "muon": 4,
}  # fp32 moments: Adam exp_avg + exp_avg_sq, Muon momentum


def param_state_bytes(
    optimizer: str,
    shape: Sequence[int],
    memory_update: str = "dense",
    table: bool = False,
    catchup: bool = False,
) -> int:
    """Bytes of optimiser state the trainer allocates for one fp32 parameter tensor of `shape`:
    the rule `tngram plan` and `python -m research experiment pareto` count by
    (tests/test_memory_update.py
    checks it against the state tensors real optimiser steps allocate).

    optimizer: the tensor's group optimiser ("adam" | "muon", tngram.optim.groups); table: it is
    a memory table (`memory_table_params`), whose state follows `memory_update`:
        dense    torch.optim.Adam like the rest of its group: exp_avg + exp_avg_sq, 8 B per entry
        sparse   LazyAdam: exp_avg + exp_avg_sq, 8 B per entry
        rowwise  RowwiseAdam: exp_avg (4 B per entry) + exp_avg_sq_row (4 B per row of width
                 shape[-1]), i.e. 4 + 4/width B per entry
        catchup  (optim.memory_catchup, with sparse or rowwise) + the last step of each row
                 (int32): 4/width B per entry more; its lr history (8 B per step) is not counted
    Not a table, or dense: Adam 8 B, Muon 4 B per entry. Step counters are not counted (an int
    for LazyAdam/RowwiseAdam; a 4-byte 0-d tensor per parameter tensor for torch's Adam).
    """
    if memory_update not in MEMORY_UPDATES:
        raise TngramError(
            f"optim.memory_update must be one of {MEMORY_UPDATES}, got {memory_update!r}"
        )
    numel = math.prod(shape)
    width = shape[-1] if len(shape) else 1
    rows = numel // width if width else 0
    last = 4 * rows if catchup and table and memory_update != "dense" else 0
    if table and memory_update == "rowwise":
        return 4 * numel + 4 * rows + last
    if table and memory_update == "sparse":
        return 8 * numel + last
    if optimizer not in STATE_BYTES_PER_PARAM:
        raise TngramError(
            f"param_state_bytes: optimizer must be one of {tuple(STATE_BYTES_PER_PARAM)}, "
            f"got {optimizer!r}"
        )
    return STATE_BYTES_PER_PARAM[optimizer] * numel


__all__ = [
    "MEMORY_UPDATES",
    "STATE_BYTES_PER_PARAM",
    "LazyAdam",
    "RowwiseAdam",
    "clip_grad_norm",
    "optimizer_state_bytes",
    "param_state_bytes",
    "set_sparse_grads",
    "settle_tables",
    "settled_tables",
    "setup_memory_update",
]
