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

Which parameters: `tngram.optim.groups.memory_table_params` (TN-gram factors, Engram / OE tables);
everything else keeps its optimiser (Adam for embeddings/scalars, Muon for matrices). Tables get
the same learning rate (memory_table_lr) and betas/eps as under "dense".

The trainer calls `setup_memory_update` once (it switches the modules' `sparse_grad` on and
builds the table optimiser), `clip_grad_norm` instead of torch's (it handles sparse gradients and
is torch's own call when there are none), and under DDP `tngram.train.dist.sync_sparse_grads`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.optim.groups import memory_table_params

MEMORY_UPDATES = ("dense", "sparse", "rowwise")


def set_sparse_grads(model: nn.Module, on: bool = True) -> list[nn.Parameter]:
    """Switch the row-sparse table gradients of every memory module of `model` on (or off);
    returns the table parameters that now get sparse gradients."""
    for m in model.modules():
        if hasattr(type(m), "sparse_grad"):
            if getattr(getattr(m, "config", None), "fused", True) is False and on:
                raise TngramError("optim.memory_update sparse/rowwise needs the fused TN-gram "
                                  "lookup: set model.memory.fused=true")
            m.sparse_grad = on
    return memory_table_params(model) if on else []


class _LazyRowAdam(torch.optim.Optimizer):
    """What LazyAdam and RowwiseAdam share: the argument checks, the closure, the loop over the
    parameters with a gradient, the touched rows (`_rows_and_values`), the step count, and the
    gather / scatter of the touched rows' moments and weights. A subclass says which moments it
    keeps (`_init_state`, `_moments`) and how one step changes the touched rows (`_row_update`).
    Rows are the last dimension's vectors: a (V, W) table has V rows, (N, V, R) N*V rows."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"{type(self).__name__} needs lr >= 0, eps >= 0, betas in [0, 1); "
                             f"got {lr}, {eps}, {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    def _init_state(self, p: Tensor, state: dict) -> None:
        """Add the zero moments of `p` to its (new) state, after "step"."""
        raise NotImplementedError

    def _moments(self, p: Tensor, state: dict) -> tuple[Tensor, Tensor]:
        """(first, second) moments as views with one row per table row (index_select-able)."""
        raise NotImplementedError

    def _row_update(self, m: Tensor, v: Tensor, vals: Tensor, t: int, lr: float, b1: float,
                    b2: float, eps: float) -> Tensor:
        """Update the touched rows' moments m, v in place from their gradient rows `vals` at the
        table's step t; return the rows' weight change."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, vals = _rows_and_values(p)
                if vals.numel() == 0:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    self._init_state(p, state)
                state["step"] += 1
                m_all, v_all = self._moments(p, state)
                flat = p.view(-1, p.shape[-1])
                if rows is None:
                    flat.add_(self._row_update(m_all, v_all, vals, state["step"], lr, b1, b2, eps))
                    continue
                # the touched rows in chunks of ~_ROW_CHUNK_ELEMS entries: a chunk's moments and
                # weights are still in cache and TLB when written back, and its temporaries are
                # small enough for the allocator to reuse (no fresh pages to fault in each step).
                # Row by row the same arithmetic, so the same numbers (docs/LOG.md 2026-11-25)
                n = max(1, _ROW_CHUNK_ELEMS // max(1, vals.shape[-1]))
                for a in range(0, rows.numel(), n):
                    r = rows[a:a + n]
                    m, v = m_all.index_select(0, r), v_all.index_select(0, r)
                    upd = self._row_update(m, v, vals[a:a + n], state["step"], lr, b1, b2, eps)
                    m_all.index_copy_(0, r, m)
                    v_all.index_copy_(0, r, v)
                    flat.index_add_(0, r, upd)
        return loss


# entries per chunk of touched rows in _LazyRowAdam.step (~1 MB fp32 per gathered tensor; 256-1024
# rows x 352 measured alike, 1 thread, AMD EPYC: 13-14 ms against 35 ms unchunked at V = 32k)
_ROW_CHUNK_ELEMS = 1 << 18


class RowwiseAdam(_LazyRowAdam):
    """Lazy Adam with one second moment per row (see module docstring). Rows are the last
    dimension's vectors: a (V, W) table has V rows, TN-gram's (N, V, R) factors N*V rows.

    For each touched row i with gradient g_i (W entries), at the table's step t:
        m_i <- b1 m_i + (1 - b1) g_i                      (W floats)
        v_i <- b2 v_i + (1 - b2) mean(g_i^2)              (1 float)
        w_i <- w_i - lr / (1 - b1^t) * m_i / (sqrt(v_i / (1 - b2^t)) + eps)
    Untouched rows keep weights and state. Takes sparse (COO) or dense gradients; a dense
    gradient touches every row. State: step (int), exp_avg (like the parameter),
    exp_avg_sq_row (rows,) fp32 (`param_state_bytes` counts it).
    """

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq_row"] = torch.zeros(p.numel() // p.shape[-1], dtype=torch.float32,
                                              device=p.device)

    def _moments(self, p: Tensor, state: dict) -> tuple[Tensor, Tensor]:
        return state["exp_avg"].view(-1, p.shape[-1]), state["exp_avg_sq_row"]

    def _row_update(self, m: Tensor, v: Tensor, vals: Tensor, t: int, lr: float, b1: float,
                    b2: float, eps: float) -> Tensor:
        m.mul_(b1).add_(vals, alpha=1 - b1)
        v.mul_(b2).add_(vals.float().square().mean(1), alpha=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
        return (m / denom.to(m.dtype).unsqueeze(1)).mul_(-lr / (1 - b1 ** t))


class LazyAdam(_LazyRowAdam):
    """torch.optim.SparseAdam's lazy Adam, written with index_select / index_copy_ / index_add_ on
    the touched rows (torch's goes through sparse_mask and sparse additions; measured 2-4x
    slower here, docs/LOG.md). Same state (step, exp_avg, exp_avg_sq), same formula: for each
    touched row at the table's step t,
        m <- b1 m + (1 - b1) g ; v <- b2 v + (1 - b2) g^2
        w <- w - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
    Sparse (COO) or dense gradients (a dense one touches every row)."""

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _moments(self, p: Tensor, state: dict) -> tuple[Tensor, Tensor]:
        width = p.shape[-1]
        return state["exp_avg"].view(-1, width), state["exp_avg_sq"].view(-1, width)

    def _row_update(self, m: Tensor, v: Tensor, vals: Tensor, t: int, lr: float, b1: float,
                    b2: float, eps: float) -> Tensor:
        m.mul_(b1).add_(vals, alpha=1 - b1)
        v.mul_(b2).addcmul_(vals, vals, value=1 - b2)
        return (m / v.sqrt().add_(eps)).mul_(-lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))


