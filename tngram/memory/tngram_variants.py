"""TN-gram variants: the paper's module with stages beyond the paper, kind `tngram-variant`.

`TNGramVariantConfig` is `TNGramConfig` (the paper's settings, tngram.memory.tngram) plus the
eight fields below; with each at its default the module is the paper's, bit for bit (no
parameter, RNG draw or operation is added). Each field changes one stage between the CP lookup
(Eqs. 10-11: e_n = s_n RMSNorm(b_n), n = 2..N) and the K/V projections (Eqs. 13-14); Engram's
gate and conv (App. D) are unchanged. The stages run in this order:

    e = e_concat = [e_2 | ... | e_N]                              (B, T, (N-1) R)   the paper
    summed orders   order_combine="sum"
        e = sum_{n=2..N} e_n                                      (B, T, R)
    hashed hybrid   hash_orders=(n, ...), hash_heads H, hash_embed E, hash_budget, hash_seed
        z_{n,j}(t) = Z[o_{n,j} + (XOR_{k<n} x_{t-k} m_k) mod p_{n,j}]      j = 1..H, rows E/H wide
        e = [e | z_{n,1} | ... | z_{n,H} | ...]                   (B, T, width + |orders| E)
    low-rank K/V    kv_rank=r > 0
        e = e W_down^T,  W_down (r, width), no bias               (B, T, r)
    k_t = e M_K,  v_t = e M_V                                     Eqs. 13-14 on e's width

    shared factors  share_factors=True
        every memory layer reads the same A_1..A_N in Eq. 10; each keeps its own w, l_n, M_K,
        M_V, gate and conv

The hybrid's hash is Engram's (§2.2-2.4, tngram.memory.hashing) on the raw ids: multipliers m_k
drawn from hash_seed and the layer, p_{n,j} distinct primes from hash_budget up (0: 5 V) over
layers, orders and heads, o_{n,j} each head's offset in one table Z. "sum" with hash_orders is
the pareto family tngram-hsum (recipes mini-tngram-hsum, paper-l9-tngram-hsum).

Shared factors: the model builds one module per layer, then calls the config's
`link_layers(modules)`, which makes the first layer's module the owner of the factors and points
the others at it (`SharesParameters.share_parameter`). The shared tensor is then one parameter:
counted once in Δparams (`param_count` counts it for the first layer only), in one optimiser
group (memory_table) and saved once in state dicts (under the owner's name).

Adaptive rank (prune_at_step) needs the paper's e_concat, so it stays on kind tngram. The paper's
own ablations (use_norm, learn_scales, use_absorption; "lean" is use_norm=False,
use_absorption=False) are fields of both kinds. Docs: docs/TRAINING.md "TN-gram variants beyond
the paper".

Dimension letters: B batch, T time, N max order, R CP rank, H hash heads, E hash width per order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.kernels import lookup_out_dtype, lookup_output_for
from tngram.memory.base import INT_MAX, RowSparse, SharesParameters
from tngram.memory.hashing import allocate_primes, hash_multipliers, ngram_hash
from tngram.memory.ngrams import suffix_ngrams
from tngram.memory.token_tables import gather_rows
from tngram.memory.tngram import TNGram, TNGramConfig

ORDER_COMBINES = ("concat", "sum")


@dataclass(kw_only=True, frozen=True)
class TNGramVariantConfig(TNGramConfig):
    """TN-gram with the stages beyond the paper (module doc): TNGramConfig's fields and these."""

    order_combine: str = "concat"  # "sum": e = sum_n e_n (R features), not e_concat
    kv_rank: int = 0  # > 0: low-rank K/V, e -> Linear(kv_rank, no bias) -> K/V
    share_factors: bool = False  # one A_1..A_N for every memory layer of the model
    hash_orders: tuple[int, ...] = ()  # hybrid: an Engram-style hashed table for these orders
    hash_heads: int = 4  # hybrid: heads (primes) per hashed order
    hash_embed: int = 64  # hybrid: width per hashed order (hash_heads * head dim)
    hash_budget: int = 0  # hybrid: per-head prime budget (0: 5 * vocab_size)
    hash_seed: int = 0  # hybrid: hash multiplier seed (as Engram's seed)

    kind: ClassVar[str] = "tngram-variant"
    row_sparse: ClassVar[bool] = True  # the factors and the hybrid's table train row-sparse
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        **TNGramConfig.int_bounds,
        "hash_heads": (1, 1024),
        "hash_embed": (1, INT_MAX),
    }
    moved_fields: ClassVar[dict[str, str]] = {}

    def check_fields(self) -> None:
        super().check_fields()
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
        if self.prune_at_step:
            raise TngramError(
                "model.memory.prune_at_step (adaptive CP rank) works with the paper's module "
                "only: set model.memory.kind=tngram"
            )

    def link_layers(self, modules: list[nn.Module]) -> None:
        """Called by the model after building one module per memory layer (in layer order):
        with share_factors, the first owns A_1..A_N and the others use them."""
        if self.share_factors:
            link_shared_factors(modules)

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "TNGramVariant":
        return TNGramVariant(self, d_model, vocab_size, layer_id=layer_id, layer_ids=layer_ids)

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        layer_ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
        n = self.lookup_param_count(vocab_size)
        if self.share_factors and layer_id != layer_ids[0]:
            n -= self.max_ngram * vocab_size * self.cp_rank  # the first layer's factors
        extra, d_mem = variant_param_count(self, vocab_size, layer_id, layer_ids)
        return n + extra + self.fusion_param_count(d_model, d_mem)  # + hash table, W_down


