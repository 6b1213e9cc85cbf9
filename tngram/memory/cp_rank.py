"""Adaptive CP rank for TN-gram: score rank-1 components, choose which to keep, remove the rest.

A rank-1 component r of a TN-gram module lives in (E = (N-1) R, orders n = 2..N at block n-2):

    factors[:, :, r]                         column r of every factor A_1..A_N        (N, V, R)
    absorb[:, r]                             entry r of every absorption vector       (N-2, R)
    key_proj[m].weight[:, (n-2) R + r]       row r of order n's block of M_K^(m)      (D, E)
    value_proj.weight[:, (n-2) R + r]        row r of order n's block of M_V          (D, E)

(nn.Linear stores M^T, so the paper's rows of M are our columns.)

Score = the component's expected squared contribution to K and V, with the n tokens of an n-gram
drawn uniformly and independently from the vocabulary (a data-free proxy, documented in
docs/LOG.md):

    q_k[r]        = mean_v A_k[v, r]^2                                      (N, R)
    E b_n[r]^2    = W_{N-n}[r]^2 * prod_{k=N-n+1..N} q_k[r]                   (N-1, R)  Eq. 10
    E e_n[r]^2    = s_n^2 * E b_n[r]^2 / mean_r' E b_n[r']^2   (RMSNorm, ratio of expectations)
    score[r]      = sum_n E e_n[r]^2 * (sum_m |M_K^(m)[n, r]|^2 + |M_V[n, r]|^2)

choose_keep keeps the fewest components (largest scores first) holding (1 - tol) of the total,
never fewer than min_cp_rank. prune_tngram removes the others from every tensor above, slices
every optimiser-state tensor shaped like its parameter (Adam moments, Muon momentum) the same
way, and corrects the per-order log-scales for RMSNorm's new denominator:

    RMSNorm(b)_r = b_r / sqrt(mean_{r'} b_{r'}^2 + eps): after pruning the mean runs over the R'
    kept entries, so l_n += 0.5 log( (sum_kept E b_n^2 / R') / (sum_all E b_n^2 / R) ).

Exact: when every removed component has b_n[r] = 0 at every position (e.g. a zero column of the
newest factor A_N, used by every order), the per-position ratio is R / R' for every token, so
the kept outputs are unchanged up to eps, and the removed ones contributed 0: the module's output
is preserved up to eps. Not exact otherwise: the true ratio varies per position (it is the share
of that position's energy held by the kept components) and the correction uses its expectation
under the proxy above; the removed components' own K/V contributions are lost. Without RMSNorm
(use_norm=False) no correction is needed; without learned scales (learn_scales=False) none is
possible and the kept entries are scaled by the per-position ratio.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tngram.memory.cp import absorption_products

if TYPE_CHECKING:
    from tngram.memory.tngram import TNGram


def order_energy(factors: Tensor, absorb: Tensor | None) -> Tensor:
    """E b_n[r]^2 under uniform independent tokens: factors (N, V, R), absorb (N-2, R) -> (N-1, R).

    Row i is order n = i + 2 (it uses the n newest factors A_{N-n+1}..A_N).
    """
    N, V, R = factors.shape
    q = factors.detach().double().pow(2).mean(dim=1)  # (N, R)
    newest_first = torch.cumprod(q.flip(0), dim=0)  # row j: prod of the j+1 newest
    W = absorption_products(
        None if absorb is None else absorb.detach().double(), N, R, q
    )  # (N-1, R)
    return newest_first[1:] * W.pow(2)  # (N-1, R)


def component_scores(module: TNGram) -> Tensor:
    """Energy score of every rank-1 component of a TNGram module: (R,), float64, >= 0."""
    c = module.config
    N, R = c.max_ngram, module.factors.shape[2]
    eb = order_energy(module.factors, module.absorb)  # (N-1, R)
    if c.use_norm:
        ee = eb / eb.mean(dim=1, keepdim=True).clamp_min(1e-300)
    else:
        ee = eb
    if module.log_scales is not None:
        ee = ee * torch.exp(2 * module.log_scales.detach().double()).view(N - 1, 1)
    fusion = module.fusion
    proj = 0
    for lin in [*fusion.key_proj, fusion.value_proj]:
        w = lin.weight.detach().double().view(-1, N - 1, R)  # (D, N-1, R)
        proj = proj + w.pow(2).sum(dim=0)  # (N-1, R)
    return (ee * proj).sum(dim=0)  # (R,)


def choose_keep(scores: Tensor, tol: float, min_cp_rank: int) -> Tensor:
    """Sorted indices of the fewest components holding >= (1 - tol) of sum(scores).

    scores (R,) >= 0. Ties keep the lower index. At least min(min_cp_rank, R) are kept; with all
    scores zero exactly that many (the lowest indices).
    """
    R = scores.numel()
    floor = max(1, min(int(min_cp_rank), R))
    order = torch.argsort(scores.double(), descending=True, stable=True)
    cum = torch.cumsum(scores.double()[order], dim=0)  # (R,)
    total = cum[-1]
    if total <= 0:
        k = floor
    else:
        k = int(torch.searchsorted(cum, (1.0 - tol) * total).item()) + 1
        k = max(floor, min(k, R))
    return torch.sort(order[:k]).values


def log_scale_correction(module: TNGram, keep: Tensor) -> Tensor:
    """Additive change of l_n (N-1,) so RMSNorm over the kept entries matches on average."""
    R, Rk = module.factors.shape[2], keep.numel()
    eb = order_energy(module.factors, module.absorb)  # (N-1, R)
    full = eb.sum(dim=1) / R
    kept = eb[:, keep].sum(dim=1) / Rk
    ok = (full > 0) & (kept > 0)
    return torch.where(
        ok, 0.5 * torch.log(kept.clamp_min(1e-300) / full.clamp_min(1e-300)), torch.zeros_like(full)
    )


def _slice_param(
    owner: nn.Module,
    attr: str,
    dim: int,
    index: Tensor,
    optimizers: Iterable[torch.optim.Optimizer],
) -> None:
    """owner.attr <- a new Parameter holding owner.attr.index_select(dim, index); the optimisers'
    param groups point to the new Parameter and every state tensor shaped like the old one is
    sliced the same way.

    A new Parameter, not `p.data = ...`: autograd caches a leaf's shape in its gradient
    accumulator, so a leaf that has already had a backward cannot change shape in place.
    """
    p = getattr(owner, attr)
    new = nn.Parameter(
        p.detach().index_select(dim, index.to(p.device)).contiguous(), requires_grad=p.requires_grad
    )
    setattr(owner, attr, new)
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new if q is p else q for q in group["params"]]
        state = opt.state.pop(p, None)
        if state:
            opt.state[new] = {
                k: v.index_select(dim, index.to(v.device)).contiguous()
                if torch.is_tensor(v) and v.shape == p.shape
                else v
                for k, v in state.items()
            }


@torch.no_grad()
def prune_tngram(
    module: TNGram,
    keep: Tensor,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    correct_scales: bool = True,
) -> int:
    """Keep only components `keep` (sorted indices into 0..R-1) of a TNGram module, in place.

    The sliced tensors become new Parameter objects; `optimizers` are updated to them (param
    groups and state, see _slice_param). Pass every optimiser that holds any of the module's
    parameters. Returns the new rank R'.
    """
    optimizers = list(optimizers)
    c = module.config
    N, R = c.max_ngram, module.factors.shape[2]
    keep = keep.to(torch.long).cpu()
    if (
        keep.numel() < 1
        or keep.min() < 0
        or keep.max() >= R
        or keep.unique().numel() != keep.numel()
    ):
        raise ValueError(
            f"keep must hold distinct indices in [0, {R}), got {keep.tolist()[:10]}..."
        )
    Rk = keep.numel()
    if correct_scales and c.use_norm and module.log_scales is not None:
        module.log_scales.add_(log_scale_correction(module, keep).to(module.log_scales.dtype))
    cols = (torch.arange(N - 1).view(-1, 1) * R + keep.view(1, -1)).reshape(-1)  # ((N-1) R',)
    _slice_param(module, "factors", 2, keep, optimizers)
    if module.absorb is not None:
        _slice_param(module, "absorb", 1, keep, optimizers)
    fusion = module.fusion
    for lin in [*fusion.key_proj, fusion.value_proj]:
        _slice_param(lin, "weight", 1, cols, optimizers)
        lin.in_features = (N - 1) * Rk
    fusion.d_mem = (N - 1) * Rk
    module.config = replace(c, cp_rank=Rk)
    return Rk


def tngram_modules(model: nn.Module) -> list[tuple[str, TNGram]]:
    from tngram.memory.tngram import TNGram

    return [(name, m) for name, m in model.named_modules() if isinstance(m, TNGram)]


def prune_model(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> list[tuple[str, int, int]]:
    """Prune every TN-gram module of `model` by its own config (tol, min_cp_rank).

    Each module picks its own rank. Returns (module name, rank before, rank after) per module.
    """
    optimizers = list(optimizers)
    out = []
    for name, m in tngram_modules(model):
        c = m.config
        before = m.factors.shape[2]
        keep = choose_keep(component_scores(m), c.prune_energy_tol, c.min_cp_rank)
        after = prune_tngram(m, keep, optimizers) if keep.numel() < before else before
        out.append((name, before, after))
    return out


def _shrink(module: TNGram, cp_rank: int, optimizers: list[torch.optim.Optimizer]) -> bool:
    """Keep the first `cp_rank` components of a TN-gram module (no log-scale correction: the values
    are about to be overwritten by a load); False when it is not larger than that."""
    if cp_rank >= module.factors.shape[2]:
        return False
    with torch.device(
        "cpu"
    ):  # index tensors on CPU even inside a meta-device build (from_pretrained)
        prune_tngram(module, torch.arange(cp_rank), optimizers, correct_scales=False)
    return True


def shrink_to_state(
    model: nn.Module, tensors: dict[str, Tensor], optimizers: Iterable[torch.optim.Optimizer] = ()
) -> list[tuple[str, int, int]]:
    """Before loading weights saved after pruning: shrink each TN-gram module whose stored
    factors have fewer components to that rank (the first R' components; the loaded values then
    overwrite them), pointing `optimizers` at the new parameters. Returns (module name, rank
    before, rank after) for each shrunk module."""
    optimizers = list(optimizers)
    out = []
    for name, m in tngram_modules(model):
        key = f"{name}.factors" if name else "factors"
        if key in tensors:
            before, stored = m.factors.shape[2], tensors[key].shape[-1]
            if _shrink(m, stored, optimizers):
                out.append((name, before, stored))
    return out


def shrink_to_ranks(model: nn.Module, ranks: list[int]) -> None:
    """Shrink the TN-gram modules of a freshly built `model` to `ranks` (model order) keeping their
    first components, before loading weights saved at those ranks (e.g. a pruned run's HF
    export)."""
    mods = tngram_modules(model)
    if len(ranks) != len(mods) or any(
        not 1 <= r <= m.factors.shape[2] for r, (_, m) in zip(ranks, mods)
    ):
        raise ValueError(
            f"cp_ranks {ranks} do not fit this model's TN-gram ranks {cp_ranks(model)}"
        )
    for r, (_, m) in zip(ranks, mods):
        _shrink(m, r, [])


def cp_ranks(model: nn.Module) -> list[int]:
    """Current CP rank of every TN-gram module of `model` (model order)."""
    return [m.factors.shape[2] for _, m in tngram_modules(model)]
