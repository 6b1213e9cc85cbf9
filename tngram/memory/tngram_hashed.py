"""TN-gram with hashed factor rows (`kind = "tngram-hashed"`): the paper's module for R/V << 1.

The paper's factors A_1..A_N are V x R, so at a 32k vocabulary a CP rank R that fits a budget is
R/V ~ 0.01, where an independent reproduction (research/RESULTS.md, "TN-gram and the vocabulary")
found the CP table losing to Engram's hashed rows. Here each factor is a pool of V' rows
(`factor_rows`, chosen near R, so R/V' ~ 1) and a token reads k of them (`n_hashes`), as hash
embeddings (Svenstrup et al., 2017) and compositional embeddings (Shi et al., 2020) do:

    h_1(x) = x mod V'      h_2(x) = floor(x / V') mod V'
    h_j(x) = ((a_j x + c_j) mod P) mod V'     j >= 3 (P = 2^31 - 1; a_j, c_j from hash_seed)

    combine="prod":   A~_i[x] = A_i[h_1(x)] * ... * A_i[h_k(x)]          (* = Hadamard)
    combine="sum":    A~_i[x] = sum_j p_{i,j}(x) A_i[h_j(x)]             (p: per-token importance
                                                                          weights, N x V x k)

With k >= 2 and V'^2 >= V the pair (h_1, h_2) is distinct for every token (the quotient-remainder
trick), so no two tokens share all their rows. Everything after A~ is the paper's module,
unchanged (tngram.memory.cp, Eqs. 10-14):

    b_n = w_1 * ... * w_{N-n} * A~_{N-n+1}[x_{t-n+1}] * ... * A~_N[x_t]       (Eq. 10)
    e_n = exp(l_n) RMSNorm(b_n)      e_concat = [e_2 | ... | e_N]             (Eq. 11)
    K/V = e_concat M_K, e_concat M_V (absorbed, Eqs. 13-14) -> Engram's gate + conv (App. D)

Theorem 1 (the (n-1)-gram's b_{n-1} is a linear combination of the n-gram's b_n over the dropped
token) holds as stated with A~_i in place of A_i: its proof uses only the product form of b_n and
the full column rank of A~_{N-n+1}, a V x R matrix that has it generically when V >= R and the
k-tuples of rows are distinct. The absorbed K/V projections are unchanged. What changes is the
parameter count, N V' R (+ N V k importance weights for "sum") instead of N V R, and that R/V'
stays near 1 whatever V is. factor_rows = V with n_hashes = 1 is the paper's module (h_1 is the
identity), bit for bit on the same factors (tests/test_tngram_hashed.py).

Initialisation: pool entries as TN-gram's (a random sign times exp(0.1 g)), so a product of k rows
keeps entries of magnitude near 1; for "sum", p_{i,1} = 1 and p_{i,j>1} = 0, so training starts
from the plain hashing trick (one row per token) and learns how much of the other rows to mix in.

Kernels: per batch, the distinct tokens u are hashed, their rows A~[u] (N, U, R) are formed with
torch ops (a gather of k rows per token, row-sparse gradient under optim.memory_update
sparse/rowwise, tngram.kernels.sparse_rows.compact_rows), and the n-grams, remapped to u, go
through TN-gram's own fused lookup (tngram.kernels.fused_lookup: the C kernel on CPU, Triton on
CUDA, its torch fallback elsewhere) on that (N, U, R) table; its gradient flows back to the pool.

Dimension letters: B batch, T time, N max order, V vocab, V' pool rows, k hashes, R CP rank,
U distinct tokens of a batch, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.kernels import fused_lookup, lookup_out_dtype, lookup_output_for
from tngram.memory.base import INT_MAX, MemoryConfig, MemoryModule, RowSparse
from tngram.memory.gating import GatedFusion
from tngram.memory.ngrams import check_ids_in_forward, extend_with_history, suffix_ngrams
from tngram.kernels.sparse_rows import compact_rows, host_read

COMBINES = ("prod", "sum")
HASH_PRIME = (1 << 31) - 1  # the universal hashes h_j, j >= 3


@dataclass(kw_only=True, frozen=True)
class TNGramHashedConfig(MemoryConfig):
    max_ngram: int = 5  # N: orders 2..N
    cp_rank: int = 1024  # R
    factor_rows: int = 1024  # V': rows of each factor pool (R/V' ~ 1)
    n_hashes: int = 2  # k: rows a token reads from each pool
    combine: str = "prod"  # "prod" (Hadamard of the k rows) | "sum" (importance-weighted sum)
    hash_seed: int = 0  # a_j, c_j of h_j for j >= 3
    pad_id: int = 0  # left padding token id
    use_norm: bool = True
    learn_scales: bool = True
    use_absorption: bool = True
    factor_init_std: float = 0.1
    norm_eps: float = 1e-6
    kernel_size: int = 3
    dilation: int | None = None  # None -> max_ngram
    hc_mult: int = 1
    kv_bias: bool = True
    zero_init_value: bool = True
    zero_init_conv: bool = True

    kind: ClassVar[str] = "tngram-hashed"
    row_sparse: ClassVar[bool] = True  # the pools (and importance weights) train row-sparse
    injection: ClassVar[str] = "block"
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "max_ngram": (2, 32),
        "cp_rank": (1, INT_MAX),
        "factor_rows": (1, INT_MAX),
        "n_hashes": (1, 16),
        "kernel_size": (1, 256),
        "dilation": (1, 1024),
        "hc_mult": (1, 64),
    }
    positive_floats: ClassVar[frozenset[str]] = frozenset({"factor_init_std", "norm_eps"})

    def check_fields(self) -> None:
        if self.combine not in COMBINES:
            raise TngramError(
                f"model.memory.combine must be one of {COMBINES}, got {self.combine!r}"
            )

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not 0 <= self.pad_id < vocab_size:
            raise TngramError(
                f"TN-gram (hashed) pad_id must lie in [0, {vocab_size}), got {self.pad_id}"
            )

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "TNGramHashed":
        return TNGramHashed(self, d_model, vocab_size)

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        N, R, d, M = self.max_ngram, self.cp_rank, d_model, self.hc_mult
        n = N * self.factor_rows * R  # the pools
        n += N * vocab_size * self.n_hashes if self.combine == "sum" else 0  # importance weights
        n += (N - 2) * R if self.use_absorption and N > 2 else 0  # w_1..w_{N-2}
        n += (N - 1) if self.learn_scales else 0  # l_2..l_N
        n += (M + 1) * ((N - 1) * R * d + (d if self.kv_bias else 0))  # M_K per branch + M_V
        n += 2 * M * d + M * d * self.kernel_size + M * d  # gate norms, conv, conv norms
        return n


def hash_rows(tokens: Tensor, rows: int, k: int, seed: int) -> Tensor:
    """tokens (U,) int64 -> pool rows (U, k): h_1 = x mod V', h_2 = floor(x / V') mod V', then
    ((a_j x + c_j) mod P) mod V' with a_j, c_j drawn from `seed` (never from the global RNG)."""
    cols = [tokens % rows]
    if k >= 2:
        cols.append(torch.div(tokens, rows, rounding_mode="floor") % rows)
    if k >= 3:
        g = torch.Generator().manual_seed(1_000_003 + seed)
        ab = torch.randint(1, HASH_PRIME, (k - 2, 2), generator=g).tolist()
        cols += [((a * tokens + c) % HASH_PRIME) % rows for a, c in ab]
    return torch.stack(cols, dim=-1)


