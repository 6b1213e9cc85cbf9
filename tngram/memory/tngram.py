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
Adaptive rank (prune_at_step, prune_energy_tol, min_cp_rank): tngram.memory.cp_rank.

`TNGramConfig` holds exactly these settings. What goes beyond the paper (the orders summed, a
low-rank K/V, shared factors, the hashed hybrid) is its own kind, `tngram-variant`
(tngram.memory.tngram_variants), built on the hooks `kv_input_width` / `kv_input` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.kernels import fused_lookup, lookup_out_dtype, lookup_output_for
from tngram.memory.base import INT_MAX, MemoryConfig, MemoryModule, RowSparse
from tngram.memory.cp import order_embeddings, order_vectors
from tngram.memory.gating import GatedFusion
from tngram.memory.ngrams import check_ids_in_forward, extend_with_history, suffix_ngrams


FUSED_NEEDED = (
    "optim.memory_update sparse/rowwise needs the fused TN-gram lookup: set model.memory.fused=true"
)


@dataclass(kw_only=True, frozen=True)
class TNGramConfig(MemoryConfig):
    """The paper's TN-gram: its equations, ablations and adaptive rank, nothing else.

    max_ngram N, cp_rank R, pad_id      A_1..A_N (V x R), n-grams left-padded    Eqs. 9-10
    use_absorption                      w_1..w_{N-2} in b_n (off: w = 1)          Eq. 10
    use_norm, learn_scales, norm_eps    e_n = s_n RMSNorm(b_n), s_n = exp(l_n)     Eq. 11
    kernel_size, dilation, hc_mult,     M_K, M_V on e_concat, Engram's gate and    Eqs. 12-14,
    kv_bias, zero_init_value/_conv      short conv                                 App. D
    factor_init, factor_init_std        how A_k starts (module doc)
    fused                               which lookup implementation (same numbers)
    prune_at_step, prune_energy_tol,    adaptive CP rank (tngram.memory.cp_rank)
    min_cp_rank
    """

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

    kind: ClassVar[str] = "tngram"
    row_sparse: ClassVar[bool] = True  # the factors train row-sparse
    injection: ClassVar[str] = "block"
    reshape_step_field: ClassVar[str] = "prune_at_step"  # adaptive CP rank (cp_rank.py)
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "max_ngram": (2, 32),  # N: orders 2..N
        "cp_rank": (1, INT_MAX),
        "min_cp_rank": (1, INT_MAX),
        "kernel_size": (1, 256),
        "dilation": (1, 1024),
        "hc_mult": (1, 64),
    }
    positive_floats: ClassVar[frozenset[str]] = frozenset({"factor_init_std", "norm_eps"})
    # fields of kind tngram-variant: a config dict or a --set of kind tngram naming one is read
    # as that kind (tngram.memory.migrate_memory_dict)
    moved_fields: ClassVar[dict[str, str]] = dict.fromkeys(
        (
            "order_combine",
            "kv_rank",
            "share_factors",
            "hash_orders",
            "hash_heads",
            "hash_embed",
            "hash_budget",
            "hash_seed",
        ),
        "tngram-variant",
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
        d_mem = (self.max_ngram - 1) * self.cp_rank  # e_concat
        return self.lookup_param_count(vocab_size) + self.fusion_param_count(d_model, d_mem)

    def lookup_param_count(self, vocab_size: int) -> int:
        """A_1..A_N, w_1..w_{N-2} and l_2..l_N (Eqs. 10-11)."""
        N, R = self.max_ngram, self.cp_rank
        n = N * vocab_size * R  # factors
        n += (N - 2) * R if self.use_absorption and N > 2 else 0  # w_1..w_{N-2}
        return n + ((N - 1) if self.learn_scales else 0)  # l_2..l_N

    def fusion_param_count(self, d_model: int, d_mem: int) -> int:
        """M_K per branch, the shared M_V (Eqs. 13-14), Engram's gate norms and conv (App. D)
        reading a K/V input of width d_mem."""
        d, M = d_model, self.hc_mult
        n = (M + 1) * (d_mem * d + (d if self.kv_bias else 0))  # M_K per branch + shared M_V
        return n + 2 * M * d + M * d * self.kernel_size + M * d  # gate norms, conv, conv norms


class TNGram(RowSparse, MemoryModule, nn.Module):
    config: TNGramConfig

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
        d_mem = self.kv_input_width(
            layer_id, (layer_id,) if layer_ids is None else tuple(layer_ids)
        )
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

    def kv_input_width(self, layer_id: int, layer_ids: tuple[int, ...]) -> int:
        """Width of the K/V input: e_concat's (N-1) R. A variant builds the stages it adds
        between the lookup and K/V here (before the gate's parameters are drawn)."""
        return (self.config.max_ngram - 1) * self.config.cp_rank

    def table_parameters(self) -> list[nn.Parameter]:
        return [self.factors]  # the CP factor tables A_1..A_N

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
        sum_orders: sum_n e_n (B, T, R) instead (the variant order_combine="sum",
        tngram.memory.tngram_variants; the Triton kernel sums in its epilogue, see
        `fused_lookup`).
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
        return self.fusion(h, self.kv_input(ids, P, h), cache, valid)

    def kv_input(self, ids: Tensor, P: int, h: Tensor) -> Tensor:
        """e_concat (B, T, (N-1) R) of the positions after the P history ids of `ids` (Eqs.
        10-11), in the dtype the kernel policy (tngram.kernels.policy) picks for h."""
        lowp = lookup_out_dtype(h)
        return lookup_output_for(self.memory_vector(ids, lowp)[:, P:], h, lowp)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"N={c.max_ngram}, cp_rank={c.cp_rank}, vocab={self.vocab_size}, d_model={self.d_model}"
        )
