"""TN-gram variants beyond the paper: switches on TNGramConfig, all off by default.

With every switch at its default a TN-gram is the paper's module, bit for bit (no parameter, no
RNG draw and no operation is added). Each switch changes one stage between the CP lookup and
Engram's gate (docs/TRAINING.md "TN-gram variants beyond the paper"):

    e_concat (B, T, (N-1) R)                       the paper's lookup (Eqs. 10-11)
      order_combine="sum":  e = sum_n e_n          (B, T, R): the K/V projections read R features
                                                   instead of (N-1) R (a cheaper step, `d`)
      hash_orders=(n, ...): e = [e | z]            z: an Engram-style hashed table for orders n
                                                   (hybrid, `c`): seen n-grams get their own rows
      kv_rank=r > 0:        e = e W_down^T         (B, T, r), no bias: low-rank K/V (`d`)
    -> GatedFusion (K/V, gate, conv), unchanged

share_factors=True (`b`): every memory layer of a model uses one A_1..A_N; each layer keeps its
own absorption, scales, K/V, gate and conv. The model builds one module per layer, then calls
the config's `link_layers(modules)`, which makes the first layer's module the owner of the
factors and points the others at it (`TNGram.use_factors_of`). The shared tensor is then one
parameter: counted once in Δparams (`param_count` counts it for the first layer only), in one
optimiser group (memory_table) and saved once in state dicts (under the owner's name).

"lean" is the ablation winners (research/RESULTS.md, Fig. 4 right): use_norm=False,
use_absorption=False; the recipe `mini-tngram-lean` and `LEAN` below name it.

Dimension letters: B batch, T time, N max order, R CP rank, H hash heads, E hash width per order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tngram.memory.base import RowSparse
from tngram.memory.hashing import allocate_primes, hash_multipliers, ngram_hash
from tngram.memory.token_tables import gather_rows

ORDER_COMBINES = ("concat", "sum")
# the ablation winners as TNGramConfig field overrides (recipe mini-tngram-lean)
LEAN: dict[str, Any] = {"use_norm": False, "use_absorption": False}


def hash_primes(
    cfg: Any, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
) -> list[list[int]]:
    """Per-head table sizes [[p_{n,j}] for n in hash_orders] of one layer. Same allocation as
    Engram (tngram.memory.hashing.allocate_primes: global, distinct primes over layers, orders
    and heads), over the hashed orders only."""
    budget = cfg.hash_budget or 5 * vocab_size
    k = len(cfg.hash_orders)
    layers = tuple(layer_ids) if layer_id in layer_ids else (layer_id,)
    return allocate_primes([budget] * k, k + 1, cfg.hash_heads, list(layers))[layer_id]


class HashedOrders(RowSparse, nn.Module):
    """The hybrid's hashed table: for each order n in `hash_orders` and head j, row
    z_{n,j}(t) = (XOR_{k<n} x_{t-k} m_k) mod p_{n,j} of one table (Engram's hash, §2.2, on the raw
    ids), rows concatenated over (order, head): (B, T, N) n-grams -> (B, T, |orders| * E)."""

    # buffers (register_buffer), declared for the type checker
    multipliers: Tensor
    primes: Tensor
    cols: Tensor
    offsets: Tensor

    def __init__(
        self, cfg: Any, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> None:
        super().__init__()
        N, H = cfg.max_ngram, cfg.hash_heads
        self.orders, self.n_head = tuple(cfg.hash_orders), H
        self.head_dim = cfg.hash_embed // H
        self.width = len(self.orders) * cfg.hash_embed
        primes = hash_primes(cfg, vocab_size, layer_id, layer_ids)
        # ngram_hash hashes every order 2..N; the unused orders get modulus 1 and are dropped
        full = torch.ones(N - 1, H, dtype=torch.int64)
        for n, ps in zip(self.orders, primes):
            full[n - 2] = torch.tensor(ps, dtype=torch.int64)
        cols = torch.tensor([(n - 2) * H + j for n in self.orders for j in range(H)])
        flat = [p for ps in primes for p in ps]
        offsets = torch.tensor([0] + flat[:-1], dtype=torch.int64).cumsum(0)
        mult = hash_multipliers(vocab_size, N, layer_id, cfg.hash_seed)
        self.register_buffer("multipliers", torch.from_numpy(mult.copy()), persistent=False)
        self.register_buffer("primes", full.reshape(-1), persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.n_rows = sum(flat)
        self.table = nn.Embedding(self.n_rows, self.head_dim)  # N(0, 1), as Engram

    def rows(self, ngrams: Tensor) -> Tensor:
        """(B, T, N) n-grams (column k = x_{t-k}) -> table rows (B, T, |orders| * H)."""
        z = ngram_hash(ngrams, self.multipliers, self.primes, self.n_head)  # (B, T, (N-1) H)
        return z.index_select(-1, self.cols) + self.offsets

    def forward(self, ngrams: Tensor) -> Tensor:
        rows = self.rows(ngrams)
        B, T, _ = rows.shape
        # row-sparse table gradient with sparse_grad, a table on another device read through its
        # touched rows (tngram.kernels.sparse_rows), same values
        return gather_rows(self.table.weight, rows, self.sparse_grad).view(B, T, self.width)

    def extra_repr(self) -> str:
        return (
            f"orders={self.orders}, heads={self.n_head}, head_dim={self.head_dim}, "
            f"rows={self.n_rows}"
        )


def lookup_width(cfg: Any) -> int:
    """Width of the lookup's output after order_combine: (N-1) R, or R for "sum"."""
    return cfg.cp_rank if cfg.order_combine == "sum" else (cfg.max_ngram - 1) * cfg.cp_rank


def variant_param_count(
    cfg: Any, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
) -> tuple[int, int]:
    """(parameters of the variant stages: hash table + W_down, the K/V input width d_mem)."""
    n, d_mem = 0, lookup_width(cfg)
    if cfg.hash_orders:
        rows = sum(sum(ps) for ps in hash_primes(cfg, vocab_size, layer_id, layer_ids))
        n += rows * (cfg.hash_embed // cfg.hash_heads)
        d_mem += len(cfg.hash_orders) * cfg.hash_embed
    if cfg.kv_rank:
        n += d_mem * cfg.kv_rank
        d_mem = cfg.kv_rank
    return n, d_mem


def link_shared_factors(modules: list[nn.Module]) -> None:
    """share_factors: the first TN-gram module owns A_1..A_N; every other one uses them."""
    shared = [m for m in modules if getattr(getattr(m, "config", None), "share_factors", False)]
    # share_factors is a TNGramConfig field, so these are TNGram modules (typed Any: this file is
    # imported by memory/tngram.py and must not import it back, even for type checking)
    tn: list[Any] = shared
    for m in tn[1:]:
        m.use_factors_of(tn[0])
