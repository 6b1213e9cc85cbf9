"""TN-gram: tensorized n-gram memory with shared CP factors (the paper's module).

    ids -> suffix n-grams (left pad) -> gather A_{N-k}[x_{t-k}] -> running Hadamard products
        -> b_n (Eq. 10) -> e_n = exp(l_n) RMSNorm(b_n) (Eq. 11) -> e_concat ((N-1) R)
        -> absorbed K/V projections M_K, M_V (Eq. 13-14) -> Engram's gate + conv (App. D) -> y

y is the block's memory output; the caller adds it to the residual stream.

Initialisation (documented choice, see docs/LOG.md): factor entries are a random sign times
exp(sigma * g), g ~ N(0, 1), sigma = `factor_init_std` (0.1). Every b_n then has entries of
magnitude near 1 for any N (log-magnitude std sigma * sqrt(n)), so the product of eight factors
stays in a sane range, while distinct tokens get near-orthogonal random sign patterns. A plain
N(0, 1) init (`factor_init="normal"`) is available; its product of n factors has log-magnitude
std ~1.1 sqrt(n), so at N = 8 a few coordinates dominate each vector. Absorption vectors start
at 1 and log-scales at 0 (s_n = 1).

The lookup runs fused by default (`fused=True`, tngram.kernels: same equations, a hand-written
backward, see research/PERFORMANCE.md); `fused=False` runs the plain-autograd reference of cp.py.
Which kernel runs and the dtype e is written in are the kernel policy's (tngram.kernels.policy;
the environment variable TNGRAM_LOOKUP_IMPL forces a kernel); whether the forward checks ids
against the vocabulary is TNGRAM_CHECK_IDS's (tngram.memory.ngrams). Neither changes a number.

Ablations (paper Fig. 4 right): use_norm=False drops RMSNorm (e_n = s_n b_n); learn_scales=False
fixes s_n = 1 (no parameter); use_absorption=False removes w entirely, so each lower order uses
only its own factors, b_n = A_{N-n+1}[x_{t-n+1}] * ... * A_N[x_t] (equivalent to w fixed at 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.kernels import fused_lookup, lookup_out_dtype, lookup_output_for
from tngram.memory.base import INT_MAX, MemoryConfig, MemoryModule, RowSparse
from tngram.memory.cp import order_embeddings, order_vectors
from tngram.memory.gating import GatedFusion
from tngram.memory.ngrams import check_ids_in_forward, extend_with_history, suffix_ngrams
from tngram.memory.tngram_variants import (
    ORDER_COMBINES,
    HashedOrders,
    link_shared_factors,
    lookup_width,
    variant_param_count,
)


FUSED_NEEDED = (
    "optim.memory_update sparse/rowwise needs the fused TN-gram lookup: set model.memory.fused=true"
)


@dataclass(kw_only=True, frozen=True)
class TNGramConfig(MemoryConfig):
    max_ngram: int = 5  # N: orders 2..N
    cp_rank: int = 1024  # R
    pad_id: int = 0  # left padding token id
    use_norm: bool = True
    learn_scales: bool = True
    use_absorption: bool = True
    factor_init: str = "sign"  # "sign" (random sign * exp(std * g)) or "normal" (N(0, 1))
    factor_init_std: float = 0.1
    norm_eps: float = 1e-6
    kernel_size: int = 3  # paper: kernel 3 ...
    dilation: int | None = None  # ... dilation N (None -> max_ngram)
    hc_mult: int = 1
    kv_bias: bool = True  # shared gate code with Engram (the reference has biases)
    zero_init_value: bool = True
    zero_init_conv: bool = True
    fused: bool = True  # lookup via tngram.kernels (same math as cp.py, faster)
    # adaptive CP rank (tngram.memory.cp_rank): after optimiser step `prune_at_step` (0: off) the
    # rank-1 components are scored by energy and the fewest holding (1 - prune_energy_tol) of it
    # are kept (never fewer than min_cp_rank); the rest are removed from every tensor.
    prune_at_step: int = 0
    prune_energy_tol: float = 0.1
    min_cp_rank: int = 8
    # variants beyond the paper (tngram.memory.tngram_variants; docs/TRAINING.md "TN-gram
    # variants beyond the paper"); the defaults are the paper's module, bit for bit
    order_combine: str = "concat"  # "sum": K/V read sum_n e_n (R features), not e_concat
    kv_rank: int = 0  # > 0: low-rank K/V, e -> Linear(kv_rank, no bias) -> K/V
    share_factors: bool = False  # one A_1..A_N for every memory layer of the model
    hash_orders: tuple[int, ...] = ()  # hybrid: an Engram-style hashed table for these orders
    hash_heads: int = 4  # hybrid: heads (primes) per hashed order
    hash_embed: int = 64  # hybrid: width per hashed order (hash_heads * head dim)
    hash_budget: int = 0  # hybrid: per-head prime budget (0: 5 * vocab_size)
    hash_seed: int = 0  # hybrid: hash multiplier seed (as Engram's seed)

    kind: ClassVar[str] = "tngram"
    row_sparse: ClassVar[bool] = True  # the factors (and hashed table) train row-sparse
    injection: ClassVar[str] = "block"
    reshape_step_field: ClassVar[str] = "prune_at_step"  # adaptive CP rank (cp_rank.py)
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "max_ngram": (2, 32),  # N: orders 2..N
        "cp_rank": (1, INT_MAX),
        "min_cp_rank": (1, INT_MAX),
        "kernel_size": (1, 256),
        "dilation": (1, 1024),
        "hc_mult": (1, 64),
        "hash_heads": (1, 1024),
        "hash_embed": (1, INT_MAX),
    }
    positive_floats: ClassVar[frozenset[str]] = frozenset({"factor_init_std", "norm_eps"})
    # written to config.json only when not at their default (earlier runs' configs unchanged)
    omit_at_default: ClassVar[tuple[str, ...]] = (
        "order_combine",
        "kv_rank",
        "share_factors",
        "hash_orders",
        "hash_heads",
        "hash_embed",
        "hash_budget",
        "hash_seed",
    )

    def check_fields(self) -> None:
        # max_ngram, cp_rank and prune_at_step ranges: int_bounds / check() (checked once there)
        if not 0.0 <= self.prune_energy_tol < 1.0:
            raise TngramError(
                f"TN-gram prune_energy_tol must be in [0, 1), got {self.prune_energy_tol}"
            )
        if self.prune_at_step > 0 and not 1 <= self.min_cp_rank <= self.cp_rank:
            raise TngramError(
                f"TN-gram min_cp_rank must be in [1, cp_rank={self.cp_rank}], "
                f"got {self.min_cp_rank}"
            )
        if self.factor_init not in ("sign", "normal"):
            raise TngramError(
                f"TN-gram factor_init must be 'sign' or 'normal', got {self.factor_init!r}"
            )
        self._check_variants()

    def _check_variants(self) -> None:
        if self.order_combine not in ORDER_COMBINES:
            raise TngramError(
                f"model.memory.order_combine must be one of {ORDER_COMBINES}, "
                f"got {self.order_combine!r}"
            )
        orders = tuple(self.hash_orders)
        if any(not 2 <= n <= self.max_ngram for n in orders) or list(orders) != sorted(set(orders)):
            raise TngramError(
                f"model.memory.hash_orders must be increasing distinct orders in "
                f"[2, max_ngram={self.max_ngram}], got {orders}"
            )
        if orders and self.hash_embed % self.hash_heads:
            raise TngramError(
                f"model.memory.hash_embed ({self.hash_embed}) must be a multiple of "
                f"hash_heads ({self.hash_heads})"
            )
        if self.prune_at_step and self.is_variant():
            raise TngramError(
                "model.memory.prune_at_step (adaptive CP rank) works with the paper's "
                "module only: set order_combine='concat', kv_rank=0, "
                "share_factors=false, hash_orders=[]"
            )

    def is_variant(self) -> bool:
        """True when a switch of tngram_variants is on (the module is not the paper's)."""
        return (
            self.order_combine != "concat"
            or self.kv_rank > 0
            or self.share_factors
            or bool(self.hash_orders)
        )

    def link_layers(self, modules: list[nn.Module]) -> None:
        """Called by the model after building one module per memory layer (in layer order):
        with share_factors, the first owns A_1..A_N and the others use them."""
        if self.share_factors:
            link_shared_factors(modules)

    def row_sparse_problem(self) -> str:
        """The row-sparse factor gradient comes from the fused lookup only."""
        return "" if self.fused else FUSED_NEEDED

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not 0 <= self.pad_id < vocab_size:
            raise TngramError(f"TN-gram pad_id must lie in [0, {vocab_size}), got {self.pad_id}")

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "TNGram":
        return TNGram(self, d_model, vocab_size, layer_id=layer_id, layer_ids=layer_ids)

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        N, R, d, M = self.max_ngram, self.cp_rank, d_model, self.hc_mult
        layer_ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
        shared_elsewhere = self.share_factors and layer_id != layer_ids[0]
        n = 0 if shared_elsewhere else N * vocab_size * R  # factors (once when shared)
        n += (N - 2) * R if self.use_absorption and N > 2 else 0  # w_1..w_{N-2}
        n += (N - 1) if self.learn_scales else 0  # l_2..l_N
        extra, d_mem = variant_param_count(self, vocab_size, layer_id, layer_ids)
        n += extra  # hash table, W_down (variants)
        n += (M + 1) * (d_mem * d + (d if self.kv_bias else 0))  # M_K per branch + shared M_V
        n += 2 * M * d + M * d * self.kernel_size + M * d  # gate norms, conv, conv norms
        return n


class TNGram(RowSparse, MemoryModule, nn.Module):
    def __init__(
        self,
        config: TNGramConfig,
        d_model: int,
        vocab_size: int,
        *,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        config.check_vocab(vocab_size)
        self.config, self.d_model, self.vocab_size = config, d_model, vocab_size
        N, R = config.max_ngram, config.cp_rank
        self.factors = nn.Parameter(torch.empty(N, vocab_size, R))  # (N, V, R): A_1..A_N
        self.absorb = (
            nn.Parameter(torch.ones(N - 2, R)) if config.use_absorption and N > 2 else None
        )
        self.log_scales = nn.Parameter(torch.zeros(N - 1)) if config.learn_scales else None
        # variants (tngram_variants): None / the lookup width with every switch at its default
        self.hashed: HashedOrders | None = None
        self.kv_down: nn.Linear | None = None
        d_mem = lookup_width(config)  # (N-1) R, or R ("sum")
        if config.hash_orders:
            ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
            self.hashed = HashedOrders(config, vocab_size, layer_id, ids)
            d_mem += self.hashed.width
        if config.kv_rank:
            self.kv_down = nn.Linear(d_mem, config.kv_rank, bias=False)
            d_mem = config.kv_rank
        self.fusion = GatedFusion(
            d_mem,
            d_model,
            hc_mult=config.hc_mult,
            kernel_size=config.kernel_size,
            dilation=config.dilation or N,
            kv_bias=config.kv_bias,
            zero_init_value=config.zero_init_value,
            zero_init_conv=config.zero_init_conv,
        )
        self.reset_factors()

    def table_parameters(self) -> list[nn.Parameter]:
        hashed = [] if self.hashed is None else [cast(nn.Parameter, self.hashed.table.weight)]
        return [self.factors] + hashed  # the CP factor tables, then the hybrid's table

    def use_factors_of(self, owner: "TNGram") -> None:
        """share_factors: drop this module's own A_1..A_N and read `owner`'s (same shape). The
        shared tensor stays a parameter of the owner only, so it is counted, optimised and saved
        once; `self.factors` returns it."""
        own = self._parameters["factors"]
        assert own is not None  # registered as an nn.Parameter in __init__
        if owner.factors.shape != own.shape:
            raise TngramError(
                f"share_factors: factor shapes differ {tuple(owner.factors.shape)} "
                f"vs {tuple(own.shape)}"
            )
        del self._parameters["factors"]
        self.__dict__["_factor_owner"] = [owner]  # a list: not registered as a submodule

    def __getattr__(self, name: str) -> Any:
        if name == "factors":
            owner = self.__dict__.get("_factor_owner")
            if owner is not None:
                return owner[0].factors
        return super().__getattr__(name)

    def row_sparse_problem(self) -> str:
        return self.config.row_sparse_problem()

    def control_parameters(self) -> list[nn.Parameter]:
        own = [p for p in (self.absorb, self.log_scales) if p is not None]
        return own + self.fusion.control_parameters()

    @torch.no_grad()
    def reset_factors(self) -> None:
        c = self.config
        if c.factor_init == "normal":
            self.factors.normal_()
        else:
            sign = torch.randint(0, 2, self.factors.shape).mul_(2).sub_(1).to(self.factors.dtype)
            self.factors.copy_(
                sign * torch.exp(c.factor_init_std * torch.randn(self.factors.shape))
            )

    def ngrams(self, input_ids: Tensor) -> Tensor:
        check_ids_in_forward(input_ids, self.vocab_size)
        return suffix_ngrams(input_ids, self.config.max_ngram, self.config.pad_id)  # (B, T, N)

    def memory_vector(
        self, input_ids: Tensor, out_dtype: torch.dtype | None = None, sum_orders: bool = False
    ) -> Tensor:
        """The lookup stage: ids (B, T) -> e_concat (B, T, (N-1) R), everything before K/V.

        fused=True runs `tngram.kernels.tngram_lookup` (one gather, in-cache chunks, hand-written
        backward; Triton on CUDA); fused=False the plain-autograd reference of cp.py.
        out_dtype: see `fused_lookup` (a kernel may return e already cast to it; same numbers).
        sum_orders: sum_n e_n (B, T, R) instead (order_combine="sum"; the Triton kernel sums in
        its epilogue, see `fused_lookup`).
        """
        c = self.config
        if c.fused:
            return fused_lookup(
                self.factors,
                self.absorb,
                self.log_scales,
                self.ngrams(input_ids),
                use_norm=c.use_norm,
                eps=c.norm_eps,
                out_dtype=out_dtype,
                sparse_grad=self.sparse_grad and torch.is_grad_enabled(),
                sum_orders=sum_orders,
            )
        if self.sparse_grad:
            raise TngramError(FUSED_NEEDED)
        b = order_vectors(self.factors, self.absorb, self.ngrams(input_ids))  # (B, T, N-1, R)
        e = order_embeddings(b, self.log_scales, self.config.use_norm, self.config.norm_eps)
        return e.unflatten(-1, (c.max_ngram - 1, c.cp_rank)).sum(-2) if sum_orders else e

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h: (B, T, D) or (B, T, M, D), input_ids: (B, T) -> memory output y, shaped like h.

        cache: a dict kept between calls for incremental decoding (n-gram window, conv state).
        valid: optional (B, T) bool mask of real tokens (False = padding): padded positions
        read as pad_id in the n-gram windows, stay out of the conv state and output 0.
        """
        if h.dim() not in (3, 4) or h.shape[:2] != input_ids.shape or h.shape[-1] != self.d_model:
            raise TngramError(
                f"TN-gram expects h of shape (B, T, {self.d_model}) or (B, T, M, "
                f"{self.d_model}) matching input_ids (B, T); got h "
                f"{tuple(h.shape)} and input_ids {tuple(input_ids.shape)}"
            )
        ids, P = extend_with_history(
            input_ids, cache, self.config.max_ngram, self.config.pad_id, valid
        )
        lowp = lookup_out_dtype(h)  # dtype policy: tngram.kernels.policy
        summed = self.config.order_combine == "sum"  # summed in the lookup (its epilogue on CUDA)
        e = lookup_output_for(self.memory_vector(ids, lowp, summed)[:, P:], h, lowp)
        if self.config.is_variant():
            e = self.variant_input(e, ids, P)
        return self.fusion(h, e, cache, valid)

    def variant_input(self, e: Tensor, ids: Tensor, P: int) -> Tensor:
        """The variants' stage between lookup and K/V (tngram_variants): e (B, T, lookup_width) of
        the positions after the P history ids of `ids` (e_concat, or already summed over the
        orders for order_combine="sum") -> the K/V input (B, T, d_mem)."""
        c = self.config
        if self.hashed is not None:
            z = self.hashed(suffix_ngrams(ids, c.max_ngram, c.pad_id))[:, P:]
            e = torch.cat([e, z.to(e.dtype)], dim=-1)
        if self.kv_down is not None:
            e = self.kv_down(e)
        return e

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"N={c.max_ngram}, cp_rank={c.cp_rank}, vocab={self.vocab_size}, d_model={self.d_model}"
        )
