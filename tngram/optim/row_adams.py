"""LazyAdam (torch.optim.SparseAdam's lazy Adam) and RowwiseAdam (one second moment per table row):
the per-row formulas on top of the shared row loop in `tngram.optim.lazy_rows`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tngram.optim.lazy_rows import LazyRowAdam


class RowwiseAdam(LazyRowAdam):
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
        state["exp_avg_sq_row"] = torch.zeros(
            p.numel() // p.shape[-1], dtype=torch.float32, device=p.device
        )

    def _moments(self, p: Tensor, state: dict) -> tuple[Tensor, Tensor]:
        return state["exp_avg"].view(-1, p.shape[-1]), state["exp_avg_sq_row"]

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
        m.mul_(b1).add_(vals, alpha=1 - b1)
        v.mul_(b2).add_(vals.float().square().mean(1), alpha=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
        return (m / denom.to(m.dtype).unsqueeze(1)).mul_(-lr / (1 - b1**t))

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        return m * self._kernel_factor(v, coef, m.dtype).unsqueeze(1)

    _ROWWISE = True

    def _kernel_factor(self, v_rows: Tensor, coef: Tensor, dtype: torch.dtype) -> Tensor:
        inv = torch.where(v_rows > 0, v_rows.rsqrt(), torch.zeros_like(v_rows))  # one v per row
        return (-coef * inv.to(torch.float64)).to(dtype)

    def _kernel_consts(self, t: int, lr: float, b1: float, b2: float) -> tuple[float, float]:
        return -lr / (1 - b1**t), math.sqrt(1 - b2**t)


class LazyAdam(LazyRowAdam):
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
        m.mul_(b1).add_(vals, alpha=1 - b1)
        v.mul_(b2).addcmul_(vals, vals, value=1 - b2)
        return (m / v.sqrt().add_(eps)).mul_(-lr * math.sqrt(1 - b2**t) / (1 - b1**t))

    def _missed_moves(self, m: Tensor, v: Tensor, coef: Tensor) -> Tensor:
        ratio = torch.where(v > 0, m / v.sqrt(), torch.zeros_like(m))
        return ratio * self._kernel_factor(v, coef, m.dtype).unsqueeze(1)

    def _kernel_factor(self, v_rows: Tensor, coef: Tensor, dtype: torch.dtype) -> Tensor:
        return (-coef).to(dtype)

    def _kernel_consts(self, t: int, lr: float, b1: float, b2: float) -> tuple[float, float]:
        return -lr * math.sqrt(1 - b2**t) / (1 - b1**t), 1.0