class TNGramHashed(RowSparse, MemoryModule, nn.Module):
    def __init__(self, config: TNGramHashedConfig, d_model: int, vocab_size: int) -> None:
        super().__init__()
        config.check_vocab(vocab_size)
        self.config, self.d_model, self.vocab_size = config, d_model, vocab_size
        N, R, Vp, k = config.max_ngram, config.cp_rank, config.factor_rows, config.n_hashes
        self.factors = nn.Parameter(torch.empty(N, Vp, R))  # (N, V', R): the pools of A~_1..A~_N
        self.importance = (
            nn.Parameter(torch.zeros(N, vocab_size, k)) if config.combine == "sum" else None
        )
        self.absorb = (
            nn.Parameter(torch.ones(N - 2, R)) if config.use_absorption and N > 2 else None
        )
        self.log_scales = nn.Parameter(torch.zeros(N - 1)) if config.learn_scales else None
        self.fusion = GatedFusion(
            (N - 1) * R,
            d_model,
            hc_mult=config.hc_mult,
            kernel_size=config.kernel_size,
            dilation=config.dilation or N,
            kv_bias=config.kv_bias,
            zero_init_value=config.zero_init_value,
            zero_init_conv=config.zero_init_conv,
        )
        self.reset_factors()

    @torch.no_grad()
    def reset_factors(self) -> None:
        sign = torch.randint(0, 2, self.factors.shape).mul_(2).sub_(1).to(self.factors.dtype)
        std = self.config.factor_init_std
        self.factors.copy_(sign * torch.exp(std * torch.randn(self.factors.shape)))
        if self.importance is not None:
            self.importance.zero_()
            self.importance[..., 0] = 1.0  # start as the hashing trick: one row per token

    def table_parameters(self) -> list[nn.Parameter]:
        return [self.factors] + ([self.importance] if self.importance is not None else [])

    def control_parameters(self) -> list[nn.Parameter]:
        own = [p for p in (self.absorb, self.log_scales) if p is not None]
        return own + self.fusion.control_parameters()

    def read_rows(self, table: Tensor, ids: Tensor) -> Tensor:
        """table (N, rows, W) read at flat row ids (..., values in [0, N rows)) -> (..., W); the
        table's gradient row-sparse under sparse_grad (tngram.kernels.sparse_rows.compact_rows,
        one block per factor, as TN-gram's lookup), dense otherwise; a table on another device is
        read through its touched rows."""
        N, _, W = table.shape
        flat = ids.reshape(-1)
        sparse = self.sparse_grad and torch.is_grad_enabled()
        if sparse or host_read(table, flat):
            sub, inv = compact_rows(table, flat, blocks=N, sparse=sparse)
            rows = torch.index_select(sub, 0, inv)
        else:
            rows = torch.index_select(table.reshape(-1, W), 0, flat)
        return rows.view(*ids.shape, W)

    def token_factors(self, tokens: Tensor) -> Tensor:
        """A~_i[u] for the distinct tokens u (U,) -> (N, U, R): k pool rows per token, combined."""
        c = self.config
        N, Vp, R = self.factors.shape
        rows = hash_rows(tokens, Vp, c.n_hashes, c.hash_seed)  # (U, k)
        block = torch.arange(N, device=tokens.device).view(N, 1, 1)
        g = self.read_rows(self.factors, rows + block * Vp)  # (N, U, k, R)
        if self.importance is None:  # Hadamard over the k rows
            out = g[:, :, 0]
            for j in range(1, c.n_hashes):
                out = out * g[:, :, j]
            return out
        V = self.vocab_size
        p = self.read_rows(self.importance, tokens.view(1, -1) + block.view(N, 1) * V)  # (N, U, k)
        return (p.unsqueeze(-1) * g).sum(2)  # (N, U, R)

    def memory_vector(self, input_ids: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """ids (B, T) -> e_concat (B, T, (N-1) R): the paper's lookup on A~ (fused kernels)."""
        c = self.config
        check_ids_in_forward(input_ids, self.vocab_size)
        ngrams = suffix_ngrams(input_ids, c.max_ngram, c.pad_id)  # (B, T, N)
        tokens, local = torch.unique(ngrams, return_inverse=True)  # (U,), (B, T, N) in [0, U)
        table = self.token_factors(tokens)  # (N, U, R)
        return fused_lookup(
            table,
            self.absorb,
            self.log_scales,
            local,
            use_norm=c.use_norm,
            eps=c.norm_eps,
            out_dtype=out_dtype,
        )

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h (B, T, D) or (B, T, M, D), input_ids (B, T) -> memory output y shaped like h; cache
        and valid as TN-gram's (incremental decoding; padding masks)."""
        if h.dim() not in (3, 4) or h.shape[:2] != input_ids.shape or h.shape[-1] != self.d_model:
            raise TngramError(
                f"TN-gram (hashed) expects h of shape (B, T, {self.d_model}) or (B, T, M, "
                f"{self.d_model}) matching input_ids (B, T); got h {tuple(h.shape)} and "
                f"input_ids {tuple(input_ids.shape)}"
            )
        ids, P = extend_with_history(
            input_ids, cache, self.config.max_ngram, self.config.pad_id, valid
        )
        lowp = lookup_out_dtype(h)
        e = lookup_output_for(self.memory_vector(ids, lowp)[:, P:], h, lowp)
        return self.fusion(h, e, cache, valid)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"N={c.max_ngram}, cp_rank={c.cp_rank}, factor_rows={c.factor_rows}, "
            f"n_hashes={c.n_hashes}, combine={c.combine}, vocab={self.vocab_size}"
        )
