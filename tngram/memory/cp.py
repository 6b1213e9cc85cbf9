"""Pure math of TN-gram's CP-factorised n-gram memory (paper §4, Eqs. 9-11 and 13-14).

Factors A_1..A_N (each V x R) are stored as one tensor `factors` of shape (N, V, R), ordered
oldest -> newest: factors[i] = A_{i+1}. Order-absorption vectors w_1..w_{N-2} are `absorb`
(N-2, R). For order n in 2..N the token-space vector at position t is (Eq. 10)

    b_n = w_1 * ... * w_{N-n} * A_{N-n+1}[x_{t-n+1}] * ... * A_N[x_t]          (* = Hadamard)

and the memory vector is e_n = exp(l_n) * RMSNorm(b_n) (Eq. 11), concatenated over n = 2..N.

Computation: one gather of the N factor rows per position, then a running product from the
newest token backwards, p_k = A_N[x_t] * ... * A_{N-k+1}[x_{t-k+1}], so b_n = p_n * W_{N-n} with
W_m = w_1 * ... * w_m (W_0 = 1).

Dimension letters: B batch, T time, N max order, V vocab, R CP rank, D model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gather_factor_rows(factors: Tensor, ngrams: Tensor) -> Tensor:
    """Rows A_{N-k}[x_{t-k}] for k = 0..N-1 (newest first).

    factors: (N, V, R); ngrams: (B, T, N) with column k = x_{t-k} -> (B, T, N, R).
    """
    N, V, R = factors.shape
    # column k (token x_{t-k}) uses factor index N-1-k (A_{N-k})
    which = torch.arange(N - 1, -1, -1, device=ngrams.device) * V  # (N,)
    flat = (ngrams + which).reshape(-1)  # (B*T*N,)
    rows = torch.index_select(factors.reshape(N * V, R), 0, flat)  # index_select: fast CPU gather
    return rows.view(*ngrams.shape, R)  # (B, T, N, R)


def absorption_products(absorb: Tensor | None, N: int, R: int, like: Tensor) -> Tensor:
    """W_{N-n} for n = 2..N as (N-1, R): row i (order n = i+2) is w_1 * ... * w_{N-2-i}.

    absorb: (N-2, R) or None (the "without absorption" ablation: all ones).
    """
    ones = like.new_ones(1, R)
    if absorb is None or N <= 2:
        return ones.expand(N - 1, R)
    cum = torch.cumprod(absorb, dim=0)  # W_1..W_{N-2}: (N-2, R)
    return torch.cat([ones, cum], dim=0).flip(0)  # (N-1, R): W_{N-2}..W_0


def order_vectors(factors: Tensor, absorb: Tensor | None, ngrams: Tensor) -> Tensor:
    """Unnormalised b_n for n = 2..N (Eq. 10): (B, T, N, ...) -> (B, T, N-1, R), index n-2."""
    N, V, R = factors.shape
    rows = gather_factor_rows(factors, ngrams)  # (B, T, N, R)
    prefix = torch.cumprod(rows, dim=2)  # p_1..p_N
    W = absorption_products(absorb, N, R, factors)  # (N-1, R)
    return prefix[:, :, 1:, :] * W  # (B, T, N-1, R)


def order_embeddings(
    b: Tensor, log_scales: Tensor | None, use_norm: bool = True, eps: float = 1e-6
) -> Tensor:
    """e_n = exp(l_n) * RMSNorm(b_n) (Eq. 11), concatenated: (B, T, N-1, R) -> (B, T, (N-1)*R).

    log_scales: (N-1,) or None (the "without learnable scales" ablation: s_n = 1).
    use_norm=False is the "without RMSNorm" ablation: e_n = s_n * b_n.
    """
    B, T, K, R = b.shape
    e = F.rms_norm(b, (R,), eps=eps) if use_norm else b
    if log_scales is not None:
        e = e * torch.exp(log_scales).view(K, 1)
    return e.reshape(B, T, K * R)


def explicit_f_memory(e_orders: Tensor, F_mat: Tensor, W: Tensor) -> Tensor:
    """Reference (non-absorbed) projection used by tests: k = [e_2 F^T | ... | e_N F^T] W.

    e_orders: (B, T, N-1, R); F_mat: (D, R); W: ((N-1)*D, D_out) -> (B, T, D_out). This is the
    paper's d_concat W_K before absorbing F: it equals e_concat M with M_n = F^T W_n (Eq. 13).
    """
    B, T, K, R = e_orders.shape
    h = e_orders @ F_mat.T  # (B, T, N-1, D)
    return h.reshape(B, T, -1) @ W


def absorb_f(F_mat: Tensor, W: Tensor, n_orders: int) -> Tensor:
    """M = blockdiag(F^T, ..., F^T) W, i.e. M_n = F^T W_n per order: ((N-1)*R, D_out)."""
    D, R = F_mat.shape
    Wn = W.view(n_orders, D, -1)  # (N-1, D, D_out)
    return (F_mat.T.unsqueeze(0) @ Wn).reshape(n_orders * R, -1)  # (N-1)*R x D_out