class TNGramVariant(SharesParameters, TNGram):
    """The paper's module (TNGram) with the variant stages of its config between the lookup and
    K/V (module doc); parameter names as the paper's, plus hashed.table.weight, kv_down.weight."""

    config: TNGramVariantConfig
    hashed: HashedOrders | None
    kv_down: nn.Linear | None

    def kv_input_width(self, layer_id: int, layer_ids: tuple[int, ...]) -> int:
        c = self.config
        self.hashed, self.kv_down = None, None
        d_mem = lookup_width(c)  # (N-1) R, or R ("sum")
        if c.hash_orders:
            self.hashed = HashedOrders(c, self.vocab_size, layer_id, layer_ids)
            d_mem += self.hashed.width
        if c.kv_rank:
            self.kv_down = nn.Linear(d_mem, c.kv_rank, bias=False)
            d_mem = c.kv_rank
        return d_mem

    def kv_input(self, ids: Tensor, P: int, h: Tensor) -> Tensor:
        """The K/V input (B, T, d_mem) of the positions after the P history ids of `ids`: the
        lookup (already summed over the orders for "sum": in the Triton kernel's epilogue on
        CUDA), then the hybrid's rows beside it, then W_down."""
        c = self.config
        lowp = lookup_out_dtype(h)
        summed = c.order_combine == "sum"
        e = lookup_output_for(self.memory_vector(ids, lowp, summed)[:, P:], h, lowp)
        if self.hashed is not None:
            z = self.hashed(suffix_ngrams(ids, c.max_ngram, c.pad_id))[:, P:]
            e = torch.cat([e, z.to(e.dtype)], dim=-1)
        if self.kv_down is not None:
            e = self.kv_down(e)
        return e

    def table_parameters(self) -> list[nn.Parameter]:
        hashed = [] if self.hashed is None else [cast(nn.Parameter, self.hashed.table.weight)]
        return super().table_parameters() + hashed  # the CP factors, then the hybrid's table


def hash_primes(
    cfg: TNGramVariantConfig, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
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
        self, cfg: TNGramVariantConfig, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
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


def lookup_width(cfg: TNGramVariantConfig) -> int:
    """Width of the lookup's output after order_combine: (N-1) R, or R for "sum"."""
    return cfg.cp_rank if cfg.order_combine == "sum" else (cfg.max_ngram - 1) * cfg.cp_rank


def variant_param_count(
    cfg: TNGramVariantConfig, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
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
    shared = [m for m in modules if isinstance(m, TNGramVariant) and m.config.share_factors]
    for m in shared[1:]:
        m.share_parameter("factors", shared[0], "share_factors")
