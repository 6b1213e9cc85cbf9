"""DeepSeek Engram memory, faithful to the reference (DeepSeek's engram_demo_v1.py; paper §2 "The
n-gram concept in Engram" and App. D).

Pipeline of one Engram layer l:

    c      = P(x)                                   tokenizer compression (optional, §1)
    ngrams = suffix n-grams of c, left-padded with P(pad_id)                          (§2.1)
    z      = XOR-multiply hash mod per-head primes  -> (B, T, (N-1)*H)                (§2.2-2.4)
    rows   = z + offsets                            one table per layer, a slice per (n, head)
    e      = table[rows] flattened                  -> (B, T, (N-1)*E), E = n_embed_per_ngram
    y      = GatedFusion(h, e)                      keys/value, signed-sqrt gate, ShortConv (App. D)

The caller adds y to the residual stream (H <- H + Engram(H, x), before attention). The gate/conv
stage is `tngram.memory.gating.GatedFusion`, shared with TN-gram, so the two memories differ only
in how e is looked up.

Deliberate differences from the reference demo (§8 "bugs to not replicate"): hashing runs in torch
on the module's device, each layer hashes only itself, and ids outside [0, vocab) raise a
TngramError instead of an IndexError. Defaults follow the reference (kernel 4, dilation N,
pad_id 2); zero-init of the value projection and conv is a flag (the paper zero-inits the conv).

Dimension letters: B batch, T time, M hc branches, D model width, N max order, H heads per order,
E n_embed_per_ngram, Dh = E / H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from tngram.common import TngramError
from tngram.memory.base import INT_MAX, MemoryConfig, MemoryModule, RowSparse
from tngram.memory.compression import (
    build_compression_from_file,
    compressed_vocab_size,
    lookup_fingerprint,
)
from tngram.memory.gating import GatedFusion
from tngram.memory.hashing import allocate_primes, hash_multipliers, ngram_hash
from tngram.memory.ngrams import check_ids_in_forward, extend_with_history, suffix_ngrams
from tngram.memory.token_tables import gather_rows


@dataclass(kw_only=True, frozen=True)
class EngramConfig(MemoryConfig):
    """Engram hyper-parameters; `build` makes the module of one layer.

    table_budget: per-head prime budget of each order 2..N (reference `engram_vocab_size`);
    None -> 5 * vocab_size (the raw model vocabulary, as the reference's 5 * 129280) for every
    order. The table sizes also depend on every layer in `layer_ids` (global prime set, §2.4).
    pad_id is a raw id; with compress=True it is compressed before use.
    table_init_std: None -> tables N(0, 1) (nn.Embedding's default, as the reference); a float s
    -> N(0, s^2) (the same draw times s). tngram.hf.add_memory sets None to the base's
    `initializer_range`, as transformers initialises a new weight.
    """

    kind: ClassVar[str] = "engram"
    row_sparse: ClassVar[bool] = True  # the table trains row-sparse (Engram is RowSparse)
    injection: ClassVar[str] = "block"  # added to a block's residual stream
    int_bounds: ClassVar[dict[str, tuple[int, int]]] = {
        "max_ngram": (1, 32),
        "n_head_per_ngram": (1, 1024),
        "n_embed_per_ngram": (1, INT_MAX),
        "kernel_size": (1, 256),
        "dilation": (1, 1024),
        "hc_mult": (1, 64),
    }

    max_ngram: int = 3
    n_head_per_ngram: int = 8
    n_embed_per_ngram: int | None = None  # None -> d_model
    table_budget: tuple[int, ...] | None = None
    seed: int = 0
    pad_id: int = 2
    compress: bool = False
    tokenizer_path: str | None = None
    kernel_size: int = 4
    dilation: int | None = None  # None -> max_ngram
    hc_mult: int = 1
    kv_bias: bool = True
    zero_init_value: bool = True
    zero_init_conv: bool = True
    table_init_std: float | None = None

    def check_fields(self) -> None:
        std = self.table_init_std
        if std is not None and (type(std) not in (int, float) or not 0 < std < math.inf):
            raise TngramError(f"model.memory.table_init_std must be None or > 0, got {std!r}")
        if self.max_ngram < 2:
            raise TngramError(f"Engram max_ngram must be >= 2 (orders 2..N), got {self.max_ngram}")
        if self.n_head_per_ngram < 1:
            raise TngramError(f"n_head_per_ngram must be >= 1, got {self.n_head_per_ngram}")
        if self.n_embed_per_ngram is not None:
            self._check_embed(self.n_embed_per_ngram)
        if self.table_budget is not None:
            if len(self.table_budget) != self.max_ngram - 1:
                raise TngramError(
                    f"table_budget needs one per-head budget per order 2.."
                    f"{self.max_ngram} ({self.max_ngram - 1} values), "
                    f"got {len(self.table_budget)}"
                )
            if any(int(b) < 1 for b in self.table_budget):
                raise TngramError(f"table_budget values must be >= 1, got {self.table_budget}")
        if self.compress and not self.tokenizer_path:
            raise TngramError("Engram compress=True needs tokenizer_path (a SentencePiece model)")
        if self.kernel_size < 1:
            raise TngramError(f"kernel_size must be >= 1, got {self.kernel_size}")
        if self.dilation is not None and self.dilation < 1:
            raise TngramError(f"dilation must be >= 1, got {self.dilation}")
        if self.hc_mult < 1:
            raise TngramError(f"hc_mult must be >= 1, got {self.hc_mult}")

    def _check_embed(self, E: int) -> None:
        if E < 1 or E % self.n_head_per_ngram != 0:
            raise TngramError(
                f"n_embed_per_ngram ({E}) must be a positive multiple of "
                f"n_head_per_ngram ({self.n_head_per_ngram})"
            )

    # ---- derived sizes -------------------------------------------------------------------
    def embed_per_ngram(self, d_model: int) -> int:
        E = d_model if self.n_embed_per_ngram is None else self.n_embed_per_ngram
        self._check_embed(E)
        return E

    def budgets(self, vocab_size: int) -> tuple[int, ...]:
        if self.table_budget is not None:
            return tuple(int(b) for b in self.table_budget)
        return (5 * vocab_size,) * (self.max_ngram - 1)

    def conv_dilation(self) -> int:
        return self.max_ngram if self.dilation is None else self.dilation

    def layer_primes(
        self, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> list[list[int]]:
        """Primes [[p_{2,j}], [p_{3,j}], ...] of `layer_id` (depends on all of layer_ids)."""
        if layer_id not in layer_ids:
            raise TngramError(f"Engram layer {layer_id} is not in layer_ids {tuple(layer_ids)}")
        primes = allocate_primes(
            self.budgets(vocab_size), self.max_ngram, self.n_head_per_ngram, list(layer_ids)
        )
        return primes[layer_id]

    def check_vocab(self, vocab_size: int) -> None:
        super().check_vocab(vocab_size)
        if not 0 <= self.pad_id < vocab_size:
            raise TngramError(
                f"Engram pad_id {self.pad_id} is outside the vocabulary [0, {vocab_size})"
            )

    def param_count(
        self,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int = 0,
        layer_ids: tuple[int, ...] | None = None,
    ) -> int:
        """Exact parameter count of `build(...)`, analytically (reference §4)."""
        layer_ids = (layer_id,) if layer_ids is None else tuple(layer_ids)
        E = self.embed_per_ngram(d_model)
        Dh = E // self.n_head_per_ngram
        rows = sum(sum(p) for p in self.layer_primes(vocab_size, layer_id, layer_ids))
        d_mem, d, M, k = (self.max_ngram - 1) * E, d_model, self.hc_mult, self.kernel_size
        proj = d_mem * d + (d if self.kv_bias else 0)
        fusion = (
            (M + 1) * proj + 2 * M * d + M * d + M * d * k
        )  # K's+V, gate norms, conv norm, conv
        return rows * Dh + fusion

    def make_module(
        self, *, d_model: int, vocab_size: int, layer_id: int, layer_ids: tuple[int, ...]
    ) -> "Engram":
        return Engram(
            self,
            d_model=d_model,
            vocab_size=vocab_size,
            layer_id=layer_id,
            layer_ids=tuple(layer_ids),
        )


class Engram(RowSparse, MemoryModule, nn.Module):
    """One Engram layer: forward(h (B,T,D) or (B,T,M,D), input_ids (B,T)) -> y, same shape as h."""

    # buffers (register_buffer), declared for the type checker
    compress_lookup: Tensor | None
    multipliers: Tensor
    primes: Tensor
    offsets: Tensor

    def __init__(
        self,
        config: EngramConfig,
        *,
        d_model: int,
        vocab_size: int,
        layer_id: int,
        layer_ids: tuple[int, ...],
    ) -> None:
        super().__init__()
        cfg = config
        cfg.check_vocab(vocab_size)
        self.config, self.d_model, self.vocab_size = cfg, d_model, vocab_size
        self.layer_id, self.layer_ids = layer_id, tuple(layer_ids)
        self.max_ngram, self.n_head = cfg.max_ngram, cfg.n_head_per_ngram
        self.n_embed = cfg.embed_per_ngram(d_model)  # E
        self.head_dim = self.n_embed // self.n_head  # Dh
        self.d_mem = (cfg.max_ngram - 1) * self.n_embed  # (N-1)*E
        primes = cfg.layer_primes(vocab_size, layer_id, self.layer_ids)
        flat = [p for per_order in primes for p in per_order]  # (N-1)*H, order-major

        # ---- compression (§1) -----------------------------------------------------------
        self.compression_fingerprint: str | None = None
        if cfg.compress:
            assert cfg.tokenizer_path is not None  # EngramConfig requires it with compress
            lookup = build_compression_from_file(cfg.tokenizer_path, vocab_size)  # (V,)
            self.register_buffer("compress_lookup", lookup, persistent=False)
            self.compressed_vocab_size = compressed_vocab_size(lookup)
            self.pad_id_compressed = int(lookup[cfg.pad_id])
            self.compression_fingerprint = lookup_fingerprint(lookup)
        else:
            self.compress_lookup = None
            self.compressed_vocab_size = vocab_size
            self.pad_id_compressed = cfg.pad_id

        # ---- hashing constants (§2.3, §2.4) -----------------------------------------------
        mult = hash_multipliers(self.compressed_vocab_size, cfg.max_ngram, layer_id, cfg.seed)
        self.register_buffer("multipliers", torch.from_numpy(mult.copy()), persistent=False)  # (N,)
        self.register_buffer("primes", torch.tensor(flat, dtype=torch.int64), persistent=False)
        offsets = torch.tensor([0] + flat[:-1], dtype=torch.int64).cumsum(
            0
        )  # exclusive prefix sums
        self.register_buffer("offsets", offsets)  # ((N-1)*H,)
        self.n_rows = sum(flat)

        # ---- table (§2.5): one per layer, N(0, 1) init (nn.Embedding default) -------------
        self.table = nn.Embedding(self.n_rows, self.head_dim)
        if cfg.table_init_std is not None:  # scaled, not redrawn: later draws stay as they were
            self.table.weight.data.mul_(cfg.table_init_std)
        self.fusion = GatedFusion(
            self.d_mem,
            d_model,
            hc_mult=cfg.hc_mult,
            kernel_size=cfg.kernel_size,
            dilation=cfg.conv_dilation(),
            kv_bias=cfg.kv_bias,
            zero_init_value=cfg.zero_init_value,
            zero_init_conv=cfg.zero_init_conv,
        )

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, max_ngram={self.max_ngram}, heads={self.n_head}, "
            f"rows={self.n_rows}, head_dim={self.head_dim}, d_mem={self.d_mem}, "
            f"V'={self.compressed_vocab_size}, pad'={self.pad_id_compressed}"
        )

    def table_parameters(self) -> list[nn.Parameter]:
        return [cast(nn.Parameter, self.table.weight)]

    def control_parameters(self) -> list[nn.Parameter]:
        return self.fusion.control_parameters()

    def compress(self, input_ids: Tensor) -> Tensor:
        """Raw ids (B, T) -> compressed ids (B, T) int64 (identity when compress=False)."""
        check_ids_in_forward(input_ids, self.vocab_size)
        ids = input_ids.long()
        return ids if self.compress_lookup is None else self.compress_lookup[ids]

    def hash_ids(self, input_ids: Tensor) -> Tensor:
        """Per-head bucket ids z in [0, p): (B, T) -> (B, T, (N-1)*H), ordered (n=2, heads), ..."""
        c = self.compress(input_ids)
        ngrams = suffix_ngrams(c, self.max_ngram, self.pad_id_compressed)  # (B, T, N)
        return ngram_hash(ngrams, self.multipliers, self.primes, self.n_head)

    def row_ids(self, input_ids: Tensor) -> Tensor:
        """Table rows z + offsets: (B, T) -> (B, T, (N-1)*H)."""
        return self.hash_ids(input_ids) + self.offsets

    def memory_vector(self, input_ids: Tensor) -> Tensor:
        """The lookup stage alone: (B, T) -> e (B, T, d_mem) = concat over (n, head) of table
        rows."""
        rows = self.row_ids(input_ids)  # (B, T, (N-1)*H)
        B, T, _ = rows.shape
        # index_select instead of nn.Embedding's gather: same values, ~2x faster on CPU
        # (PERFORMANCE.md); row-sparse table gradient with sparse_grad, and a table on another
        # device read through its touched rows (tngram.kernels.sparse_rows), same values
        flat = gather_rows(self.table.weight, rows, self.sparse_grad)  # (B, T, (N-1)*H, D_h)
        return flat.view(B, T, self.d_mem)  # (B, T, (N-1)*E)

    def forward(
        self, h: Tensor, input_ids: Tensor, cache: dict | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """h (B, T, D) or (B, T, M, D), input_ids (B, T) -> y shaped like h; `cache` and `valid`
        (padding mask) as TNGram."""
        if h.dim() not in (3, 4) or h.shape[:2] != input_ids.shape or h.shape[-1] != self.d_model:
            raise TngramError(
                f"Engram expects h of shape (B, T, {self.d_model}) or (B, T, M, "
                f"{self.d_model}) matching input_ids (B, T); got h "
                f"{tuple(h.shape)} and input_ids {tuple(input_ids.shape)}"
            )
        ids, P = extend_with_history(input_ids, cache, self.max_ngram, self.config.pad_id, valid)
        # contiguous: a matmul on the sliced view (decoding's history ids dropped) rounds
        # otherwise than on the uncached call's tensor (prefill off by ~6e-7 at width 256)
        e = self.memory_vector(ids)[:, P:].contiguous()  # (B, T, d_mem)
        return self.fusion(h, e, cache, valid)  # same shape as h
