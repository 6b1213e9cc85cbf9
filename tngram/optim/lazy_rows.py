"""The row loop LazyAdam and RowwiseAdam share (`LazyRowAdam`): touched rows gathered, updated,
scattered back in chunks; the catch-up of lazy steps (`optim.memory_catchup`, the closed form in
`tngram.optim.memory_update`'s docstring); `settle` / `settled` for evaluation and the end of
training. The two optimisers' own formulas are in `tngram.optim.row_adams`.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch
from torch import Tensor

from tngram.kernels.row_update import (
    forced_row_impl,
    row_kernel_failed,
    row_update,
    row_update_impl,
)
from tngram.kernels.sparse_rows import set_read_hook


class LazyRowAdam(torch.optim.Optimizer):
    """What LazyAdam and RowwiseAdam share: the argument checks, the closure, the loop over the
    parameters with a gradient, the touched rows (`_rows_and_values`), the step count, and the
    gather / scatter of the touched rows' moments and weights. A subclass says which moments it
    keeps (`_init_state`, `_moments`) and how one step changes the touched rows (`_row_update`).
    Rows are the last dimension's vectors: a (V, W) table has V rows, (N, V, R) N*V rows."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        catchup: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"{type(self).__name__} needs lr >= 0, eps >= 0, betas in [0, 1); "
                f"got {lr}, {eps}, {betas}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "catchup": catchup})
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

    def _row_update(
        self,
        m: Tensor,
        v: Tensor,
        vals: Tensor,
        t: int,
        lr: float,
        b1: float,
        b2: float,
        eps: float,
    ) -> Tensor:
        """Update the touched rows' moments m, v in place from their gradient rows `vals` at the
        table's step t; return the rows' weight change."""
        raise NotImplementedError

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        """The rows' summed moves over their missed steps: -coef * m / sqrt(v) with the (rows,)
        float64 factor `coef` (catch-up; memory_update's docstring); m, v: the moments after the
        last step."""
        raise NotImplementedError

    # the Triton path (tngram.kernels.row_update): a subclass says which formula it is
    _ROWWISE = False

    def _kernel_factor(self, v_rows: Tensor, coef: Tensor, dtype: torch.dtype) -> Tensor:
        """(rows,) factor f of the missed moves in the kernel (missed = m f, or m/sqrt(v) f),
        computed in torch exactly as `_missed_moves` computes it; v_rows: the rows' moments."""
        raise NotImplementedError

    def _kernel_consts(self, t: int, lr: float, b1: float, b2: float) -> tuple[float, float]:
        """(c, bc2): the step's factor of m / denominator and sqrt(1 - b2^t) (rowwise's)."""
        raise NotImplementedError

    def _kernel_rows(
        self, p: Tensor, state: dict, rows: Tensor, vals: Tensor | None, group: dict
    ) -> bool:
        """Update p's touched `rows` (distinct flat ids; gradient rows `vals`, or None to only
        settle them before a read) with the Triton kernel when the table's device and dtype
        choose it (`row_update_impl`): True if done. False: torch does it (not chosen, or the
        kernel raised: one warning line, torch from then on, state untouched)."""
        if row_update_impl(p.device, p.dtype) != "triton":
            return False
        try:
            self._kernel_update(p, state, rows, vals, group)
        except Exception as e:  # any kernel failure falls back to torch
            if forced_row_impl() == "triton":
                raise
            row_kernel_failed(p.device, p.dtype, e)
            return False
        return True

    def _kernel_update(
        self, p: Tensor, state: dict, rows: Tensor, vals: Tensor | None, group: dict
    ) -> None:
        """The kernel's update of the touched rows: catch-up (when on) and the step (when vals),
        the same arithmetic as the torch path (tngram.kernels.row_update_triton)."""
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        t = state["step"]
        m_all, v_all = self._moments(p, state)
        last, mark, cu = None, 0, None
        if group.get("catchup", False):
            last, mark = state["last_step"], 1 if vals is not None else 2
            upto = t - 1 if vals is not None else t
            kc = _missed_steps(last.index_select(0, rows), upto, state["lr_history"], b1, b2)
            if kc is None and vals is None:
                return  # nothing owed: the rows stay as they are (the torch path's `continue`)
            if kc is not None:
                kd = kc[0].to(torch.float64)
                f = self._kernel_factor(v_all.index_select(0, rows), kc[1], m_all.dtype)
                cu = (f, (b1**kd).to(m_all.dtype), (b2**kd).to(v_all.dtype))
        c_step, bc2 = self._kernel_consts(t, lr, b1, b2) if vals is not None else (0.0, 1.0)
        row_update(
            p.view(-1, p.shape[-1]),
            m_all,
            v_all,
            rows.contiguous(),
            None if vals is None else vals.contiguous(),
            rowwise=self._ROWWISE,
            t_mark=t,
            b1=b1,
            b2=b2,
            c_step=c_step,
            bc2=bc2,
            eps=eps,
            last=last,
            mark=mark,
            catchup=cu,
        )

    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's overloads: one signature does the same
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
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
                        state["last_step"] = torch.zeros(
                            p.numel() // p.shape[-1], dtype=torch.int32, device=p.device
                        )
                        state["lr_history"] = torch.zeros(64, dtype=torch.float64)
                state["step"] += 1
                m_all, v_all = self._moments(p, state)
                flat = p.view(-1, p.shape[-1])
                if catchup:
                    _record_lr(state, lr)
                if rows is not None and self._kernel_rows(p, state, rows, vals, group):
                    continue
                if catchup:
                    if rows is None:
                        rows = torch.arange(flat.shape[0], device=p.device)
                    self._step_rows_catchup(flat, m_all, v_all, rows, vals, state, lr, b1, b2, eps)
                    continue
                if rows is None:
                    flat.add_(self._row_update(m_all, v_all, vals, state["step"], lr, b1, b2, eps))
                    continue
                # on the CPU the touched rows in chunks of ~_ROW_CHUNK_ELEMS entries (one chunk
                # on a GPU, _chunk_rows): a chunk's moments and weights are still in cache and TLB
                # when written back, and its temporaries are small enough for the allocator to
                # reuse (no fresh pages to fault in each step).
                # Row by row the same arithmetic, so the same numbers (docs/LOG.md 2026-11-25)
                n = _chunk_rows(vals)
                for a in range(0, rows.numel(), n):
                    r = rows[a : a + n]
                    m, v = m_all.index_select(0, r), v_all.index_select(0, r)
                    upd = self._row_update(m, v, vals[a : a + n], state["step"], lr, b1, b2, eps)
                    m_all.index_copy_(0, r, m)
                    v_all.index_copy_(0, r, v)
                    flat.index_add_(0, r, upd)
        return loss

    def _step_rows_catchup(
        self,
        flat: Tensor,
        m_all: Tensor,
        v_all: Tensor,
        rows: Tensor,
        vals: Tensor,
        state: dict,
        lr: float,
        b1: float,
        b2: float,
        eps: float,
    ) -> None:
        """The touched rows' step with catch-up: their missed steps' moves, then the usual one."""
        t, last = state["step"], state["last_step"]
        n = _chunk_rows(vals)
        for a in range(0, rows.numel(), n):
            r = rows[a : a + n]
            m, v = m_all.index_select(0, r), v_all.index_select(0, r)
            missed = self._catch_up(
                m, v, last.index_select(0, r), t - 1, state["lr_history"], b1, b2, eps
            )
            if missed is not None:  # a separate add: the same bits as when settled on read
                flat.index_add_(0, r, missed)
            upd = self._row_update(m, v, vals[a : a + n], t, lr, b1, b2, eps)
            m_all.index_copy_(0, r, m)
            v_all.index_copy_(0, r, v)
            last.index_fill_(0, r, t)
            flat.index_add_(0, r, upd)

    def _catch_up(
        self,
        m: Tensor,
        v: Tensor,
        last: Tensor,
        upto: int,
        lr_history: Tensor,
        b1: float,
        b2: float,
        eps: float,
    ) -> Tensor | None:
        """Rows whose last step is `last` (0 = never): their moves at steps last+1..upto (None when
        there are none), and their moments decayed to step `upto` in place."""
        kc = _missed_steps(last, upto, lr_history, b1, b2)
        if kc is None:
            return None
        k, coef = kc
        moves = self._missed_moves(m, v, coef)
        kd = k.to(torch.float64)
        m.mul_((b1**kd).to(m.dtype).view(-1, *([1] * (m.dim() - 1))))
        v.mul_((b2**kd).to(v.dtype).view(-1, *([1] * (v.dim() - 1))))
        return moves

    def _pending(self, p: Tensor, state: dict, group: dict) -> Tensor | None:
        """The (rows, width) moves dense Adam has made on p's rows since each row's last step, up to
        the table's current step; the moments decayed accordingly (copies; state unchanged)."""
        if not group.get("catchup", False) or "last_step" not in state:
            return None
        (b1, b2), eps = group["betas"], group["eps"]
        m_all, v_all = self._moments(p, state)
        return self._catch_up(
            m_all.clone(),
            v_all.clone(),
            state["last_step"],
            state["step"],
            state["lr_history"],
            b1,
            b2,
            eps,
        )

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
                moves = self._catch_up(
                    m_all,
                    v_all,
                    state["last_step"],
                    state["step"],
                    state["lr_history"],
                    b1,
                    b2,
                    eps,
                )
                if moves is not None:
                    p.view(-1, p.shape[-1]).add_(moves)
                state["last_step"].masked_fill_(state["last_step"] > 0, state["step"])

    @contextmanager
    def settled(self) -> Iterator[None]:
        """Inside: the tables' weights with every row's owed moves applied (for evaluation);
        after: the weights exactly as before, state untouched. No-op without catch-up."""
        saved = []
        self._settled_depth += 1  # rows read meanwhile are not settled again (read hook)
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
        if self._kernel_rows(p, state, rows, None, group):
            return
        (b1, b2), eps = group["betas"], group["eps"]
        t, last = state["step"], state["last_step"]
        m_all, v_all = self._moments(p, state)
        flat = p.view(-1, p.shape[-1])
        n = _chunk_rows(p)
        for a in range(0, rows.numel(), n):
            r = rows[a : a + n]
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


