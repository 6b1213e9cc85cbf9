"""Over-Encoding (OE) input n-gram embeddings - Over-Tokenized Transformer (Huang et al., ICML 2025,
arXiv 2501.16975); LongCat's N-gram Embedding is a configuration of it.

For each order i = 2..N and slice j = 0..k-1 (table index s = (i-2)*k + j, S = k*(N-1) tables):

    id_{i}(t)   = x_t + x_{t-1} V + ... + x_{t-i+1} V^{i-1}       (base-V number, newest digit least
                                                                  significant; x_{<0} := pad_id)
    r_s(t)      = id_i(t) mod m_s     computed per digit: r = (r + x_{t-l} * (V^l mod m_s)) mod m_s
    out         = tok_emb + sum_s W_s T_s[r_s(t)]                  T_s: (m_s, d_s), W_s: d_s -> d
    out         = out / (1 + S)                                    if average (OE/LongCat averaging)

Moduli: m_s = the S smallest odd integers >= table_rows that are co-prime with V, in order. They
are distinct (slices collide differently) and never a multiple of V (the paper's ablation: m = 64V
is worse). With an even table_rows and V a power of two this is exactly LongCat's m + 2s + 1.
Default table_rows = 5 * V (about 5V rows per slice, like Engram's per-head budget); default
slice width d_s = d / (k (N-1)) (OE: per-order width d/(N-1) cut into k slices).

The module is injected at the INPUT EMBEDDING: the GPT calls forward(tok_emb, input_ids) and uses
the returned tensor as its embedding (config attribute `injection = "embedding"`).

Init (not specified by the paper): tables N(0, 1) like Engram's; projections zero-init by default
(`zero_init_proj=True`), so with average=True the module starts as tok_emb / (1 + S) - a no-op up
to scale, which a following RMSNorm removes. zero_init_proj=False uses nn.Linear(d_s, d)'s
default init for each W_s.

Dimension letters: B batch, T time, D model width, N max order, S number of slice tables,
Ds slice width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory.base import INT_MAX, MemoryConfig, MemoryModule, RowSparse
from tngram.memory.ngrams import check_ids_in_forward, extend_with_history, suffix_ngrams
from tngram.memory.token_tables import gather_rows

INT64_MAX = 2**63 - 1


def oe_moduli(table_rows: int, n_tables: int, vocab_size: int) -> list[int]:
    """The S smallest odd integers >= table_rows that are co-prime with vocab_size."""
    if table_rows < 1:
        raise TngramError(f"Over-Encoding table_rows must be >= 1, got {table_rows}")
    out: list[int] = []
    m = table_rows | 1  # smallest odd >= table_rows
    while len(out) < n_tables:
        if math.gcd(m, vocab_size) == 1 or vocab_size == 1:
            out.append(m)
        m += 2
    return out


@dataclass(kw_only=True, frozen=True)
class OverEncodingConfig(MemoryConfig):
    """Over-Encoding hyper-parameters; `build` makes the module (one per model, at the input)."""

    kind: ClassVar[str] = "oe"
    row_sparse: ClassVar[bool] = True  # the table trains row-sparse (OverEncoding is RowSparse)
    injection: ClassVar[str] = "embedding"  # the GPT replaces its token embedding by forward(...)
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "max_ngram": (1, 32),
        "n_slices": (1, 1024),
        "table_rows": (1, INT_MAX),
        "slice_dim": (1, INT_MAX),
    }

    max_ngram: int = 3
    n_slices: int = 2
    table_rows: int | None = None  # None -> 5 * vocab_size (base modulus per slice table)
    slice_dim: int | None = None  # None -> d_model // (n_slices * (max_ngram - 1))
    pad_id: int = 0
    average: bool = True
    zero_init_proj: bool = True

    def check_fields(self) -> None:
        if self.max_ngram < 2:
            raise TngramError(f"Over-Encoding max_ngram must be >= 2, got {self.max_ngram}")
        if self.n_slices < 1:
            raise TngramError(f"Over-Encoding n_slices must be >= 1, got {self.n_slices}")
        if self.table_rows is not None and self.table_rows < 1:
            raise TngramError(f"Over-Encoding table_rows must be >= 1, got {self.table_rows}")
        if self.slice_dim is not None and self.slice_dim < 1:
            raise TngramError(f"Over-Encoding slice_dim must be >= 1, got {self.slice_dim}")

    @property
    def n_tables(self) -> int:
        return self.n_slices * (self.max_ngram - 1)

    def slice_width(self, d_model: int) -> int:
        ds = self.slice_dim if self.slice_dim is not None else d_model // self.n_tables
        if ds < 1:
            raise TngramError(
                f"Over-Encoding slice width is 0 for d_model={d_model} and "
                f"{self.n_tables} slice tables; set slice_dim"
            )
        return ds

    def moduli(self, vocab_size: int) -> list[int]:
        rows = self.table_rows if self.table_rows is not None else 5 * vocab_size
        return oe_moduli(rows, self.n_tables, vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not 0 <= self.pad_id < vocab_size:
            raise TngramError(f"Over-Encoding pad_id {self.pad_id} is outside [0, {vocab_size})")

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """Exact parameter count of `build(...)`: sum_s m_s * Ds + S * Ds * D."""
        ds = self.slice_width(d_model)
        return sum(self.moduli(vocab_size)) * ds + self.n_tables * ds * d_model

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "OverEncoding":
        """layer_id / layer_ids are ignored: OE has one module per model, at the input embedding."""
        return OverEncoding(self, d_model=d_model, vocab_size=vocab_size)


class OverEncoding(RowSparse, MemoryModule, nn.Module):
    """forward(tok_emb (B,T,D), input_ids (B,T)) -> new input embedding (B,T,D)."""

    # buffers (register_buffer), declared for the type checker
    moduli: Tensor
    powers: Tensor
    orders: Tensor
    offsets: Tensor

    def __init__(self, config: OverEncodingConfig, *, d_model: int, vocab_size: int) -> None:
        super().__init__()
        cfg = config
        cfg.check_vocab(vocab_size)
        self.config, self.d_model, self.vocab_size = cfg, d_model, vocab_size
        self.max_ngram, self.n_slices, self.n_tables = cfg.max_ngram, cfg.n_slices, cfg.n_tables
        self.slice_dim = cfg.slice_width(d_model)
        moduli = cfg.moduli(vocab_size)
        if max(moduli) * vocab_size > INT64_MAX:
            raise TngramError(
                f"Over-Encoding modulus {max(moduli)} x vocab {vocab_size} overflows int64"
            )
        # powers[s, l] = V^l mod m_s: the weight of digit x_{t-l} in table s
        powers = [[pow(vocab_size, l, m) for l in range(cfg.max_ngram)] for m in moduli]
        self.register_buffer("moduli", torch.tensor(moduli, dtype=torch.int64), persistent=False)
        self.register_buffer("powers", torch.tensor(powers, dtype=torch.int64), persistent=False)
        order = [2 + s // cfg.n_slices for s in range(self.n_tables)]  # n-gram order of table s
        self.register_buffer("orders", torch.tensor(order, dtype=torch.int64), persistent=False)
        offsets = torch.tensor([0] + moduli[:-1], dtype=torch.int64).cumsum(0)
        self.register_buffer("offsets", offsets)  # (S,) row offset per table
        self.n_rows = sum(moduli)
        self.table = nn.Embedding(self.n_rows, self.slice_dim)  # "mega" table, N(0, 1)
        # W = [W_0 | W_1 | ... | W_{S-1}]: one bias-free Linear(S*Ds, D) == sum_s W_s e_s
        self.proj = nn.Linear(self.n_tables * self.slice_dim, d_model, bias=False)
        if cfg.zero_init_proj:
            nn.init.zeros_(self.proj.weight)
        else:  # each block like its own nn.Linear(Ds, D): U(-1/sqrt(Ds), 1/sqrt(Ds))
            bound = 1.0 / math.sqrt(self.slice_dim)
            nn.init.uniform_(self.proj.weight, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"max_ngram={self.max_ngram}, n_slices={self.n_slices}, rows={self.n_rows}, "
            f"slice_dim={self.slice_dim}, moduli={self.moduli.tolist()}, "
            f"average={self.config.average}"
        )

    def table_parameters(self) -> list[nn.Parameter]:
        return [cast(nn.Parameter, self.table.weight)]

    def ngram_ids(self, input_ids: Tensor) -> Tensor:
        """Per-table n-gram ids r_s in [0, m_s): (B, T) -> (B, T, S) int64."""
        check_ids_in_forward(input_ids, self.vocab_size)
        grams = suffix_ngrams(
            input_ids, self.max_ngram, self.config.pad_id
        )  # (B, T, N), col l = x_{t-l}
        B, T, N = grams.shape
        r = torch.zeros(B, T, self.n_tables, dtype=torch.int64, device=grams.device)
        for l in range(N):
            # digit l only counts for tables whose order exceeds l; every term stays < m_s * V
            term = grams[..., l : l + 1] * self.powers[:, l]  # (B, T, S)
            term = torch.where(self.orders > l, term, torch.zeros_like(term))
            r = torch.remainder(r + term, self.moduli)
        return r

    def memory_vector(self, input_ids: Tensor) -> Tensor:
        """Concatenated slice embeddings (B, T) -> (B, T, S*Ds), before the projections."""
        rows = self.ngram_ids(input_ids) + self.offsets  # (B, T, S)
        B, T, _ = rows.shape
        # row-sparse table gradient with sparse_grad, and a table on another device read through
        # its touched rows (tngram.kernels.sparse_rows), same values
        flat = gather_rows(self.table.weight, rows, self.sparse_grad)  # (B, T, S, Ds)
        return flat.view(B, T, self.n_tables * self.slice_dim)

    def forward(
        self,
        tok_emb: Tensor,
        input_ids: Tensor,
        cache: dict | None = None,
        valid: Tensor | None = None,
    ) -> Tensor:
        """New input embedding (B, T, D); `cache` keeps the n-gram window for incremental decoding.
        valid: optional (B, T) bool mask (False = padding): padded ids read as pad_id in the
        windows and get no n-gram term."""
        if (
            tok_emb.dim() != 3
            or tok_emb.shape[:2] != input_ids.shape
            or tok_emb.shape[-1] != self.d_model
        ):
            raise TngramError(
                f"Over-Encoding expects tok_emb (B, T, {self.d_model}) matching "
                f"input_ids (B, T); got {tuple(tok_emb.shape)} and "
                f"{tuple(input_ids.shape)}"
            )
        ids, P = extend_with_history(input_ids, cache, self.max_ngram, self.config.pad_id, valid)
        mem = self.proj(self.memory_vector(ids)[:, P:])  # (B, T, D)
        if valid is not None:
            mem = mem.masked_fill(~valid.bool().unsqueeze(-1), 0.0)
        out = tok_emb + mem
        return out / (1 + self.n_tables) if self.config.average else out
