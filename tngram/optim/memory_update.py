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
after) and at the end of training (`settle`). State: + 4 bytes per row (last step, int32) and 8 bytes per
step of lr history.

Which parameters: `tngram.optim.groups.memory_table_params` (TN-gram factors, Engram / OE tables);
everything else keeps its optimiser (Adam for embeddings/scalars, Muon for matrices). Tables get
the same learning rate (memory_table_lr) and betas/eps as under "dense".

The trainer calls `setup_memory_update` once (it switches the modules' `sparse_grad` on and
builds the table optimiser), `clip_grad_norm` instead of torch's (it handles sparse gradients and
is torch's own call when there are none), and under DDP `tngram.train.dist.sync_sparse_grads`.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.kernels.sparse_rows import set_read_hook
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
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 catchup: bool = False) -> None:
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"{type(self).__name__} needs lr >= 0, eps >= 0, betas in [0, 1); "
                             f"got {lr}, {eps}, {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, catchup=catchup))
        self._settled_depth = 0
        me = weakref.ref(self)
        for group in self.param_groups:
            if group["catchup"]:
                for p in group["params"]:
                    set_read_hook(p, functools.partial(_settle_on_read, me, weakref.ref(p)))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the catch-up state keeps its dtypes: torch casts every floating
        state tensor to the parameter's dtype (the lr history would lose its float64) and the
        int32 last steps to float."""
        kept: dict = {}
        sd = {**state_dict, "state": {k: dict(v) for k, v in state_dict["state"].items()}}
        for k, st in sd["state"].items():
            kept[k] = {n: st.pop(n) for n in _EXACT_STATE if n in st}
        super().load_state_dict(sd)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for n, t in kept.get(i, {}).items():
                self.state[p][n] = t.to(p.device) if n == "last_step" else t.cpu()

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

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        """The rows' summed moves over their missed steps: -coef * m / sqrt(v) with the (rows,)
        float64 factor `coef` (catch-up; module docstring); m, v: the moments after the last step."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            catchup = group.get("catchup", False)
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
                    if catchup:
                        state["last_step"] = torch.zeros(p.numel() // p.shape[-1], dtype=torch.int32,
                                                         device=p.device)
                        state["lr_history"] = torch.zeros(64, dtype=torch.float64)
                state["step"] += 1
                m_all, v_all = self._moments(p, state)
                flat = p.view(-1, p.shape[-1])
                if catchup:
                    _record_lr(state, lr)
                    if rows is None:
                        rows = torch.arange(flat.shape[0], device=p.device)
                    self._step_rows_catchup(flat, m_all, v_all, rows, vals, state, lr, b1, b2, eps)
                    continue
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

    def _step_rows_catchup(self, flat: Tensor, m_all: Tensor, v_all: Tensor, rows: Tensor,
                           vals: Tensor, state: dict, lr: float, b1: float, b2: float, eps: float) -> None:
        """The touched rows' step with catch-up: the moves of their missed steps, then the usual one."""
        t, last = state["step"], state["last_step"]
        n = max(1, _ROW_CHUNK_ELEMS // max(1, vals.shape[-1]))
        for a in range(0, rows.numel(), n):
            r = rows[a:a + n]
            m, v = m_all.index_select(0, r), v_all.index_select(0, r)
            missed = self._catch_up(m, v, last.index_select(0, r), t - 1, state["lr_history"], b1, b2, eps)
            if missed is not None:       # a separate add: the same bits as when settled on read
                flat.index_add_(0, r, missed)
            upd = self._row_update(m, v, vals[a:a + n], t, lr, b1, b2, eps)
            m_all.index_copy_(0, r, m)
            v_all.index_copy_(0, r, v)
            last.index_fill_(0, r, t)
            flat.index_add_(0, r, upd)

    def _catch_up(self, m: Tensor, v: Tensor, last: Tensor, upto: int, lr_history: Tensor,
                  b1: float, b2: float, eps: float) -> Tensor | None:
        """Rows whose last step is `last` (0 = never): their moves at steps last+1..upto (None when
        there are none), and their moments decayed to step `upto` in place."""
        s = last.to(torch.int64)
        k = torch.where(s > 0, upto - s, torch.zeros_like(s))          # missed steps per row
        if not k.numel() or int(k.max()) <= 0:
            return None
        # the factor depends on the row only through its last step: compute it once per distinct one
        starts, which = torch.unique(s, return_inverse=True)
        n_missed = torch.where(starts > 0, upto - starts, torch.zeros_like(starts))       # (U,)
        horizon = _horizon(b1, b2)       # a fixed length: the same sums whichever rows come along
        J = int(n_missed.max()) if horizon is None else horizon
        j = torch.arange(1, J + 1, dtype=torch.int64, device=s.device)                    # (J,)
        u = starts.unsqueeze(1) + j.unsqueeze(0)                      # (U, J) the missed step ids
        valid = j.unsqueeze(0) <= n_missed.unsqueeze(1)
        uf, jf = u.clamp(1, max(upto, 1)).to(torch.float64), j.to(torch.float64)
        lr_u = lr_history.to(s.device)[u.clamp(1, max(upto, 1)) - 1]
        # step u's move of a row last stepped at s = u - j, eps left out:
        #   lr_u sqrt(1 - b2^u)/(1 - b1^u) (b1/sqrt(b2))^j * m_s/sqrt(v_s)
        a = lr_u * torch.sqrt(1 - b2 ** uf) / (1 - b1 ** uf) * (b1 / math.sqrt(b2)) ** jf
        coef = torch.where(valid, a, torch.zeros_like(a)).sum(1)[which]                  # (rows,)
        moves = self._missed_moves(m, v, coef)
        kd = k.to(torch.float64)
        m.mul_((b1 ** kd).to(m.dtype).view(-1, *([1] * (m.dim() - 1))))
        v.mul_((b2 ** kd).to(v.dtype).view(-1, *([1] * (v.dim() - 1))))
        return moves

    def _pending(self, p: Tensor, state: dict, group: dict) -> Tensor | None:
        """The (rows, width) moves dense Adam has made on p's rows since each row's last step, up to
        the table's current step; the moments decayed accordingly (copies; state unchanged)."""
        if not group.get("catchup", False) or "last_step" not in state:
            return None
        (b1, b2), eps = group["betas"], group["eps"]
        m_all, v_all = self._moments(p, state)
        return self._catch_up(m_all.clone(), v_all.clone(), state["last_step"], state["step"],
                              state["lr_history"], b1, b2, eps)

    @torch.no_grad()
    def settle(self) -> None:
        """Apply every row's owed moves (catch-up) now, as dense Adam would have, and advance the
        rows' state to the current step. No-op without catch-up."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or not group.get("catchup", False):
                    continue
                (b1, b2), eps = group["betas"], group["eps"]
                m_all, v_all = self._moments(p, state)
                moves = self._catch_up(m_all, v_all, state["last_step"], state["step"],
                                       state["lr_history"], b1, b2, eps)
                if moves is not None:
                    p.view(-1, p.shape[-1]).add_(moves)
                state["last_step"].masked_fill_(state["last_step"] > 0, state["step"])

    @contextmanager
    def settled(self) -> Iterator[None]:
        """Inside: the tables' weights with every row's owed moves applied (for evaluation);
        after: the weights exactly as before, state untouched. No-op without catch-up."""
        saved = []
        self._settled_depth += 1         # rows read meanwhile are not settled again (read hook)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    moves = self._pending(p, state, group) if state else None
                    if moves is not None:
                        saved.append((p, p.detach().clone()))
                        p.view(-1, p.shape[-1]).add_(moves)
        try:
            yield
        finally:
            self._settled_depth -= 1
            with torch.no_grad():
                for p, w in saved:
                    p.copy_(w)

    @torch.no_grad()
    def settle_rows(self, p: Tensor, rows: Tensor) -> None:
        """Bring `rows` (flat ids) of p up to the table's current step before they are read: add
        their owed moves, decay their moments, mark them current. The next step then owes them
        nothing, so the forward reads what dense Adam's forward would read (the read hook)."""
        state = self.state.get(p)
        if not state or "last_step" not in state or self._settled_depth:
            return
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        (b1, b2), eps = group["betas"], group["eps"]
        t, last = state["step"], state["last_step"]
        m_all, v_all = self._moments(p, state)
        flat = p.view(-1, p.shape[-1])
        n = max(1, _ROW_CHUNK_ELEMS // max(1, p.shape[-1]))
        for a in range(0, rows.numel(), n):
            r = rows[a:a + n]
            last_r = last.index_select(0, r)
            m, v = m_all.index_select(0, r), v_all.index_select(0, r)
            missed = self._catch_up(m, v, last_r, t, state["lr_history"], b1, b2, eps)
            if missed is None:
                continue
            flat.index_add_(0, r, missed)
            m_all.index_copy_(0, r, m)
            v_all.index_copy_(0, r, v)
            seen = r[last_r > 0]
            last.index_fill_(0, seen, t)


_EXACT_STATE = ("last_step", "lr_history")    # catch-up state, restored with its own dtype


def _settle_on_read(opt_ref: Callable, p_ref: Callable, rows: Tensor) -> None:
    """The read hook of a catch-up table (tngram.kernels.sparse_rows.set_read_hook); holds the
    optimiser and the table weakly."""
    opt, p = opt_ref(), p_ref()
    if opt is not None and p is not None:
        opt.settle_rows(p, rows)


def _record_lr(state: dict, lr: float) -> None:
    """lr of the table's step state["step"] into state["lr_history"] (grown by doubling)."""
    t, hist = state["step"], state["lr_history"]
    if t > hist.numel():
        grown = torch.zeros(max(64, 2 * hist.numel(), t), dtype=torch.float64)
        grown[:hist.numel()] = hist
        state["lr_history"] = hist = grown
    hist[t - 1] = lr


def _horizon(b1: float, b2: float) -> int | None:
    """Missed steps after which a move is below 1e-12 of the first (r = b1/sqrt(b2) < 1), else None
    (every missed step counts)."""
    r = b1 / math.sqrt(b2) if b2 > 0 else math.inf
    if b1 == 0:
        return 1
    if r >= 1:
        return None
    return max(1, math.ceil(math.log(1e-12) / math.log(r)))


def settled_tables(optimizers: Iterable[torch.optim.Optimizer]) -> AbstractContextManager:
    """`settled()` of every catch-up table optimiser among `optimizers` (the trainer's evaluation)."""
    stack = ExitStack()
    for opt in optimizers:
        if isinstance(opt, _LazyRowAdam):
            stack.enter_context(opt.settled())
    return stack


def settle_tables(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """`settle()` every catch-up table optimiser among `optimizers` (the end of training)."""
    for opt in optimizers:
        if isinstance(opt, _LazyRowAdam):
            opt.settle()


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

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        inv = torch.where(v > 0, v.rsqrt(), torch.zeros_like(v))      # one v per row
        return m * (-coef * inv.to(torch.float64)).to(m.dtype).unsqueeze(1)


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

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        ratio = torch.where(v > 0, m / v.sqrt(), torch.zeros_like(m))
        return ratio * (-coef).to(m.dtype).unsqueeze(1)


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
                        eps: float, catchup: bool = False) -> tuple[torch.optim.Optimizer | None, list[dict]]:
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
            table_groups.append({**g, "params": [g["params"][i] for i in moved],
                                 "names": [g["names"][i] for i in moved], "optimizer": mode})
        if keep:
            rest.append(g if not moved else {**g, "params": [g["params"][i] for i in keep],
                                              "names": [g["names"][i] for i in keep]})
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
                      table: bool = False, catchup: bool = False) -> int:
    """Bytes of optimiser state the trainer allocates for one fp32 parameter tensor of `shape`:
    the rule `tngram plan` and `tngram experiment pareto` count by (tests/test_memory_update.py
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
        raise TngramError(f"optim.memory_update must be one of {MEMORY_UPDATES}, got {memory_update!r}")
    numel = math.prod(shape)
    width = shape[-1] if len(shape) else 1
    rows = numel // width if width else 0
    last = 4 * rows if catchup and table and memory_update != "dense" else 0
    if table and memory_update == "rowwise":
        return 4 * numel + 4 * rows + last
    if table and memory_update == "sparse":
        return 8 * numel + last
    if optimizer not in STATE_BYTES_PER_PARAM:
        raise TngramError(f"param_state_bytes: optimizer must be one of {tuple(STATE_BYTES_PER_PARAM)}, "
                          f"got {optimizer!r}")
    return STATE_BYTES_PER_PARAM[optimizer] * numel


__all__ = ["MEMORY_UPDATES", "STATE_BYTES_PER_PARAM", "LazyAdam", "RowwiseAdam", "clip_grad_norm",
           "optimizer_state_bytes", "param_state_bytes", "set_sparse_grads", "settle_tables",
           "settled_tables", "setup_memory_update"]