_EXACT_STATE = ("last_step", "lr_history")  # catch-up state, restored with its own dtype


def _settle_on_read(opt_ref: Callable, p_ref: Callable, rows: Tensor) -> None:
    """The read hook of a catch-up table (tngram.kernels.sparse_rows.set_read_hook); holds the
    optimiser and the table weakly."""
    opt, p = opt_ref(), p_ref()
    if opt is not None and p is not None:
        opt.settle_rows(p, rows)


def _missed_steps(
    last: Tensor, upto: int, lr_history: Tensor, b1: float, b2: float
) -> tuple[Tensor, Tensor] | None:
    """Rows whose last step is `last` (0 = never), brought to step `upto`: (k (rows,) int64 missed
    steps, coef (rows,) float64 factor of their summed missed moves, -coef m/sqrt(v)), or None when
    no row missed a step (catch-up; tngram.optim.memory_update's docstring)."""
    s = last.to(torch.int64)
    k = torch.where(s > 0, upto - s, torch.zeros_like(s))  # missed steps per row
    if not k.numel() or int(k.max()) <= 0:
        return None
    # the factor depends on the row only through its last step: compute it once per distinct one
    starts, which = torch.unique(s, return_inverse=True)
    n_missed = torch.where(starts > 0, upto - starts, torch.zeros_like(starts))  # (U,)
    horizon = _horizon(b1, b2)  # a fixed length: the same sums whichever rows come along
    J = int(n_missed.max()) if horizon is None else horizon
    j = torch.arange(1, J + 1, dtype=torch.int64, device=s.device)  # (J,)
    u = starts.unsqueeze(1) + j.unsqueeze(0)  # (U, J) the missed step ids
    valid = j.unsqueeze(0) <= n_missed.unsqueeze(1)
    uf, jf = u.clamp(1, max(upto, 1)).to(torch.float64), j.to(torch.float64)
    lr_u = lr_history.to(s.device)[u.clamp(1, max(upto, 1)) - 1]
    # step u's move of a row last stepped at s = u - j, eps left out:
    #   lr_u sqrt(1 - b2^u)/(1 - b1^u) (b1/sqrt(b2))^j * m_s/sqrt(v_s)
    a = lr_u * torch.sqrt(1 - b2**uf) / (1 - b1**uf) * (b1 / math.sqrt(b2)) ** jf
    coef = torch.where(valid, a, torch.zeros_like(a)).sum(1)[which]  # (rows,)
    return k, coef