def _rows_and_values(p: Tensor) -> tuple[Tensor | None, Tensor]:
    """(flat row ids or None for all rows, (rows, width) gradient values) of p.grad."""
    width = p.shape[-1]
    if not p.grad.is_sparse:
        return None, p.grad.reshape(-1, width)
    g = p.grad.coalesce()
    ind, vals = g.indices(), g.values().reshape(-1, width)
    return (ind[0] if ind.shape[0] == 1 else _flat_rows(ind, p.shape[:-1])), vals


def _flat_rows(ind: Tensor, lead: torch.Size | tuple[int, ...]) -> Tensor:
    """Row-major flat row ids from the (k, nnz) indices of a sparse tensor with k sparse dims."""
    rows = ind[0].clone()
    for d in range(1, ind.shape[0]):
        rows.mul_(lead[d]).add_(ind[d])
    return rows


def setup_memory_update(model: nn.Module, groups: list[dict], mode: str, betas: tuple[float, float],
                        eps: float) -> tuple[torch.optim.Optimizer | None, list[dict]]:
    """(table optimiser or None, the param groups left for the other optimisers).

    groups: tngram.optim.groups.build_param_groups(...). "dense": (None, groups) unchanged and the
    model untouched. "sparse" / "rowwise": the memory tables leave their group (whose other
    parameters stay), the modules switch to row-sparse gradients, and the tables get
    LazyAdam / RowwiseAdam with the group's lr (each group dict keeps names, group,
    base_lr, so the trainer's schedule treats it like any other).
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
            table_groups.append({**g, "params": [g["params"][i] for i in moved],
                                 "names": [g["names"][i] for i in moved], "optimizer": mode})
        if keep:
            rest.append(g if not moved else {**g, "params": [g["params"][i] for i in keep],
                                              "names": [g["names"][i] for i in keep]})
    if not table_groups:
        return None, rest
    if mode == "sparse":
        return LazyAdam(table_groups, betas=betas, eps=eps), rest
    return RowwiseAdam(table_groups, betas=betas, eps=eps), rest


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) that also takes sparse gradients.

    Without sparse gradients this IS torch's call (same numbers). With them, each sparse gradient
    is coalesced first (duplicate rows of accumulated micro-steps summed, so its values are the
    touched rows of the dense gradient), the total norm is the 2-norm over every dense gradient
    and every sparse gradient's values, and all are scaled by min(1, max_norm / (norm + 1e-6)).
    """
    params = [p for p in params if p.grad is not None]
    if not any(p.grad.is_sparse for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    for p in params:
        if p.grad.is_sparse and not p.grad.is_coalesced():
            p.grad = p.grad.coalesce()
    parts = [(p.grad.values() if p.grad.is_sparse else p.grad).detach() for p in params]
    if not parts:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float())
                                                  for t in parts]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef.device.type == "cpu" and bool(coef >= 1.0):
        return total       # nothing to clip: x * 1 == x, so skip the pass (no sync on CPU)
    for t in parts:
        t.mul_(coef.to(t.dtype))
    return total