def _record_lr(state: dict, lr: float) -> None:
    """lr of the table's step state["step"] into state["lr_history"] (grown by doubling)."""
    t, hist = state["step"], state["lr_history"]
    if t > hist.numel():
        grown = torch.zeros(max(64, 2 * hist.numel(), t), dtype=torch.float64)
        grown[: hist.numel()] = hist
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
    """`settled()` of every catch-up table optimiser among `optimizers` (the trainer's eval)."""
    stack = ExitStack()
    for opt in optimizers:
        if isinstance(opt, LazyRowAdam):
            stack.enter_context(opt.settled())
    return stack


def settle_tables(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """`settle()` every catch-up table optimiser among `optimizers` (the end of training)."""
    for opt in optimizers:
        if isinstance(opt, LazyRowAdam):
            opt.settle()


# entries per chunk of touched rows in LazyRowAdam.step (~1 MB fp32 per gathered tensor; 256-1024
# rows x 352 measured alike, 1 thread, AMD EPYC: 13-14 ms against 35 ms unchunked at V = 32k)
_ROW_CHUNK_ELEMS = 1 << 18


def _chunk_rows(t: Tensor) -> int:
    """Touched rows per chunk for rows of t's width on t's device. The chunks are a CPU cache
    choice; on a GPU each chunk is ~13 more kernel launches (at paper-l9 TN-gram shapes, 16 x 1024
    tokens, ~300 chunks per table), so there every row goes in one chunk. Row by row the same
    arithmetic either way (tests/test_memory_update_chunks.py)."""
    if t.device.type != "cpu":
        return max(1, t.numel() // max(1, t.shape[-1]))
    return max(1, _ROW_CHUNK_ELEMS // max(1, t.shape[-1]))


def _rows_and_values(p: Tensor) -> tuple[Tensor | None, Tensor]:
    """(flat row ids or None for all rows, (rows, width) gradient values) of p.grad."""
    width, grad = p.shape[-1], p.grad
    assert grad is not None  # the step skips parameters without a gradient
    if not grad.is_sparse:
        return None, grad.reshape(-1, width)
    g = grad.coalesce()
    ind, vals = g.indices(), g.values().reshape(-1, width)
    return (ind[0] if ind.shape[0] == 1 else _flat_rows(ind, p.shape[:-1])), vals


def _flat_rows(ind: Tensor, lead: torch.Size | tuple[int, ...]) -> Tensor:
    """Row-major flat row ids from the (k, nnz) indices of a sparse tensor with k sparse dims:
    rows = ind[d] + rows * lead[d], one integer op per dim after the first (exact)."""
    rows = ind[0]
    for d in range(1, ind.shape[0]):
        rows = torch.add(ind[d], rows, alpha=lead[d])
    return rows