def optimizer_state_bytes(opt: torch.optim.Optimizer, params: Iterable[Tensor] | None = None) -> int:
    """Bytes of the tensors in `opt`'s state (of `params` only, when given)."""
    keep = None if params is None else {id(p) for p in params}
    total = 0
    for p, st in opt.state.items():
        if keep is not None and id(p) not in keep:
            continue
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


STATE_BYTES_PER_PARAM = {"adam": 8, "muon": 4}   # fp32 moments: Adam exp_avg + exp_avg_sq, Muon momentum


def param_state_bytes(optimizer: str, shape: Sequence[int], memory_update: str = "dense",
                      table: bool = False) -> int:
    """Bytes of optimiser state the trainer allocates for one fp32 parameter tensor of `shape`:
    the rule `tngram plan` and `tngram experiment pareto` count by (tests/test_memory_update.py
    checks it against the state tensors real optimiser steps allocate).

    optimizer: the tensor's group optimiser ("adam" | "muon", tngram.optim.groups); table: it is
    a memory table (`memory_table_params`), whose state follows `memory_update`:
        dense    torch.optim.Adam like the rest of its group: exp_avg + exp_avg_sq, 8 B per entry
        sparse   LazyAdam: exp_avg + exp_avg_sq, 8 B per entry
        rowwise  RowwiseAdam: exp_avg (4 B per entry) + exp_avg_sq_row (4 B per row of width
                 shape[-1]), i.e. 4 + 4/width B per entry
    Not a table, or dense: Adam 8 B, Muon 4 B per entry. Step counters are not counted (an int
    for LazyAdam/RowwiseAdam; a 4-byte 0-d tensor per parameter tensor for torch's Adam).
    """
    if memory_update not in MEMORY_UPDATES:
        raise TngramError(f"optim.memory_update must be one of {MEMORY_UPDATES}, got {memory_update!r}")
    numel = math.prod(shape)
    if table and memory_update == "rowwise":
        width = shape[-1]
        return 4 * numel + (4 * (numel // width) if width else 0)
    if table and memory_update == "sparse":
        return 8 * numel
    if optimizer not in STATE_BYTES_PER_PARAM:
        raise TngramError(f"param_state_bytes: optimizer must be one of {tuple(STATE_BYTES_PER_PARAM)}, "
                          f"got {optimizer!r}")
    return STATE_BYTES_PER_PARAM[optimizer] * numel


__all__ = ["MEMORY_UPDATES", "STATE_BYTES_PER_PARAM", "LazyAdam", "RowwiseAdam", "clip_grad_norm",
           "optimizer_state_bytes", "param_state_bytes", "set_sparse_grads", "setup_memory_update"]
